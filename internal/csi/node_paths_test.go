package csi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/sparsevol/sparsevol/internal/volume"
)

func TestCheckNodePath(t *testing.T) {
	kubelet := t.TempDir()
	outside := t.TempDir()
	if err := os.MkdirAll(filepath.Join(kubelet, "pods", "a"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(kubelet, "pods", "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(outside, "missing"), filepath.Join(kubelet, "pods", "dangling")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(kubelet, "file"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, path string
		ok         bool
	}{
		{"below, existing", filepath.Join(kubelet, "pods", "a"), true},
		{"below, not yet made", filepath.Join(kubelet, "pods", "a", "b", "mount"), true},
		{"empty", "", false},
		{"relative", "pods/a", false},
		{"dot-dot out", filepath.Join(kubelet, "pods") + "/../../etc", false},
		{"dot-dot inside", kubelet + "/pods/../pods/a", false},
		{"trailing slash", filepath.Join(kubelet, "pods", "a") + "/", false},
		{"double slash", kubelet + "//pods", false},
		{"/etc", "/etc", false},
		{"outside", outside, false},
		{"the kubelet dir itself", kubelet, false},
		{"a sibling sharing the prefix", kubelet + "x/pods", false},
		{"symlink component", filepath.Join(kubelet, "pods", "link", "mount"), false},
		{"symlink last", filepath.Join(kubelet, "pods", "link"), false},
		{"symlink component, more missing below", filepath.Join(kubelet, "pods", "link", "x", "y", "mount"), false},
		{"dangling symlink component", filepath.Join(kubelet, "pods", "dangling", "mount"), false},
		{"dangling symlink last", filepath.Join(kubelet, "pods", "dangling"), false},
		{"an existing regular file", filepath.Join(kubelet, "file"), true},
		{"below a file", filepath.Join(kubelet, "file", "mount"), false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := checkNodePath(kubelet, "target_path", tc.path)
			if tc.ok && err != nil {
				t.Fatalf("checkNodePath(%q) = %v, want nil", tc.path, err)
			}
			if !tc.ok && !errors.Is(err, volume.ErrInvalid) {
				t.Fatalf("checkNodePath(%q) = %v, want ErrInvalid", tc.path, err)
			}
		})
	}
}

// TestOpenNodePath: the walk makes what is missing below the deepest
// existing directory, opens what is there, and refuses a link anywhere
// on the way without making anything behind it.
func TestOpenNodePath(t *testing.T) {
	kubelet := t.TempDir()
	outside := t.TempDir()
	for _, d := range []string{"pods/a", "pods/file-parent"} {
		if err := os.MkdirAll(filepath.Join(kubelet, d), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(kubelet, "pods/file-parent/mount"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(kubelet, "pods", "link")); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, path string
		end        pathEnd
		wantMode   uint32 // 0: refused with ErrInvalid
	}{
		{"directories made below an existing one", "pods/a/b/c/mount", makeDir, unix.S_IFDIR},
		{"a file made below new directories", "pods/new/volumes/dev", makeFile, unix.S_IFREG},
		{"an existing file", "pods/file-parent/mount", makeFile, unix.S_IFREG},
		{"an existing directory", "pods/a", existing, unix.S_IFDIR},
		{"a file where a directory is made", "pods/file-parent/mount", makeDir, 0},
		{"a link on the way", "pods/link/b/mount", makeDir, 0},
		{"a link at the end", "pods/link", makeDir, 0},
		{"a link at the end, existing", "pods/link", existing, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fd, err := openNodePath(filepath.Join(kubelet, tc.path), tc.end)
			if tc.wantMode == 0 {
				if err == nil {
					unix.Close(fd)
				}
				if !errors.Is(err, volume.ErrInvalid) {
					t.Fatalf("openNodePath(%s) = %v, want ErrInvalid", tc.path, err)
				}
				if entries, _ := os.ReadDir(outside); len(entries) != 0 {
					t.Fatalf("made %v behind the link", entries)
				}
				return
			}
			if err != nil {
				t.Fatalf("openNodePath(%s): %v", tc.path, err)
			}
			defer unix.Close(fd)
			var st, want unix.Stat_t
			if err := unix.Fstat(fd, &st); err != nil {
				t.Fatal(err)
			}
			if err := unix.Lstat(filepath.Join(kubelet, tc.path), &want); err != nil {
				t.Fatal(err)
			}
			if st.Mode&unix.S_IFMT != tc.wantMode || st.Ino != want.Ino || st.Dev != want.Dev {
				t.Fatalf("fd is on mode %#o inode %d, want mode %#o, the inode %d at the path", st.Mode, st.Ino, tc.wantMode, want.Ino)
			}
		})
	}
	if _, err := openNodePath(filepath.Join(kubelet, "pods/missing/mount"), existing); !errors.Is(err, unix.ENOENT) {
		t.Fatalf("openNodePath of a missing path, nothing made: %v, want ENOENT", err)
	}
	if _, err := os.Lstat(filepath.Join(kubelet, "pods/missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a walk that makes nothing made pods/missing: %v", err)
	}
}

// victims are things outside a volume that node RPCs must not touch: a
// tmpfs with a file on it and an empty file.
type victims struct {
	mnt, file string
}

func newVictims(t testing.TB, dir string) victims {
	t.Helper()
	v := victims{mnt: filepath.Join(dir, "victim-mnt"), file: filepath.Join(dir, "victim-file")}
	mountTmpfs(t, v.mnt)
	if err := os.WriteFile(v.file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return v
}

// mountTmpfs mounts a foreign tmpfs at dir (made if missing) holding a file
// "mine"; cleanup unmounts it if it is still there.
func mountTmpfs(t testing.TB, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("foreign", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for mountCount(t, dir) > 0 {
			if err := unix.Unmount(dir, 0); err != nil {
				t.Errorf("cleanup: unmount %s: %v", dir, err)
				return
			}
		}
	})
	if err := os.WriteFile(filepath.Join(dir, "mine"), []byte("not the plugin's"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// intact fails the test unless the victims are as newVictims made them.
func (v victims) intact(t testing.TB) {
	t.Helper()
	if n := mountCount(t, v.mnt); n != 1 {
		t.Errorf("%d mounts at %s, want its one tmpfs", n, v.mnt)
	}
	mustExist(t, filepath.Join(v.mnt, "mine"))
	mustExist(t, v.file)
}

// TestNodePathsRefused sends every node RPC paths that break the path rule
// (relative, unclean, outside the kubelet directory, through a symlink) for
// a volume that is staged and published, and checks the code and that
// neither the victims nor the volume's own mounts changed.
func TestNodePathsRefused(t *testing.T) {
	e := newTestEnv(t)
	t.Chdir(e.dir) // relative paths land where cleanup finds them
	ctx := context.Background()
	c := rwCap(volume.ModeFilesystem, "ext4")
	vol := e.createVolume(t, "paths", 32<<20, c, nil)
	p := e.stageAndPublish(t, vol.GetVolumeId(), c)
	defer e.teardown(t, p)
	vic := newVictims(t, e.dir)
	link := filepath.Join(e.kubelet, "link")
	if err := os.Symlink(e.dir, link); err != nil {
		t.Fatal(err)
	}

	bad := []struct {
		name, path string
		alias      bool // names the volume's own target another way
	}{
		{"relative", "victim-mnt", false},
		{"dot-dot", e.kubelet + "/../victim-mnt", false},
		{"outside", vic.mnt, false},
		{"outside file", vic.file, false},
		{"symlink", filepath.Join(link, "victim-mnt"), false},
		{"symlink to target", filepath.Join(link, filepath.Base(e.kubelet), p.target[len(e.kubelet)+1:]), true},
		{"dot-dot to target", filepath.Join(e.kubelet, "pods") + "/../" + p.target[len(e.kubelet)+1:], true},
	}
	rpcs := []struct {
		name string
		code codes.Code // for a bad path
		// aliasOnly: a read answers NotFound for paths where the volume is
		// not anyway; it differs only where the path is an alias of the
		// volume's own target.
		aliasOnly bool
		call      func(path string) error
	}{
		{"NodeStageVolume", codes.InvalidArgument, false, func(path string) error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: p.id, StagingTargetPath: path, VolumeCapability: c})
			return err
		}},
		{"NodeUnstageVolume", codes.InvalidArgument, false, func(path string) error {
			_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: p.id, StagingTargetPath: path})
			return err
		}},
		{"NodePublishVolume/target", codes.InvalidArgument, false, func(path string) error {
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: p.id, StagingTargetPath: p.staging, TargetPath: path, VolumeCapability: c})
			return err
		}},
		{"NodePublishVolume/staging", codes.InvalidArgument, false, func(path string) error {
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: p.id, StagingTargetPath: path, TargetPath: p.target + "2", VolumeCapability: c})
			return err
		}},
		{"NodeUnpublishVolume", codes.InvalidArgument, false, func(path string) error {
			_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: p.id, TargetPath: path})
			return err
		}},
		{"NodeExpandVolume", codes.InvalidArgument, false, func(path string) error {
			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: p.id, VolumePath: path,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}})
			return err
		}},
		// Reads: a volume cannot be at such a path (csi-sanity wants
		// NotFound for a relative volume_path of an existing volume).
		{"NodeGetVolumeStats", codes.NotFound, true, func(path string) error {
			_, err := e.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: p.id, VolumePath: path})
			return err
		}},
		{"NodeGetVolumeHealth", codes.NotFound, true, func(path string) error {
			_, err := e.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: p.id, VolumePublishPath: path})
			return err
		}},
	}
	before := volumeSize(t, e, p.id)
	for _, rpc := range rpcs {
		for _, b := range bad {
			if rpc.aliasOnly && !b.alias {
				continue
			}
			t.Run(rpc.name+"/"+b.name, func(t *testing.T) {
				wantCode(t, rpc.call(b.path), rpc.code)
				vic.intact(t)
				if n := mountCount(t, p.staging); n != 1 {
					t.Errorf("%d mounts at the volume's staging path, want 1", n)
				}
				if n := mountCount(t, p.target); n != 1 {
					t.Errorf("%d mounts at the volume's target path, want 1", n)
				}
				if got := volumeSize(t, e, p.id); got != before {
					t.Errorf("volume size %d, was %d", got, before)
				}
			})
		}
	}
}

func volumeSize(t testing.TB, e *testEnv, id string) int64 {
	t.Helper()
	v, err := e.store.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	return v.SizeBytes
}

// TestNodeTeardownTouchesOnlyItsOwn calls NodeUnpublishVolume and
// NodeUnstageVolume where the mount at the path is not the volume's: the
// foreign mount stays, and so does the file or directory below it.
func TestNodeTeardownTouchesOnlyItsOwn(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	c := rwCap(volume.ModeFilesystem, "ext4")
	unknown := volume.NewUUID()
	tests := []struct {
		name string
		// run sets up the case for volume p (staged and published) and
		// returns the call and the foreign mount it must leave alone.
		run  func(t *testing.T, p published) (call func() error, foreign string)
		code codes.Code
	}{
		{"unpublish unknown volume", func(t *testing.T, p published) (func() error, string) {
			target := filepath.Join(e.kubelet, "pods", "other", "mount")
			mountTmpfs(t, target)
			return func() error {
				_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: unknown, TargetPath: target})
				return err
			}, target
		}, codes.NotFound},
		{"unpublish unknown volume at its target", func(t *testing.T, p published) (func() error, string) {
			return func() error {
				_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: unknown, TargetPath: p.target})
				return err
			}, p.target
		}, codes.NotFound},
		{"unstage unknown volume", func(t *testing.T, p published) (func() error, string) {
			staging := filepath.Join(e.kubelet, "staging-other")
			mountTmpfs(t, staging)
			return func() error {
				_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: unknown, StagingTargetPath: staging})
				return err
			}, staging
		}, codes.NotFound},
		{"unpublish at a foreign mount", func(t *testing.T, p published) (func() error, string) {
			target := filepath.Join(e.kubelet, "pods", "foreign", "mount")
			mountTmpfs(t, target)
			return func() error {
				_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: p.id, TargetPath: target})
				return err
			}, target
		}, codes.OK},
		{"unpublish under a foreign mount", func(t *testing.T, p published) (func() error, string) {
			mountTmpfs(t, p.target)
			return func() error {
				_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: p.id, TargetPath: p.target})
				return err
			}, p.target
		}, codes.FailedPrecondition},
		{"unstage under a foreign mount", func(t *testing.T, p published) (func() error, string) {
			if _, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: p.id, TargetPath: p.target}); err != nil {
				t.Fatal(err)
			}
			mountTmpfs(t, p.staging)
			return func() error {
				_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: p.id, StagingTargetPath: p.staging})
				return err
			}, p.staging
		}, codes.FailedPrecondition},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			vol := e.createVolume(t, "own-"+filepath.Base(t.Name()), 32<<20, c, nil)
			p := e.stageAndPublish(t, vol.GetVolumeId(), c)
			call, foreign := tc.run(t, p)
			mountsBefore := mountCount(t, foreign)
			wantCode(t, call(), tc.code)
			if n := mountCount(t, foreign); n != mountsBefore {
				t.Errorf("%d mounts at %s after the call, %d before", n, foreign, mountsBefore)
			}
			mustExist(t, foreign)
			if fi, err := os.Stat(filepath.Join(foreign, "mine")); mountsBefore > 0 && p.target != foreign && p.staging != foreign && (err != nil || fi.Size() == 0) {
				t.Errorf("the foreign mount's file: %v", err)
			}
			// Take the foreign mounts away, then tear the volume down.
			for _, m := range []string{p.target, p.staging} {
				if top, ok, _ := topMount(m); ok && top.FSType == "tmpfs" {
					if err := unix.Unmount(m, 0); err != nil {
						t.Fatal(err)
					}
				}
			}
			e.teardown(t, p)
		})
	}
}

// TestNewChecksKubeletDir refuses a kubelet directory the path rule could
// not be anchored to.
func TestNewChecksKubeletDir(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(dir, "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "store"), 0o700); err != nil {
		t.Fatal(err)
	}
	store, err := volume.Open(filepath.Join(dir, "store"), volume.Options{})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		dir string
		ok  bool
	}{
		{"", true}, // the default
		{dir, true},
		{"var/lib/kubelet", false},
		{dir + "/", false},
		{dir + "/x/../y", false},
		{filepath.Join(link, "kubelet"), false},
	}
	for _, tc := range tests {
		d, err := New(Config{NodeID: "n", Store: store, KubeletDir: tc.dir})
		if tc.ok != (err == nil) || (!tc.ok && !errors.Is(err, volume.ErrInvalid)) {
			t.Errorf("New with kubelet dir %q: %v, want ok %v", tc.dir, err, tc.ok)
		}
		if tc.ok && tc.dir == "" && d.kubeletDir != DefaultKubeletDir {
			t.Errorf("default kubelet dir %q, want %q", d.kubeletDir, DefaultKubeletDir)
		}
	}
}

// TestNewChecksDriverName holds the driver name to the CSI spec's rule
// for plugin names: a refused name is ErrInvalid, an accepted one is what
// GetPluginInfo returns.
func TestNewChecksDriverName(t *testing.T) {
	store, err := volume.Open(t.TempDir(), volume.Options{})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		want string // what GetPluginInfo returns; "" for a refusal
	}{
		{"", DefaultDriverName},
		{"sparsevol.csi.io", "sparsevol.csi.io"},
		{"a", "a"},
		{"A-9.b", "A-9.b"},
		{"x" + strings.Repeat("-", maxDriverName-2) + "y", "x" + strings.Repeat("-", maxDriverName-2) + "y"},
		{strings.Repeat("x", maxDriverName+1), ""},
		{"../audit3-escaped", ""},
		{"a/b", ""},
		{"..", ""},
		{".a", ""},
		{"a.", ""},
		{"-a", ""},
		{"a-", ""},
		{"a_b", ""},
		{"a b", ""},
		{"a\x00b", ""},
		{"caf\u00e9", ""},
	}
	for _, tc := range tests {
		d, err := New(Config{NodeID: "n", Store: store, DriverName: tc.name})
		if tc.want == "" {
			if !errors.Is(err, volume.ErrInvalid) || !strings.Contains(err.Error(), "driver name") {
				t.Errorf("New with driver name %q: %v, want ErrInvalid naming the driver name", tc.name, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("New with driver name %q: %v", tc.name, err)
			continue
		}
		info, err := d.GetPluginInfo(context.Background(), &csi.GetPluginInfoRequest{})
		if err != nil || info.GetName() != tc.want {
			t.Errorf("driver name %q: GetPluginInfo = %v, %v; want %q", tc.name, info, err, tc.want)
		}
	}
}

// TestNewChecksNodeID holds the node id to Kubernetes' rules for a node
// name that is also the topology label's value: a refused id is
// ErrInvalid naming the node id, an accepted one is what NodeGetInfo
// returns.
func TestNewChecksNodeID(t *testing.T) {
	store, err := volume.Open(t.TempDir(), volume.Options{})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		id string
		ok bool
	}{
		{"n", true},
		{"node-1", true},
		{"ip-10-0-0-1.ec2.internal", true},
		{strings.Repeat("a", 63), true},
		{"", false},
		{strings.Repeat("a", 64), false},
		{"node\nx", false},
		{"node x", false},
		{"Node-1", false},
		{"node_1", false},
		{"../node", false},
		{"a/b", false},
		{"-node", false},
		{"node.", false},
		{"caf\u00e9", false},
	}
	for _, tc := range tests {
		d, err := New(Config{NodeID: tc.id, Store: store})
		if !tc.ok {
			if !errors.Is(err, volume.ErrInvalid) || !strings.Contains(err.Error(), "node id") {
				t.Errorf("New with node id %q: %v, want ErrInvalid naming the node id", tc.id, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("New with node id %q: %v", tc.id, err)
			continue
		}
		info, err := d.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
		if err != nil || info.GetNodeId() != tc.id || info.GetAccessibleTopology().GetSegments()[TopologyKey] != tc.id {
			t.Errorf("node id %q: NodeGetInfo = %v, %v", tc.id, info, err)
		}
	}
}
