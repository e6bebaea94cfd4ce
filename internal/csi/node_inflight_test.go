package csi

import (
	"context"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestNodePathInFlight mounts two volumes at one path at once: the call
// of the second, while the first is between its checks and its mount, is
// Aborted, so the path holds one volume, never one hidden under another
// (the checks of both would pass, and both would answer success).
func TestNodePathInFlight(t *testing.T) {
	c := rwCap(volume.ModeFilesystem, "ext4")
	ctx := context.Background()
	stage := func(e *testEnv, id, path string) error {
		_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: path, VolumeCapability: c})
		return err
	}
	tests := []struct {
		name string
		// mount puts volume i (0 or 1) of vols at path.
		mount func(e *testEnv, vols []published, i int, path string) error
		// unmount takes volume i away from path.
		unmount func(e *testEnv, vols []published, i int, path string) error
	}{
		{"stage", func(e *testEnv, vols []published, i int, path string) error {
			return stage(e, vols[i].id, path)
		}, func(e *testEnv, vols []published, i int, path string) error {
			_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vols[i].id, StagingTargetPath: path})
			return err
		}},
		{"publish", func(e *testEnv, vols []published, i int, path string) error {
			if err := stage(e, vols[i].id, vols[i].staging); err != nil {
				return err
			}
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
				VolumeId: vols[i].id, StagingTargetPath: vols[i].staging, TargetPath: path, VolumeCapability: c,
			})
			return err
		}, func(e *testEnv, vols []published, i int, path string) error {
			if _, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vols[i].id, TargetPath: path}); err != nil {
				return err
			}
			_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vols[i].id, StagingTargetPath: vols[i].staging})
			return err
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newTestEnv(t)
			vols := make([]published, 2)
			for i, name := range []string{"first", "second"} {
				v := e.createVolume(t, name, 16<<20, c, nil)
				vols[i] = published{id: v.GetVolumeId(), c: c, staging: filepath.Join(e.kubelet, "staging-"+name)}
			}
			path := filepath.Join(e.kubelet, "shared")
			arrived, release := make(chan struct{}), make(chan struct{})
			var held atomic.Bool
			nodePathRace = func(p string) {
				if p == path && held.CompareAndSwap(false, true) {
					close(arrived)
					<-release // the second call passes
				}
			}
			t.Cleanup(func() { nodePathRace = nil })
			first := make(chan error, 1)
			go func() { first <- tc.mount(e, vols, 0, path) }()
			<-arrived // the first call walked path and is about to mount there
			second := tc.mount(e, vols, 1, path)
			close(release)
			if err := <-first; err != nil {
				t.Fatalf("first volume at %s: %v", path, err)
			}
			if status.Code(second) != codes.Aborted {
				t.Errorf("second volume at %s while the first is mounted there: %v, want Aborted", path, second)
			}
			if n := mountCount(t, path); n != 1 {
				t.Errorf("%d mounts at %s, want the first volume's alone", n, path)
			}
			// What the second call did (a publish's stage) goes too.
			for _, i := range []int{1, 0} {
				if err := tc.unmount(e, vols, i, path); err != nil {
					t.Errorf("take volume %d away: %v", i, err)
				}
			}
		})
	}
}
