package csi

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestNodeRefusesWhatIsNotTheVolumes stages and unstages volumes whose
// backing file is not provably theirs (ErrUnsafe) or gone while the device
// holds the data (ErrOrphaned): FailedPrecondition, and the files and the
// device stay as they were.
func TestNodeRefusesWhatIsNotTheVolumes(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	c := rwCap(volume.ModeFilesystem, "ext4")
	stage := func(p published) error {
		_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: p.id, StagingTargetPath: p.staging, VolumeCapability: c})
		return err
	}
	unstage := func(p published) error {
		_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: p.id, StagingTargetPath: p.staging})
		return err
	}
	tests := []struct {
		name string
		// break_ damages volume p and returns the call to make, the file
		// whose content must not change, and how to undo the damage.
		break_ func(t *testing.T, p published, backing string) (call func() error, watched string, undo func())
	}{
		{"symlinked backing file", func(t *testing.T, p published, backing string) (func() error, string, func()) {
			victim, moved := filepath.Join(e.dir, "victim"), filepath.Join(e.dir, "moved")
			if err := os.WriteFile(victim, []byte("root's file, not a volume"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(backing, moved); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(victim, backing); err != nil {
				t.Fatal(err)
			}
			return func() error { return stage(p) }, victim, func() {
				os.Remove(backing)
				os.Rename(moved, backing)
			}
		}},
		{"hard-linked backing file", func(t *testing.T, p published, backing string) (func() error, string, func()) {
			other := filepath.Join(e.dir, "other-link")
			if err := os.Link(backing, other); err != nil {
				t.Fatal(err)
			}
			return func() error { return stage(p) }, backing, func() { os.Remove(other) }
		}},
		{"orphaned", func(t *testing.T, p published, backing string) (func() error, string, func()) {
			if err := stage(p); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(backing); err != nil {
				t.Fatal(err)
			}
			return func() error { return unstage(p) }, "", func() {
				if err := unix.Unmount(p.staging, 0); err != nil {
					t.Error(err)
				}
				if err := e.store.Delete(ctx, p.id, volume.DetachOptions{Force: true}); err != nil {
					t.Errorf("forced delete of the orphan: %v", err)
				}
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			vol := e.createVolume(t, "unsafe-"+filepath.Base(t.Name()), 32<<20, c, nil)
			p := published{id: vol.GetVolumeId(), c: c, staging: filepath.Join(e.kubelet, "staging-"+vol.GetVolumeId())}
			backing := filepath.Join(e.store.Root(), p.id)
			call, watched, undo := tc.break_(t, p, backing)
			var before [32]byte
			if watched != "" {
				before = fileSum(t, watched)
			}
			devs := devicesOf(t, p.id)
			mounts := mountCount(t, p.staging)
			wantCode(t, call(), codes.FailedPrecondition)
			if n := mountCount(t, p.staging); n != mounts {
				t.Errorf("%d mounts at the staging path, %d before", n, mounts)
			}
			if watched != "" && fileSum(t, watched) != before {
				t.Errorf("%s changed", watched)
			}
			if got := devicesOf(t, p.id); len(got) != len(devs) {
				t.Errorf("devices of the volume %v, were %v", got, devs)
			}
			undo()
			if _, err := e.store.Get(p.id); err == nil {
				if err := unstage(p); err != nil {
					t.Error(err)
				}
				if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: p.id}); err != nil {
					t.Error(err)
				}
			}
		})
	}
}

// TestBlockPublishTargetNotAFile: a block volume's target path that
// holds something other than a regular file (a FIFO a pod made, a device
// node) is refused with InvalidArgument and left as it is, never opened
// (a FIFO's open blocks, and held the volume's in-flight guard for every
// later call); the volume is published once it is a file again.
func TestBlockPublishTargetNotAFile(t *testing.T) {
	e := newTestEnv(t)
	c := rwCap(volume.ModeBlock, "")
	vol := e.createVolume(t, "target-fifo", 32<<20, c, nil)
	p := published{id: vol.GetVolumeId(), c: c, staging: filepath.Join(e.kubelet, "staging-target-fifo"),
		target: filepath.Join(e.kubelet, "pods", vol.GetVolumeId(), "target")}
	if err := os.MkdirAll(filepath.Dir(p.target), 0o750); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{
		VolumeId: p.id, StagingTargetPath: p.staging, VolumeCapability: c}); err != nil {
		t.Fatal(err)
	}
	for _, plant := range []struct {
		name string
		make func(path string) error
	}{
		{"fifo", func(path string) error { return unix.Mkfifo(path, 0o600) }},
		{"device node", func(path string) error { return unix.Mknod(path, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3))) }}, // /dev/null
		{"directory", func(path string) error { return os.Mkdir(path, 0o700) }},
	} {
		t.Run(plant.name, func(t *testing.T) {
			q := p
			q.target = filepath.Join(e.kubelet, "pods", p.id, plant.name)
			if err := plant.make(q.target); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.Remove(q.target) })
			var before unix.Stat_t
			if err := unix.Lstat(q.target, &before); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
				VolumeId: q.id, StagingTargetPath: q.staging, TargetPath: q.target, VolumeCapability: c})
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("NodePublishVolume onto a %s = %v, want InvalidArgument", plant.name, err)
			}
			var after unix.Stat_t
			if err := unix.Lstat(q.target, &after); err != nil || after.Ino != before.Ino || after.Mode != before.Mode || mountCount(t, q.target) != 0 {
				t.Errorf("the %s at the target changed or was mounted on: %+v, %v", plant.name, after, err)
			}
		})
	}
	e.publish(t, p)
	e.teardown(t, p)
}
