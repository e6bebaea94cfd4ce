package csi

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestNewerRecordRefused: a volume of the driver whose record a newer
// sparsevol wrote is listed by ListVolumes, and every call on it is
// FailedPrecondition, changing nothing: its record stays byte for byte.
func TestNewerRecordRefused(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	c := rwCap(volume.ModeBlock, "")
	vol := e.createVolume(t, "newer", 8<<20, c, nil)
	id := vol.GetVolumeId()
	path := filepath.Join(e.store.Root(), id+".json")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	newer := bytes.Replace(data, []byte(`"format": 1,`), []byte(`"format": 2,`), 1)
	if bytes.Equal(newer, data) {
		t.Fatalf("record %s carries no format 1:\n%s", path, data)
	}
	if err := os.WriteFile(path, newer, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(path, data, 0o600) }) // for the env's cleanup

	list, err := e.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 1 || list.GetEntries()[0].GetVolume().GetVolumeId() != id {
		t.Errorf("ListVolumes = %v, %v; want the newer volume listed", list, err)
	}
	staging := filepath.Join(e.kubelet, "plugins", "staging")
	for _, call := range []struct {
		name string
		fn   func() error
	}{
		{"DeleteVolume", func() error { _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); return err }},
		{"ControllerExpandVolume", func() error {
			_, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
			return err
		}},
		{"CreateSnapshot", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: id})
			return err
		}},
		{"NodeStageVolume", func() error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: c})
			return err
		}},
		{"NodeUnstageVolume", func() error {
			_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		}},
	} {
		wantCode(t, call.fn(), codes.FailedPrecondition)
		if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, newer) {
			t.Fatalf("%s changed the record %s: %v\n%s", call.name, path, err, got)
		}
	}
}
