package packages_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// TestScripts runs the maintainer scripts with every argument dpkg and rpm
// call them with, in a private mount namespace where /run (systemd running
// or not) and /etc/systemd are the test's, /usr/bin has the packaged
// sparsevol, and a systemctl records its calls. They reload systemd where
// it runs and nothing else: never a disable, stop or restart (an upgrade
// keeps instances enabled and their volumes attached), never the store; a
// removal says what it kept, an upgrade says nothing. A template in
// /etc/systemd/system that overrides the packaged one is named with what
// to do; whatever is planted there (a link to a FIFO or a disk) neither
// holds up the install nor is read through.
func TestScripts(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := os.Stat("/etc/systemd"); err != nil {
		t.Fatal("/etc/systemd missing: install the Debian package systemd (.ci/run does)")
	}
	// The packaged binary, laid over /usr/bin in each run's namespace.
	pkgBin := filepath.Join(t.TempDir(), "usr-bin")
	if err := os.Mkdir(pkgBin, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pkgBin, "sparsevol"), debContents(t, build(t).deb)["/usr/bin/sparsevol"].data, 0o755); err != nil {
		t.Fatal(err)
	}
	const (
		keptNotice = "kept the store"
		masked     = "masked"    // a link to /dev/null
		linked     = "linked"    // a link to another binary's unit
		makeInst   = "make"      // what `make install` writes (PREFIX=/usr/local)
		ownUnit    = "own"       // the operator's own unit, not one sparsevol writes
		fifoLink   = "fifo link" // a link to a FIFO nobody writes
		diskLink   = "disk link" // a link to a disk (a loop device)
		fifo       = "fifo"      // a FIFO itself
		directory  = "directory" // a directory
		override   = "/etc/systemd/system/sparsevol@.service"
	)
	tests := []struct {
		name, script string
		args         []string
		systemd      bool
		override     string // an /etc/systemd/system/sparsevol@.service, if any: one of the kinds above, or a unit's text
		wantCalls    []string
		wantOut      []string
		notOut       []string
	}{
		{"deb install", "postinstall.sh", []string{"configure", ""}, true, "", []string{"daemon-reload"}, nil, []string{"sparsevol:"}},
		{"deb upgrade", "postinstall.sh", []string{"configure", "0.0.1"}, true, "", []string{"daemon-reload"}, nil, []string{"sparsevol:"}},
		{"rpm install", "postinstall.sh", []string{"1"}, true, "", []string{"daemon-reload"}, nil, []string{"sparsevol:"}},
		{"rpm upgrade", "postinstall.sh", []string{"2"}, true, "", []string{"daemon-reload"}, nil, []string{"sparsevol:"}},
		{"install without systemd", "postinstall.sh", []string{"configure", ""}, false, "", nil, nil, []string{"sparsevol:"}},
		{"install under make install's units", "postinstall.sh", []string{"configure", ""}, true,
			makeInst, []string{"daemon-reload"}, []string{"overrides the packaged units", "/usr/local/bin/sparsevol", "units uninstall"}, []string{"is a link"}},
		{"install under the operator's own unit", "postinstall.sh", []string{"configure", ""}, true,
			ownUnit, []string{"daemon-reload"}, []string{"overrides the packaged units", "/opt/site/bin/attach", "not a unit sparsevol installs", "move it out of /etc/systemd/system"}, []string{"units uninstall"}},
		{"install under its own units", "postinstall.sh", []string{"1"}, true,
			"ExecStart=/usr/bin/sparsevol --udev-timeout=80s attach %i\n", []string{"daemon-reload"}, nil, []string{"overrides"}},
		{"install under a masked template", "postinstall.sh", []string{"configure", ""}, true,
			masked, []string{"daemon-reload"}, []string{"is masked", "systemctl unmask"}, []string{"overrides", "units uninstall"}},
		{"install under a linked template of another binary", "postinstall.sh", []string{"configure", ""}, true,
			linked, []string{"daemon-reload"}, []string{"overrides the packaged units", "is a link", "rm " + override}, []string{"units uninstall"}},
		{"install under a link to a FIFO", "postinstall.sh", []string{"configure", ""}, true,
			fifoLink, []string{"daemon-reload"}, []string{"overrides the packaged units", "cannot be read", "is a link", "rm " + override}, []string{"units uninstall"}},
		{"install under a link to a disk", "postinstall.sh", []string{"1"}, true,
			diskLink, []string{"daemon-reload"}, []string{"overrides the packaged units", "cannot be read", "is a link", "rm " + override}, []string{"units uninstall"}},
		{"install under a FIFO", "postinstall.sh", []string{"configure", "0.0.1"}, true,
			fifo, []string{"daemon-reload"}, []string{"cannot be read", "not a unit sparsevol installs"}, []string{"units uninstall"}},
		{"install under a directory", "postinstall.sh", []string{"configure", ""}, false,
			directory, nil, []string{"cannot be read", "not a unit sparsevol installs"}, []string{"units uninstall"}},
		{"deb upgrade, old postrm", "postremove.sh", []string{"upgrade", "9.9.9"}, true, "", []string{"daemon-reload"}, nil, []string{keptNotice}},
		{"deb failed upgrade", "postremove.sh", []string{"failed-upgrade", "9.9.9"}, true, "", []string{"daemon-reload"}, nil, []string{keptNotice}},
		{"deb remove", "postremove.sh", []string{"remove"}, true, "", []string{"daemon-reload"}, []string{keptNotice, "/var/lib/sparsevol"}, nil},
		{"deb purge", "postremove.sh", []string{"purge"}, true, "", []string{"daemon-reload"}, []string{keptNotice}, nil},
		{"rpm upgrade, old postun", "postremove.sh", []string{"1"}, true, "", []string{"daemon-reload"}, nil, []string{keptNotice}},
		{"rpm erase", "postremove.sh", []string{"0"}, true, "", []string{"daemon-reload"}, []string{keptNotice}, nil},
		{"remove without systemd", "postremove.sh", []string{"remove"}, false, "", nil, []string{keptNotice}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			bin, etc := filepath.Join(dir, "bin"), filepath.Join(dir, "etc-systemd")
			calls := filepath.Join(dir, "calls")
			for _, d := range []string{bin, filepath.Join(etc, "system")} {
				if err := os.MkdirAll(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			fake := "#!/bin/sh\necho \"$*\" >> " + calls + "\n"
			if err := os.WriteFile(filepath.Join(bin, "systemctl"), []byte(fake), 0o755); err != nil {
				t.Fatal(err)
			}
			unit := filepath.Join(etc, "system", "sparsevol@.service")
			var disk string // the loop device a diskLink leads to
			switch tt.override {
			case masked:
				if err := os.Symlink("/dev/null", unit); err != nil {
					t.Fatal(err)
				}
			case linked:
				other := filepath.Join(dir, "sparsevol@.service")
				if err := os.WriteFile(other, []byte("ExecStart=/opt/other/sparsevol attach %i\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(other, unit); err != nil {
					t.Fatal(err)
				}
			case makeInst:
				// The units `make install` renders, by the packaged binary.
				cmd := exec.Command(filepath.Join(pkgBin, "sparsevol"), "--unit-dir", filepath.Join(etc, "system"),
					"units", "install", "--offline", "--binary", "/usr/local/bin/sparsevol")
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Fatalf("units install: %v\n%s", err, out)
				}
			case ownUnit:
				if err := os.WriteFile(unit, []byte("[Unit]\nDescription=our volumes\n[Service]\nExecStart=/opt/site/bin/attach %i\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			case fifoLink, fifo:
				target := unit
				if tt.override == fifoLink {
					target = filepath.Join(dir, "fifo")
					if err := os.Symlink(target, unit); err != nil {
						t.Fatal(err)
					}
				}
				if err := syscall.Mkfifo(target, 0o644); err != nil {
					t.Fatal(err)
				}
				// A reader blocked in open, left by a killed script, is let go.
				t.Cleanup(func() {
					if f, err := os.OpenFile(target, os.O_RDWR|syscall.O_NONBLOCK, 0); err == nil {
						f.Close()
					}
				})
			case diskLink:
				img := filepath.Join(dir, "disk.img")
				if err := os.WriteFile(img, nil, 0o600); err != nil {
					t.Fatal(err)
				}
				if err := os.Truncate(img, diskSize); err != nil {
					t.Fatal(err)
				}
				disk = testutil.Losetup(t, img)
				if err := os.Symlink(disk, unit); err != nil {
					t.Fatal(err)
				}
			case directory:
				if err := os.Mkdir(unit, 0o755); err != nil {
					t.Fatal(err)
				}
			case "":
			default:
				if err := os.WriteFile(unit, []byte(tt.override), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			var readBefore int64
			if disk != "" {
				readBefore = bytesRead(t, disk)
			}
			script, err := filepath.Abs(tt.script)
			if err != nil {
				t.Fatal(err)
			}
			setup := "mount -t tmpfs tmpfs /run && mount --bind " + etc + " /etc/systemd" +
				" && mount -t overlay overlay -o lowerdir=" + pkgBin + ":/usr/bin /usr/bin"
			if tt.systemd {
				setup += " && mkdir -p /run/systemd/system"
			}
			// A script that hangs would hang dpkg: it gets a minute, then
			// it and what it started are killed.
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, "unshare", append([]string{"--mount", "--propagation", "private", "sh", "-c",
				setup + ` && exec sh "$0" "$@"`, script}, tt.args...)...)
			cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
			cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
			cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
			cmd.WaitDelay = 5 * time.Second
			out, err := cmd.CombinedOutput()
			if ctx.Err() != nil {
				t.Fatalf("%s %q hung (killed after a minute):\n%s", tt.script, tt.args, out)
			}
			if err != nil {
				t.Fatalf("%s %q: %v\n%s", tt.script, tt.args, err, out)
			}
			if disk != "" {
				if n := bytesRead(t, disk) - readBefore; n > diskSize/2 {
					t.Errorf("%s %q read %d bytes of %s, the disk %s leads to", tt.script, tt.args, n, override, disk)
				}
			}
			got, _ := os.ReadFile(calls)
			if g, w := strings.Fields(strings.TrimSpace(string(got))), tt.wantCalls; strings.Join(g, ",") != strings.Join(w, ",") {
				t.Errorf("systemctl calls %q, want %q", got, w)
			}
			for _, w := range tt.wantOut {
				if !strings.Contains(string(out), w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			for _, w := range tt.notOut {
				if strings.Contains(string(out), w) {
					t.Errorf("output has %q:\n%s", w, out)
				}
			}
		})
	}
}

// diskSize is the size of the disk a planted link leads to: a script that
// reads through the link reads most of it.
const diskSize = 64 << 20

// bytesRead is how many bytes the kernel has read from the block device
// dev (its sysfs stat: sectors read, third field, in 512-byte units).
func bytesRead(t *testing.T, dev string) int64 {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "stat"))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		t.Fatalf("%s stat: %q", dev, b)
	}
	n, err := strconv.ParseInt(f[2], 10, 64)
	if err != nil {
		t.Fatalf("%s stat: %v", dev, err)
	}
	return n * 512
}
