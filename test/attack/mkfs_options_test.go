package attack

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// mkfs options that name a path or a device are refused with exit 2 before
// anything runs: the victim is not written, copied or bound, and the store
// stays empty.
func TestMkfsOptionsNamingPathsCLI(t *testing.T) {
	for _, tc := range []struct {
		name string
		fs   string
		opt  func(file, dir string) string
	}{
		{"xfs external log", "xfs", func(f, _ string) string { return "-l logdev=" + f + ",size=64m" }},
		{"xfs realtime device", "xfs", func(f, _ string) string { return "-r rtdev=" + f }},
		{"xfs protofile", "xfs", func(f, _ string) string { return "-p " + f }},
		{"xfs data file", "xfs", func(f, _ string) string { return "-d file,name=" + f + ",size=300m" }},
		{"ext4 populate from directory", "ext4", func(_, d string) string { return "-d " + d }},
		{"ext4 external journal", "ext4", func(f, _ string) string { return "-J device=" + f }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			file := c.zeroFile("logdev", 80<<20)
			if err := os.WriteFile(c.path("victim", "secrets", "shadow"), nil, 0); err != nil {
				c.mkdir("victim", "secrets")
			}
			if err := os.WriteFile(c.path("victim", "secrets", "shadow"), []byte("root:$6$secret:19000::::::\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			c.watch(c.path("victim", "secrets"))
			size := "16M"
			if tc.fs == "xfs" {
				size = "300M"
			}
			before := c.snapshot()
			c.expectCode(c.sv(s, "create", "v", "--no-start", "--fs", tc.fs, "--size", size,
				"--mkfs-option", tc.opt(file, c.path("victim", "secrets"))), 2)
			c.unchanged(before)
		})
	}
}

// Options and UUIDs that would give a ready volume whose filesystem is
// missing or not named by the volume UUID are refused with exit 2.
func TestIdentityOptionsCLI(t *testing.T) {
	other := "6f1c3a52-2f9e-4d7b-9a51-0c7f2d3e4b5a"
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"ext4 -Urandom", []string{"--mkfs-option", "-Urandom"}},
		{"ext4 -U random", []string{"--mkfs-option", "-U random"}},
		{"ext4 -U other", []string{"--mkfs-option", "-U " + other}},
		{"ext4 -n", []string{"--mkfs-option", "-n"}},
		{"xfs -muuid=other", []string{"--fs", "xfs", "--size", "300M", "--mkfs-option", "-muuid=" + other}},
		{"xfs -m uuid=other", []string{"--fs", "xfs", "--size", "300M", "--mkfs-option", "-m uuid=" + other}},
		{"xfs -N", []string{"--fs", "xfs", "--size", "300M", "--mkfs-option", "-N"}},
		{"nil uuid", []string{"--uuid", "00000000-0000-0000-0000-000000000000"}},
		{"nil uuid block", []string{"--mode", "block", "--uuid", "00000000-0000-0000-0000-000000000000"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			args := append([]string{"create", "v", "--no-start"}, tc.args...)
			if !strings.Contains(strings.Join(tc.args, " "), "--size") {
				args = append(args, "--size", "16M")
			}
			before := c.snapshot()
			c.expectCode(c.sv(s, args...), 2)
			c.unchanged(before)
		})
	}
}

// CreateVolume refuses mkfs options that name a path or change the
// filesystem's identity (InvalidArgument); nothing is created or written.
func TestCreateVolumeMkfsOptions(t *testing.T) {
	other := "6f1c3a52-2f9e-4d7b-9a51-0c7f2d3e4b5a"
	for _, tc := range []struct {
		name, fs string
		opts     func(file, dir string) string
	}{
		{"ext4 populate from directory", "ext4", func(_, d string) string { return "-d " + d }},
		{"xfs external log", "xfs", func(f, _ string) string { return "-l logdev=" + f + ",size=64m" }},
		{"ext4 -U random", "ext4", func(string, string) string { return "-U random" }},
		{"ext4 -Urandom", "ext4", func(string, string) string { return "-Urandom" }},
		{"ext4 -n", "ext4", func(string, string) string { return "-n" }},
		{"xfs -muuid", "xfs", func(string, string) string { return "-muuid=" + other }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			file := c.zeroFile("logdev", 80<<20)
			secrets := c.mkdir("victim", "secrets")
			if err := os.WriteFile(filepath.Join(secrets, "shadow"), []byte("root:$6$secret:19000::::::\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			c.watch(secrets)
			size := int64(16 << 20)
			if tc.fs == "xfs" {
				size = 300 << 20
			}
			before := c.snapshot()
			_, err := p.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
				Name:               "pvc-mkfs",
				CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
				VolumeCapabilities: []*csi.VolumeCapability{mountCap(tc.fs)},
				Parameters:         map[string]string{"fsType": tc.fs, "mkfsOptions": tc.opts(file, secrets)},
			})
			c.expectGRPC(err, codes.InvalidArgument)
			c.unchanged(before)
		})
	}
}
