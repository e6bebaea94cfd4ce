package csi

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/testutil"
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

// TestNodePathSwapped: a directory of a staging or target path swapped
// for a link to another directory after the call walked the path (what a
// pod writing below the kubelet directory can race) is never mounted
// through: stage and publish of a filesystem volume and publish of a
// block volume mount on the directory the walk found, wherever it was
// moved, and nothing is mounted where the link points.
func TestNodePathSwapped(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	t.Cleanup(func() { nodePathRace = nil })
	for _, tt := range []struct {
		name  string
		mode  volume.Mode
		stage bool // swap on the stage call, else on the publish call
	}{
		{"stage filesystem", volume.ModeFilesystem, true},
		{"publish filesystem", volume.ModeFilesystem, false},
		{"publish block", volume.ModeBlock, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			fs := "ext4"
			if tt.mode == volume.ModeBlock {
				fs = ""
			}
			c := rwCap(tt.mode, fs)
			vol := e.createVolume(t, "swap-"+strings.ReplaceAll(tt.name, " ", "-"), 32<<20, c, nil)
			id := vol.GetVolumeId()
			p := published{id: id, c: c, staging: filepath.Join(e.kubelet, "staging", id, "mount"),
				target: filepath.Join(e.kubelet, "pods", id, "mount", "target")}
			swapped := filepath.Dir(p.target)
			if tt.stage {
				swapped = filepath.Dir(p.staging)
			}
			for _, d := range []string{swapped, filepath.Dir(p.target)} {
				if err := os.MkdirAll(d, 0o750); err != nil {
					t.Fatal(err)
				}
			}
			victim := t.TempDir()
			if tt.mode == volume.ModeBlock {
				if err := os.WriteFile(filepath.Join(victim, "target"), nil, 0o600); err != nil {
					t.Fatal(err)
				}
			} else {
				for _, d := range []string{"mount", "target"} {
					if err := os.Mkdir(filepath.Join(victim, d), 0o700); err != nil {
						t.Fatal(err)
					}
				}
			}
			sw := swap{dir: swapped, victim: victim}
			stage := func() error {
				_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: p.staging, VolumeCapability: c})
				return err
			}
			publish := func() error {
				_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: p.staging,
					TargetPath: p.target, VolumeCapability: c})
				return err
			}
			if !tt.stage {
				if err := stage(); err != nil {
					t.Fatal(err)
				}
			}
			sw.race(t, func(path string) bool { return strings.HasPrefix(path, swapped+"/") })
			call := publish
			if tt.stage {
				call = stage
			}
			err := call()
			if !sw.ran() {
				t.Fatalf("%s walked no path below %s: the race was never run (%v)", tt.name, swapped, err)
			}
			if err != nil {
				t.Errorf("%s with a directory swapped for a link after the walk: %v", tt.name, err)
			}
			for _, d := range []string{"mount", "target"} {
				if mountCount(t, filepath.Join(victim, d)) != 0 {
					unix.Unmount(filepath.Join(victim, d), unix.MNT_DETACH)
					t.Errorf("%s was mounted on through the link", filepath.Join(victim, d))
				}
			}
			last := filepath.Base(p.target)
			if tt.stage {
				last = filepath.Base(p.staging)
			}
			if mountCount(t, filepath.Join(sw.moved(), last)) != 1 {
				t.Errorf("the volume is not mounted on the directory the walk found, now %s", filepath.Join(sw.moved(), last))
			}
			sw.restore(t) // the mounts move with their directory
			if tt.stage {
				e.publish(t, p)
			}
			e.teardown(t, p)
		})
	}
}

// TestNodeTeardownSwapped: a directory of a target path swapped for a
// link to another directory between unpublish's look at the mount table
// and its unmount never leads the unmount, or the target's removal,
// through the link: someone else's mount where the link points stays
// mounted, and the unmount takes the volume's own bind away from the
// directory it found.
func TestNodeTeardownSwapped(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	t.Cleanup(func() { nodePathRace = nil })
	c := rwCap(volume.ModeFilesystem, "ext4")
	vol := e.createVolume(t, "swap-teardown", 32<<20, c, nil)
	id := vol.GetVolumeId()
	p := published{id: id, c: c, staging: filepath.Join(e.kubelet, "staging", id),
		target: filepath.Join(e.kubelet, "pods", id, "mount", "target")}
	if err := os.MkdirAll(p.staging, 0o750); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: p.staging, VolumeCapability: c}); err != nil {
		t.Fatal(err)
	}
	e.publish(t, p)
	victim := t.TempDir()
	foreign := filepath.Join(victim, "target")
	if err := os.Mkdir(foreign, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("someone-else", foreign, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(foreign, unix.MNT_DETACH) })
	sw := swap{dir: filepath.Dir(p.target), victim: victim}
	sw.race(t, func(path string) bool { return path == p.target })
	_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: p.target})
	if !sw.ran() {
		t.Fatalf("unpublish unmounted nothing: the race was never run (%v)", err)
	}
	t.Logf("unpublish with the target's directory swapped: %v", err)
	if !testutil.IsMountPoint(t, foreign) {
		t.Errorf("someone else's mount at %s was unmounted through the link", foreign)
	}
	if testutil.IsMountPoint(t, filepath.Join(sw.moved(), "target")) {
		t.Errorf("the volume's bind at %s (moved) is still mounted", filepath.Join(sw.moved(), "target"))
	}
	sw.restore(t)
	e.teardown(t, p)
}

// swap replaces the directory dir with a link to victim, once, from
// nodePathRace: what a pod racing a node call would do.
type swap struct{ dir, victim string }

func (s swap) moved() string { return s.dir + ".moved" }

// race arms nodePathRace to swap at the first path match accepts.
func (s swap) race(t *testing.T, match func(path string) bool) {
	nodePathRace = func(path string) {
		if !match(path) {
			return
		}
		nodePathRace = nil
		if err := os.Rename(s.dir, s.moved()); err != nil {
			t.Error(err)
		}
		if err := os.Symlink(s.victim, s.dir); err != nil {
			t.Error(err)
		}
	}
}

// ran reports whether the swap happened, and disarms it either way.
func (s swap) ran() bool {
	ran := nodePathRace == nil
	nodePathRace = nil
	return ran
}

// restore puts the directory back in place of the link.
func (s swap) restore(t *testing.T) {
	t.Helper()
	if err := os.Remove(s.dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(s.moved(), s.dir); err != nil {
		t.Fatal(err)
	}
}
