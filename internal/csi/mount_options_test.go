package csi

import (
	"slices"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

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
		{[]string{"errors=remount-ro"}, 0, "", false},
		{[]string{"noatime", "data=journal"}, 0, "", false},
		{[]string{"nofail"}, 0, "", false},
		{[]string{"ro,"}, 0, "", false},
		{[]string{"remount"}, 0, "", false},
		{[]string{"bind"}, 0, "", false},
	}
	for _, tt := range tests {
		flags, data, ok := mountArgs(tt.options)
		if ok != tt.ok || (ok && (flags != tt.flags || data != tt.data)) {
			t.Errorf("mountArgs(%q) = %#x, %q, %t; want %#x, %q, %t", tt.options, flags, data, ok, tt.flags, tt.data, tt.ok)
		}
	}
}

// TestStageMountOptions stages filesystems with the kubelet's mount
// options: those mountArgs knows by mount(2) itself, others through
// mount(8); either way the staged mount carries them.
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
		{"mount8 only", "ext4", []string{"noexec", "errors=remount-ro"}, []string{"noexec", "errors=remount-ro"}},
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
			infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(p.staging))
			if err != nil || len(infos) != 1 {
				t.Fatalf("mounts at %s: %v, %v", p.staging, infos, err)
			}
			have := strings.Split(infos[0].Options+","+infos[0].VFSOptions, ",")
			for _, w := range tt.want {
				if !slices.Contains(have, w) {
					t.Errorf("staged with %q: options %q lack %s", tt.options, have, w)
				}
			}
		})
	}
}
