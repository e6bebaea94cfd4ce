package attack

import (
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"
)

// attach --all and detach --all go through the same ownership proof as
// one volume: a symlinked, hard-linked or foreign-bound volume is refused
// (exit 1) while the others attach, and the victims, the foreign devices
// and the unsafe volumes' links stay as they were.
func TestBatchAttachDetachRefusesUnsafe(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	c.create(s, "good")
	sym := c.create(s, "symlinked")
	replaceWithSymlink(t, filepath.Join(s, sym), c.victim("host-file", 16<<20))
	hard := c.create(s, "hardlinked")
	c.mkdir("victim")
	if err := os.Link(filepath.Join(s, hard), c.path("victim", "second")); err != nil {
		t.Fatal(err)
	}
	c.watch(c.path("victim", "second"))
	bound := c.create(s, "bound", "--size", "64M")
	c.foreignLoop(filepath.Join(s, bound), 1<<20, 8<<20, true, "")
	c.watch(filepath.Join(s, bound))
	before := c.snapshot()

	c.expectCode(c.sv(s, "attach", "--all"), 1)
	if st := c.status(s, "good"); !st.Attached {
		t.Errorf("attach --all did not attach the good volume")
	}
	c.expectCode(c.sv(s, "detach", "--all"), 0, 1)
	c.unchanged(before)
}

// NodePublish of a volume that is not staged stages it first, through the
// same rules as NodeStage: a foreign device on its file or a filesystem
// that is not its own is FailedPrecondition, nothing mounted or formatted.
func TestPublishRestageRefuses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(c *kase, p *plugin, id string)
	}{
		{"foreign device", func(c *kase, p *plugin, id string) {
			c.foreignLoop(p.backingFile(id), 1<<20, 8<<20, true, "")
		}},
		{"superblock zeroed", func(c *kase, p *plugin, id string) {
			f, err := os.OpenFile(p.backingFile(id), os.O_WRONLY, 0)
			if err != nil {
				c.t.Fatal(err)
			}
			defer f.Close()
			if _, err := f.WriteAt(make([]byte, 1024), 1024); err != nil {
				c.t.Fatal(err)
			}
			// Attached (after the damage): publish finds the device
			// there, as in TestStageNeverFormats.
			c.attach(p.store, id)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			id := p.createVolume("pvc-publish", 16<<20, nil)
			tc.setup(c, p, id)
			c.watch(p.backingFile(id))
			before := c.snapshot()
			c.expectGRPC(p.publish(id, p.stagingPath(id), p.targetPath(id)), codes.FailedPrecondition)
			c.unchanged(before)
		})
	}
}
