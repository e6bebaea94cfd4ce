package attack

import (
	"os"
	"testing"

	"google.golang.org/grpc/codes"
)

// NodeStage of a volume whose backing file was replaced by a symlink, or
// has a second hard link, is FailedPrecondition: the victim (which looks
// blank) is neither bound nor formatted nor mounted.
func TestStageLinkedBackingFile(t *testing.T) {
	for _, kind := range []string{"symlink", "hard link"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			id := p.createVolume("pvc-linked", 16<<20, nil)
			file := p.backingFile(id)
			if kind == "symlink" {
				replaceWithSymlink(t, file, c.zeroFile("host-disk", 16<<20))
			} else {
				// A blank volume file with a second name outside the store.
				if err := os.Truncate(file, 0); err != nil {
					t.Fatal(err)
				}
				if err := os.Truncate(file, 16<<20); err != nil {
					t.Fatal(err)
				}
				c.mkdir("victim")
				if err := os.Link(file, c.path("victim", "host-disk")); err != nil {
					t.Fatal(err)
				}
				c.watch(c.path("victim", "host-disk"))
			}
			before := c.snapshot()
			c.expectGRPC(p.stage(id, p.stagingPath(id)), codes.FailedPrecondition)
			c.unchanged(before)
		})
	}
}
