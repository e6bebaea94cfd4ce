package csi

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestNodeGetVolumeHealthPaths asks NodeGetVolumeHealth about paths where
// the volume is, and paths below the kubelet directory where it is not
// (volumeAt's rule): the first are healthy, the others inaccessible.
func TestNodeGetVolumeHealthPaths(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	fsCap := rwCap(volume.ModeFilesystem, "ext4")
	fsVol := e.createVolume(t, "health-fs", 32<<20, fsCap, nil)
	p := e.stageAndPublish(t, fsVol.GetVolumeId(), fsCap)
	t.Cleanup(func() { e.teardown(t, p) })
	blockCap := rwCap(volume.ModeBlock, "")
	blockVol := e.createVolume(t, "health-block", 16<<20, blockCap, nil)
	b := e.stageAndPublish(t, blockVol.GetVolumeId(), blockCap)
	t.Cleanup(func() { e.teardown(t, b) })

	empty := filepath.Join(e.kubelet, "pods", "empty")
	if err := os.MkdirAll(empty, 0o750); err != nil {
		t.Fatal(err)
	}
	foreign := filepath.Join(e.kubelet, "pods", "foreign")
	mountTmpfs(t, foreign)
	covered := publishCovered(t, e, p, filepath.Join(e.kubelet, "pods", "covered"))
	blockCovered := publishCovered(t, e, b, filepath.Join(e.kubelet, "pods", "block-covered"))

	for _, tc := range []struct {
		name             string
		id               string
		staging, publish string
		healthy          bool
	}{
		{"filesystem staged and published", p.id, p.staging, p.target, true},
		{"filesystem staged", p.id, p.staging, "", true},
		{"block staged and published", b.id, b.staging, b.target, true},
		{"block staged (the attach alone)", b.id, b.staging, "", true},
		{"empty directory", p.id, "", empty, false},
		{"empty staging directory", p.id, empty, p.target, false},
		{"foreign mount", p.id, "", foreign, false},
		{"another volume", p.id, "", b.target, false},
		{"the volume covered by a foreign mount", p.id, p.staging, covered, false},
		{"block volume covered by a foreign bind", b.id, b.staging, blockCovered, false},
		{"missing", p.id, "", filepath.Join(e.kubelet, "pods", "missing"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := e.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{
				VolumeId: tc.id, StagingTargetPath: tc.staging, VolumePublishPath: tc.publish,
			})
			if err != nil {
				t.Fatalf("NodeGetVolumeHealth: %v", err)
			}
			h := resp.GetVolumeHealth().GetHealthStatuses()
			switch {
			case tc.healthy && len(h) != 0:
				t.Errorf("health = %v, want no adverse status", h)
			case !tc.healthy && (len(h) != 1 || h[0].GetStatus() != csi.VolumeHealthErrorType_INACCESSIBLE):
				t.Errorf("health = %v, want INACCESSIBLE", h)
			}
		})
	}
}

// publishCovered publishes p's volume at target as well, then mounts
// something else over it (a tmpfs on a directory, a bind of a file on a
// file), and returns target. The cleanups uncover and unpublish it.
func publishCovered(t *testing.T, e *testEnv, p published, target string) string {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		t.Fatal(err)
	}
	if p.c.GetMount() != nil {
		if err := os.MkdirAll(target, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	e.publish(t, published{id: p.id, c: p.c, staging: p.staging, target: target})
	t.Cleanup(func() {
		if _, err := e.node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: p.id, TargetPath: target}); err != nil {
			t.Errorf("NodeUnpublishVolume %s: %v", target, err)
		}
	})
	if p.c.GetMount() != nil {
		mountTmpfs(t, target) // its cleanup, first, uncovers the volume
		return target
	}
	other := filepath.Join(t.TempDir(), "other")
	if err := os.WriteFile(other, []byte("not the volume"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(other, target, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(target, 0); err != nil {
			t.Errorf("cleanup: unmount %s: %v", target, err)
		}
	})
	return target
}
