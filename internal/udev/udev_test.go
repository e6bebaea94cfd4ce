package udev

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// loopDevice binds a small file and returns the device's kernel name.
func loopDevice(t *testing.T) string {
	t.Helper()
	testutil.RequireRoot(t)
	file := filepath.Join(t.TempDir(), "backing")
	if err := os.WriteFile(file, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	return filepath.Base(testutil.Losetup(t, file))
}

// Record reads the E: lines of the database entry named by the device's
// number, and says when there is none.
func TestRecord(t *testing.T) {
	name := loopDevice(t)
	num, err := os.ReadFile(filepath.Join(sysBlock, name, "dev"))
	if err != nil {
		t.Fatal(err)
	}
	d := Dir(t.TempDir())
	if _, ok, err := d.Record(name); ok || err != nil {
		t.Fatalf("Record before udev wrote one = ok %v, %v; want none", ok, err)
	}
	if err := os.MkdirAll(filepath.Join(string(d), "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	entry := "S:disk/by-diskseq/9\nI:123\nE:DISKSEQ=9\nE:ID_FS_UUID=a=b\nE:SPARSEVOL_IDENTITY=store\nG:systemd\n"
	if err := os.WriteFile(filepath.Join(string(d), "data", "b"+strings.TrimSpace(string(num))), []byte(entry), 0o644); err != nil {
		t.Fatal(err)
	}
	rec, ok, err := d.Record(name)
	if err != nil || !ok {
		t.Fatalf("Record = ok %v, %v", ok, err)
	}
	want := Record{"DISKSEQ": "9", "ID_FS_UUID": "a=b", "SPARSEVOL_IDENTITY": "store"}
	if len(rec) != len(want) {
		t.Errorf("Record = %v, want %v", rec, want)
	}
	for k, v := range want {
		if rec[k] != v {
			t.Errorf("Record[%s] = %q, want %q", k, rec[k], v)
		}
	}
	for _, bad := range []string{"", ".", "..", "../loop0", "loop0/..", "nosuchdevice"} {
		if _, _, err := d.Record(bad); err == nil {
			t.Errorf("Record(%q) succeeded", bad)
		}
	}
}

// Change makes the kernel send a "change" uevent for the device: what a
// netlink listener (udevd) hears.
func TestChange(t *testing.T) {
	name := loopDevice(t)
	sock, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_KOBJECT_UEVENT)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sock)
	if err := unix.Bind(sock, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: 1}); err != nil {
		t.Fatal(err)
	}
	tv := unix.NsecToTimeval((5 * time.Second).Nanoseconds())
	if err := unix.SetsockoptTimeval(sock, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		t.Fatal(err)
	}
	if err := Change(name); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16<<10)
	for {
		n, _, err := unix.Recvfrom(sock, buf, 0)
		if err != nil {
			t.Fatalf("no change event for %s: %v", name, err)
		}
		fields := strings.Split(string(buf[:n]), "\x00")
		if strings.HasPrefix(fields[0], "change@") && strings.HasSuffix(fields[0], "/"+name) {
			return
		}
	}
}

func TestChangeRefusesNonDevices(t *testing.T) {
	for _, bad := range []string{"nosuchdevice", "../../kernel", "..", ""} {
		if err := Change(bad); err == nil {
			t.Errorf("Change(%q) succeeded", bad)
		}
	}
}

// InstallRule writes the rule into rules.d, replacing whatever name is
// there without writing through it, and refuses names that are not one.
func TestInstallRule(t *testing.T) {
	d := Dir(t.TempDir())
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	rules := filepath.Join(string(d), "rules.d")
	if err := os.MkdirAll(rules, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, filepath.Join(rules, "59-x.rules")); err != nil {
		t.Fatal(err)
	}
	if err := d.InstallRule("59-x.rules", []byte("RULE\n")); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(victim); string(b) != "keep" {
		t.Errorf("InstallRule wrote through a link: victim holds %q", b)
	}
	fi, err := os.Lstat(filepath.Join(rules, "59-x.rules"))
	if err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("rule is not a regular file: %v %v", fi, err)
	}
	if b, _ := os.ReadFile(filepath.Join(rules, "59-x.rules")); string(b) != "RULE\n" {
		t.Errorf("rule holds %q", b)
	}
	for _, bad := range []string{"", "../x.rules", "a/b.rules", ".hidden"} {
		if err := d.InstallRule(bad, []byte("x")); err == nil {
			t.Errorf("InstallRule(%q) succeeded", bad)
		}
	}
	if err := Dir("").InstallRule("59-x.rules", []byte("x")); err == nil {
		t.Error("InstallRule without udev succeeded")
	}
}

func TestRunning(t *testing.T) {
	d := Dir(t.TempDir())
	if d.Running() || Dir("").Running() {
		t.Fatal("Running without a control socket")
	}
	if err := os.WriteFile(filepath.Join(string(d), "control"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if !d.Running() {
		t.Error("not Running with a control entry")
	}
}
