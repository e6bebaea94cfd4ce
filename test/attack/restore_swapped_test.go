package attack

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// CreateVolume from a snapshot whose file in the store was swapped for a
// symbolic link to a victim, or for a second hard link of one, refuses
// (FailedPrecondition) and makes nothing: no volume, and so no pod, ever
// holds the victim's bytes.
func TestRestoreFromSwappedSnapshotCSI(t *testing.T) {
	for _, tc := range []struct {
		name string
		swap func(snapFile, victim string) error
	}{
		{"symlink to a victim", func(snapFile, victim string) error {
			if err := os.Remove(snapFile); err != nil {
				return err
			}
			return os.Symlink(victim, snapFile)
		}},
		{"hard link of a victim", func(snapFile, victim string) error {
			if err := os.Remove(snapFile); err != nil {
				return err
			}
			return os.Link(victim, snapFile)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			id := p.createVolume("pvc-source", 16<<20, nil)
			snap, err := p.ctrl.CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: id})
			if err != nil {
				t.Fatalf("CreateSnapshot: %v", err)
			}
			victim := c.victim("secret", 16<<20)
			if err := tc.swap(filepath.Join(p.store, ".snapshots", snap.GetSnapshot().GetSnapshotId()), victim); err != nil {
				t.Fatal(err)
			}
			before := c.snapshot()
			_, err = p.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
				Name:               "pvc-restored",
				VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4")},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
					Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}},
			})
			c.expectGRPC(err, codes.FailedPrecondition)
			c.unchanged(before)
		})
	}
}
