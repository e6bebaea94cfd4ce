package csi

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestNodeExpandRefusesBadRange sends NodeExpandVolume capacity ranges no
// size can meet for a published volume: InvalidArgument, and the volume
// keeps its size.
func TestNodeExpandRefusesBadRange(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	c := rwCap(volume.ModeFilesystem, "xfs")
	vol := e.createVolume(t, "expand-range", 300<<20, c, nil)
	p := e.stageAndPublish(t, vol.GetVolumeId(), c)
	defer e.teardown(t, p)
	tests := []struct {
		name string
		cr   *csi.CapacityRange
	}{
		{"negative required", &csi.CapacityRange{RequiredBytes: -1 << 20}},
		{"negative limit", &csi.CapacityRange{LimitBytes: -1 << 20}},
		{"negative both", &csi.CapacityRange{RequiredBytes: -1, LimitBytes: -1}},
		{"required beyond limit", &csi.CapacityRange{RequiredBytes: 400 << 20, LimitBytes: 350 << 20}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{
				VolumeId: p.id, VolumePath: p.target, StagingTargetPath: p.staging, CapacityRange: tc.cr, VolumeCapability: c,
			})
			wantCode(t, err, codes.InvalidArgument)
			if got := volumeSize(t, e, p.id); got != 300<<20 {
				t.Errorf("volume size %d after a refused expand, want %d", got, 300<<20)
			}
		})
	}
}

// TestExpandRefusesUnmanaged: the expand RPCs refuse a volume the driver
// did not create (node mode, made with the CLI), even one staged and
// published through the plugin: FailedPrecondition, and the volume, its
// file and its filesystem keep their size.
func TestExpandRefusesUnmanaged(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	const size = 64 << 20
	c := rwCap(volume.ModeFilesystem, "ext4")
	v, err := e.store.Create(ctx, volume.CreateRequest{Name: "node-mode", SizeBytes: size, Mode: volume.ModeFilesystem, FSType: "ext4"})
	if err != nil {
		t.Fatal(err)
	}
	p := e.stageAndPublish(t, v.UUID, c)
	t.Cleanup(func() {
		e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: p.id, TargetPath: p.target})
		e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: p.id, StagingTargetPath: p.staging})
	})
	fsBytes := totalBytes(t, e, p)
	for _, tc := range []struct {
		name string
		call func() error
	}{
		{"ControllerExpandVolume", func() error {
			_, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: p.id,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * size}})
			return err
		}},
		{"NodeExpandVolume", func() error {
			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: p.id, VolumePath: p.target,
				StagingTargetPath: p.staging, CapacityRange: &csi.CapacityRange{RequiredBytes: 4 * size}, VolumeCapability: c})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantCode(t, tc.call(), codes.FailedPrecondition)
			if got := volumeSize(t, e, p.id); got != size {
				t.Errorf("volume size %d after a refused expand, want %d", got, size)
			}
			if fi, err := os.Stat(filepath.Join(e.store.Root(), p.id)); err != nil || fi.Size() != size {
				t.Errorf("backing file after a refused expand: %v, %v; want %d bytes", fi, err, size)
			}
			if got := totalBytes(t, e, p); got != fsBytes {
				t.Errorf("filesystem of %d bytes after a refused expand, was %d", got, fsBytes)
			}
		})
	}
}

// TestNodeExpandVolumePath sends NodeExpandVolume volume paths below the
// kubelet directory where the volume is not: NotFound, and the volume
// keeps its size.
func TestNodeExpandVolumePath(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	const size = 32 << 20
	c := rwCap(volume.ModeFilesystem, "ext4")
	vol := e.createVolume(t, "expand-path", size, c, nil)
	p := e.stageAndPublish(t, vol.GetVolumeId(), c)
	t.Cleanup(func() { e.teardown(t, p) })
	other := e.createVolume(t, "expand-path-other", size, c, nil)
	q := e.stageAndPublish(t, other.GetVolumeId(), c)
	t.Cleanup(func() { e.teardown(t, q) })
	empty := filepath.Join(e.kubelet, "pods", "empty")
	if err := os.MkdirAll(empty, 0o750); err != nil {
		t.Fatal(err)
	}
	foreign := filepath.Join(e.kubelet, "pods", "foreign")
	mountTmpfs(t, foreign)
	covered := filepath.Join(e.kubelet, "pods", "covered")
	if err := os.MkdirAll(covered, 0o750); err != nil {
		t.Fatal(err)
	}
	e.publish(t, published{id: p.id, c: c, staging: p.staging, target: covered})
	t.Cleanup(func() {
		if _, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: p.id, TargetPath: covered}); err != nil {
			t.Errorf("NodeUnpublishVolume %s: %v", covered, err)
		}
	})
	mountTmpfs(t, covered) // its cleanup, first, uncovers the volume
	for _, tc := range []struct{ name, path string }{
		{"empty directory", empty},
		{"foreign mount", foreign},
		{"another volume", q.target},
		{"the volume covered by a foreign mount", covered},
		{"missing", filepath.Join(e.kubelet, "pods", "missing")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: p.id, VolumePath: tc.path,
				StagingTargetPath: p.staging, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * size}, VolumeCapability: c})
			wantCode(t, err, codes.NotFound)
			if got := volumeSize(t, e, p.id); got != size {
				t.Errorf("volume size %d after a refused expand, want %d", got, size)
			}
		})
	}
}

// TestNodeExpandBlockAtPublishPath grows a published block volume the
// way kubelet asks for it: volume_path is the pod's device file (the
// publish target, where the device is bound). The device seen through
// that file has the new size; another block volume's file is NotFound.
func TestNodeExpandBlockAtPublishPath(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	const size, grown = 32 << 20, 64 << 20
	c := rwCap(volume.ModeBlock, "")
	vol := e.createVolume(t, "expand-block", size, c, nil)
	p := e.stageAndPublish(t, vol.GetVolumeId(), c)
	t.Cleanup(func() { e.teardown(t, p) })
	other := e.createVolume(t, "expand-block-other", size, c, nil)
	q := e.stageAndPublish(t, other.GetVolumeId(), c)
	t.Cleanup(func() { e.teardown(t, q) })

	expand := func(path string) error {
		_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: p.id, VolumePath: path,
			StagingTargetPath: p.staging, CapacityRange: &csi.CapacityRange{RequiredBytes: grown}, VolumeCapability: c})
		return err
	}
	wantCode(t, expand(q.target), codes.NotFound)
	if got := volumeSize(t, e, p.id); got != size {
		t.Fatalf("volume size %d after a refused expand, want %d", got, size)
	}
	if err := expand(p.target); err != nil {
		t.Fatalf("NodeExpandVolume at the publish path: %v", err)
	}
	f, err := os.Open(p.target)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n, err := unix.IoctlGetUint64(int(f.Fd()), unix.BLKGETSIZE64)
	if err != nil {
		t.Fatalf("BLKGETSIZE64 %s: %v", p.target, err)
	}
	if n != grown {
		t.Errorf("device at %s is %d bytes after NodeExpandVolume, want %d", p.target, n, grown)
	}
}

// TestExpandRefusesSizeBeyondLimit asks both expand RPCs for a size no
// whole MiB meets within limit_bytes (one byte more than the volume):
// OutOfRange, and the record and the backing file keep their size.
func TestExpandRefusesSizeBeyondLimit(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	const size = 32 << 20
	c := rwCap(volume.ModeBlock, "")
	vol := e.createVolume(t, "expand-limit", size, c, nil)
	p := e.stageAndPublish(t, vol.GetVolumeId(), c)
	t.Cleanup(func() { e.teardown(t, p) })
	cr := &csi.CapacityRange{RequiredBytes: size + 1, LimitBytes: size + 1}
	for _, tc := range []struct {
		name string
		call func() error
	}{
		{"ControllerExpandVolume", func() error {
			_, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: p.id, CapacityRange: cr})
			return err
		}},
		{"NodeExpandVolume", func() error {
			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: p.id, VolumePath: p.target,
				StagingTargetPath: p.staging, CapacityRange: cr, VolumeCapability: c})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantCode(t, tc.call(), codes.OutOfRange)
			if got := volumeSize(t, e, p.id); got != size {
				t.Errorf("volume size %d after a refused expand, want %d", got, size)
			}
			if fi, err := os.Stat(filepath.Join(e.store.Root(), p.id)); err != nil || fi.Size() != size {
				t.Errorf("backing file after a refused expand: %v, %v; want %d bytes", fi, err, size)
			}
		})
	}
}

// A capacity range with only a limit that is not a whole MiB asks for no
// more than the limit: the volume grows to the largest whole MiB within
// it, where rounding the limit up would pass it.
func TestControllerExpandToALimitOnly(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	const size = 32 << 20
	c := rwCap(volume.ModeBlock, "")
	vol := e.createVolume(t, "expand-limit-only", size, c, nil)
	cr := &csi.CapacityRange{LimitBytes: size + 5<<20 + 512}
	resp, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(), CapacityRange: cr})
	if err != nil {
		t.Fatalf("ControllerExpandVolume to at most %d bytes: %v", cr.LimitBytes, err)
	}
	if want := int64(size + 5<<20); resp.GetCapacityBytes() != want || volumeSize(t, e, vol.GetVolumeId()) != want {
		t.Errorf("expanded to %d bytes (record %d), want %d", resp.GetCapacityBytes(), volumeSize(t, e, vol.GetVolumeId()), want)
	}
}
