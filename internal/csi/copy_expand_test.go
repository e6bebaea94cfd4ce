package csi

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestCopyBetweenExpandHalves copies a volume between the two halves of
// its expansion, as the snapshotter or provisioner may while the resizer
// waits for kubelet: ControllerExpandVolume grew the file, the filesystem
// waits for NodeExpandVolume. A copy at the volume's new size is a
// volume of that size, filesystem and all; kubelet never expands it,
// since its claim asked for no more than it got.
func TestCopyBetweenExpandHalves(t *testing.T) {
	const small, large = 32 * mib, 64 * mib
	c := rwCap(volume.ModeFilesystem, "ext4")
	tests := []struct {
		name string
		// copy makes a volume of src with content source made by it.
		copy func(e *testEnv, src string) (*csi.VolumeContentSource, error)
	}{
		{"restore", func(e *testEnv, src string) (*csi.VolumeContentSource, error) {
			resp, err := e.ctrl.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: src})
			return snapSource(resp.GetSnapshot().GetSnapshotId()), err
		}},
		{"clone", func(e *testEnv, src string) (*csi.VolumeContentSource, error) {
			return volSource(src), nil
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newTestEnv(t)
			ctx := context.Background()
			src := e.createVolume(t, "src", small, c, nil)
			exp, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
				VolumeId: src.VolumeId, CapacityRange: &csi.CapacityRange{RequiredBytes: large}, VolumeCapability: c,
			})
			if err != nil || exp.CapacityBytes != large || !exp.NodeExpansionRequired {
				t.Fatalf("ControllerExpandVolume = %v, %v; want %d bytes, node expansion required", exp, err, large)
			}
			source, err := tc.copy(e, src.VolumeId)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name: "copy", VolumeCapabilities: []*csi.VolumeCapability{c},
				CapacityRange: &csi.CapacityRange{RequiredBytes: large}, VolumeContentSource: source,
			})
			if err != nil {
				t.Fatalf("CreateVolume from %v: %v", source, err)
			}
			if got := resp.GetVolume().CapacityBytes; got != large {
				t.Fatalf("copy of %d bytes, want %d", got, large)
			}
			p := e.stageAndPublish(t, resp.GetVolume().VolumeId, c)
			// ext4 keeps a few MiB of a 64 MiB filesystem to itself; one
			// of the source's 32 MiB is far below.
			if got := totalBytes(t, e, p); got < large*3/4 {
				t.Errorf("the copy's filesystem holds %d bytes of its %d", got, large)
			}
			e.teardown(t, p)
		})
	}
}
