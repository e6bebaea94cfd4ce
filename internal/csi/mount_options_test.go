package csi

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/volume"
)

func TestMountArgs(t *testing.T) {
	tests := []struct {
		options []string
		flags   uintptr
		data    string
		ok      bool
	}{
		{nil, 0, "", true},
		{[]string{"defaults"}, 0, "", true},
		{[]string{"ro", "noatime"}, unix.MS_RDONLY | unix.MS_NOATIME, "", true},
		{[]string{"ro,nodev", "rw"}, unix.MS_NODEV, "", true}, // in order, as mount(8)
		{[]string{"nosuid", "discard"}, unix.MS_NOSUID, "discard", true},
		{[]string{"errors=remount-ro"}, 0, "errors=remount-ro", true},
		{[]string{"noatime", "data=journal,inode64"}, unix.MS_NOATIME, "data=journal,inode64", true},
		{[]string{"nofail"}, 0, "", false},
		{[]string{"ro,"}, 0, "", false},
		{[]string{"remount"}, 0, "", false},
		{[]string{"bind"}, 0, "", false},
	}
	for _, tt := range tests {
		flags, data, err := mountArgs(tt.options)
		if (err == nil) != tt.ok || (err == nil && (flags != tt.flags || data != tt.data)) {
			t.Errorf("mountArgs(%q) = %#x, %q, %v; want %#x, %q, ok %t", tt.options, flags, data, err, tt.flags, tt.data, tt.ok)
		}
	}
}

// TestStageMountOptions stages filesystems with the kubelet's mount
// options, flags and the filesystem's own, all by mount(2): the staged
// mount carries them.
func TestStageMountOptions(t *testing.T) {
	e := newTestEnv(t)
	tests := []struct {
		name    string
		fsType  string
		options []string
		want    []string // in the mount's options (per-mount or the filesystem's)
	}{
		{"flags", "ext4", []string{"noatime", "nodev", "nosuid"}, []string{"noatime", "nodev", "nosuid"}},
		{"read-only", "xfs", []string{"ro"}, []string{"ro"}},
		{"filesystem option", "ext4", []string{"discard"}, []string{"discard"}},
		{"filesystem options", "ext4", []string{"noexec", "errors=remount-ro"}, []string{"noexec", "errors=remount-ro"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			size := int64(32 << 20)
			if tt.fsType == "xfs" {
				size = 300 << 20
			}
			c := rwCap(volume.ModeFilesystem, tt.fsType)
			vol := e.createVolume(t, "opts-"+strings.ReplaceAll(tt.name, " ", "-"), size, c, nil)
			c.GetMount().MountFlags = tt.options
			p := e.stageAndPublish(t, vol.GetVolumeId(), c)
			defer e.teardown(t, p)
			have := stagedOptions(t, p.staging)
			for _, w := range tt.want {
				if !slices.Contains(have, w) {
					t.Errorf("staged with %q: options %q lack %s", tt.options, have, w)
				}
			}
		})
	}
}

// TestStageErrorBehavior: an ext4 volume whose superblock says panic
// (tune2fs -e panic here, as an adopted or imported image may carry) is
// staged with errors=remount-ro, unless the capability names a
// behaviour; one whose superblock says continue (mkfs -e continue) keeps
// it.
func TestStageErrorBehavior(t *testing.T) {
	e := newTestEnv(t)
	tests := []struct {
		superblock string
		options    []string
		want       string // in the staged mount's options; "" none
	}{
		{"panic", nil, "errors=remount-ro"},
		{"panic", []string{"errors=continue"}, "errors=continue"},
		{"continue", nil, ""},
		{"remount-ro", nil, ""},
	}
	for _, tt := range tests {
		name := tt.superblock + "-" + strings.Join(tt.options, "-")
		t.Run(name, func(t *testing.T) {
			c := rwCap(volume.ModeFilesystem, "ext4")
			vol := e.createVolume(t, "errors-"+strings.ReplaceAll(name, "=", "-"), 32<<20, c, nil)
			v, err := e.store.Get(vol.GetVolumeId())
			if err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command("tune2fs", "-e", tt.superblock, v.BackingFile).CombinedOutput(); err != nil {
				t.Fatalf("tune2fs -e %s: %v: %s", tt.superblock, err, out)
			}
			c.GetMount().MountFlags = tt.options
			p := e.stageAndPublish(t, vol.GetVolumeId(), c)
			defer e.teardown(t, p)
			have := stagedOptions(t, p.staging)
			if tt.want == "" && slices.ContainsFunc(have, func(o string) bool { return strings.HasPrefix(o, "errors=") }) {
				t.Fatalf("a superblock saying %s, staged with %q: options %q override it", tt.superblock, tt.options, have)
			}
			if tt.want != "" && !slices.Contains(have, tt.want) {
				t.Fatalf("a superblock saying %s, staged with %q: options %q lack %s", tt.superblock, tt.options, have, tt.want)
			}
		})
	}
}

// stagedOptions returns the options of the one mount at staging: the
// mount's and its filesystem's.
func stagedOptions(t *testing.T, staging string) []string {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(staging))
	if err != nil || len(infos) != 1 {
		t.Fatalf("mounts at %s: %v, %v", staging, infos, err)
	}
	return strings.Split(infos[0].Options+","+infos[0].VFSOptions, ",")
}

func TestCheckMountOptions(t *testing.T) {
	tests := []struct {
		options []string
		ok      bool
	}{
		{nil, true},
		{[]string{"defaults", "ro,noatime", "discard"}, true},
		{[]string{"errors=remount-ro", "data=writeback", "commit=30"}, true},
		{[]string{"inode64,logbsize=256k,allocsize=64k", "nouuid"}, true},
		{[]string{"loop"}, false},
		{[]string{"loop,offset=0"}, false},
		{[]string{"offset=1048576"}, false},
		{[]string{"sizelimit=1M"}, false},
		{[]string{"bind"}, false},
		{[]string{"remount,rw"}, false},
		{[]string{"logdev=/dev/vda"}, false},
		{[]string{"journal_path=/dev/vda"}, false},
		{[]string{"errors=panic"}, false},
		{[]string{"errors=continue"}, true},
		{[]string{"errors=remount-ro,errors=panic"}, false},
		{[]string{"commit=/etc"}, false},
		{[]string{"commit="}, false},
		{[]string{"noatime,"}, false},
		{[]string{"inode64=1"}, false},
		{[]string{"x-mount.mkdir=/etc"}, false},
	}
	for _, tt := range tests {
		err := checkMountOptions(tt.options)
		if (err == nil) != tt.ok || (err != nil && !errors.Is(err, volume.ErrInvalid)) {
			t.Errorf("checkMountOptions(%q) = %v; want ok %t", tt.options, err, tt.ok)
		}
	}
}

// TestRefusedMountOptions: a capability whose mount flags name a loop
// device setup (what mount(8) would do with "loop,offset=0": an untagged
// device onto the volume's, a window its ownership proof refuses
// elsewhere) or a path is refused with InvalidArgument by CreateVolume,
// ValidateVolumeCapabilities, NodeStageVolume and NodePublishVolume
// alike, before anything is done: no loop device is added and nothing is
// mounted at the staging path.
func TestRefusedMountOptions(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	good := rwCap(volume.ModeFilesystem, "ext4")
	vol := e.createVolume(t, "bad-options", 32<<20, good, nil)
	id := vol.GetVolumeId()
	staging := filepath.Join(e.kubelet, "staging-bad-options")
	if err := os.MkdirAll(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	v, err := e.store.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	// Devices on the volume's file only: other packages' tests bind
	// their own devices meanwhile.
	on := func() int {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(v.BackingFile, &st); err != nil {
			t.Fatal(err)
		}
		devs, err := loop.List()
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, d := range devs {
			if d.Backing == (loop.FileID{Dev: st.Dev, Inode: st.Ino}) {
				n++
			}
		}
		return n
	}
	before := on()
	for _, flags := range [][]string{{"loop,offset=0"}, {"noatime", "logdev=/dev/vda"}, {"errors=panic"}} {
		bad := rwCap(volume.ModeFilesystem, "ext4")
		bad.GetMount().MountFlags = flags
		calls := map[string]func() error{
			"CreateVolume": func() error {
				_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "bad-options-2",
					CapacityRange: &csi.CapacityRange{RequiredBytes: 32 << 20}, VolumeCapabilities: []*csi.VolumeCapability{bad}})
				return err
			},
			"NodeStageVolume": func() error {
				_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: bad})
				return err
			},
			"NodePublishVolume": func() error {
				_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
					TargetPath: filepath.Join(e.kubelet, "pods", id, "target"), VolumeCapability: bad})
				return err
			},
		}
		for name, call := range calls {
			if err := call(); status.Code(err) != codes.InvalidArgument {
				t.Errorf("%s with mount flags %q = %v, want InvalidArgument", name, flags, err)
			}
		}
		resp, err := e.ctrl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id,
			VolumeCapabilities: []*csi.VolumeCapability{bad}})
		if err != nil || resp.GetConfirmed() != nil {
			t.Errorf("ValidateVolumeCapabilities with mount flags %q confirmed them: %v, %v", flags, resp, err)
		}
	}
	if after := on(); after != before || mountCount(t, staging) != 0 {
		t.Errorf("loop devices on the volume's file %d -> %d, %d mounts at the staging path; want nothing changed", before, after, mountCount(t, staging))
	}
	if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Errorf("DeleteVolume: %v", err)
	}
}
