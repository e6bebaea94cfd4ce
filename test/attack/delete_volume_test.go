package attack

import (
	"os"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// DeleteVolume refuses (FailedPrecondition, nothing changed) while the
// volume's data is reachable elsewhere: its file deleted but its device
// still holding the data, a second hard link, a foreign loop device on
// its file.
func TestDeleteVolumeRefusesCSI(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(c *kase, p *plugin, id string)
	}{
		{"orphaned", func(c *kase, p *plugin, id string) {
			c.attach(p.store, id)
			if err := os.Remove(p.backingFile(id)); err != nil {
				c.t.Fatal(err)
			}
		}},
		{"hard-linked", func(c *kase, p *plugin, id string) {
			c.mkdir("victim")
			if err := os.Link(p.backingFile(id), c.path("victim", "second")); err != nil {
				c.t.Fatal(err)
			}
			c.watch(c.path("victim", "second"))
		}},
		{"foreign device", func(c *kase, p *plugin, id string) {
			c.foreignLoop(p.backingFile(id), 0, 0, false, "")
			c.watch(p.backingFile(id))
		}},
		{"foreign read-only device at an offset", func(c *kase, p *plugin, id string) {
			c.foreignLoop(p.backingFile(id), 1<<20, 0, true, "")
			c.watch(p.backingFile(id))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			id := p.createVolume("pvc-delete", 16<<20, nil)
			tc.setup(c, p, id)
			before := c.snapshot()
			_, err := p.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id})
			c.expectGRPC(err, codes.FailedPrecondition)
			c.unchanged(before)
		})
	}
}

// CreateVolume refuses a name shaped like a UUID (it could stand for
// another volume's UUID): InvalidArgument, nothing created.
func TestCreateVolumeUUIDName(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	p := c.startPlugin("022")
	id := p.createVolume("pvc-first", 16<<20, nil)
	before := c.snapshot()
	_, err := p.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
		Name:               id,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4")},
	})
	c.expectGRPC(err, codes.InvalidArgument)
	c.unchanged(before)
}
