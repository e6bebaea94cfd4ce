package packages_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// TestScripts runs the maintainer scripts with every argument dpkg and rpm
// call them with, in a private mount namespace where /run (systemd running
// or not) and /etc/systemd are the test's, with a systemctl that records
// its calls. They reload systemd where it runs and nothing else: never a
// disable, stop or restart (an upgrade keeps instances enabled and their
// volumes attached), never the store; a removal says what it kept, an
// upgrade says nothing.
func TestScripts(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := os.Stat("/etc/systemd"); err != nil {
		t.Fatal("/etc/systemd missing: install the Debian package systemd (.ci/run does)")
	}
	const keptNotice, masked, linked = "kept the store", "masked", "linked"
	tests := []struct {
		name, script string
		args         []string
		systemd      bool
		override     string // an /etc/systemd/system/sparsevol@.service, if any; masked: a link to /dev/null; linked: a link to another binary's unit
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
			"ExecStart=/usr/local/bin/sparsevol --udev-timeout=80s attach %i\n", []string{"daemon-reload"}, []string{"overrides the packaged units", "units uninstall"}, nil},
		{"install under its own units", "postinstall.sh", []string{"1"}, true,
			"ExecStart=/usr/bin/sparsevol --udev-timeout=80s attach %i\n", []string{"daemon-reload"}, nil, []string{"overrides"}},
		{"install under a masked template", "postinstall.sh", []string{"configure", ""}, true,
			masked, []string{"daemon-reload"}, []string{"is masked", "systemctl unmask"}, []string{"overrides", "units uninstall"}},
		{"install under a linked template of another binary", "postinstall.sh", []string{"configure", ""}, true,
			linked, []string{"daemon-reload"}, []string{"overrides the packaged units", "is a link", "rm /etc/systemd/system/sparsevol@.service"}, []string{"units uninstall"}},
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
			switch tt.override {
			case masked:
				if err := os.Symlink("/dev/null", filepath.Join(etc, "system", "sparsevol@.service")); err != nil {
					t.Fatal(err)
				}
			case linked:
				other := filepath.Join(dir, "sparsevol@.service")
				if err := os.WriteFile(other, []byte("ExecStart=/opt/other/sparsevol attach %i\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(other, filepath.Join(etc, "system", "sparsevol@.service")); err != nil {
					t.Fatal(err)
				}
			case "":
			default:
				if err := os.WriteFile(filepath.Join(etc, "system", "sparsevol@.service"), []byte(tt.override), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			script, err := filepath.Abs(tt.script)
			if err != nil {
				t.Fatal(err)
			}
			setup := "mount -t tmpfs tmpfs /run && mount --bind " + etc + " /etc/systemd"
			if tt.systemd {
				setup += " && mkdir -p /run/systemd/system"
			}
			cmd := exec.Command("unshare", append([]string{"--mount", "--propagation", "private", "sh", "-c",
				setup + ` && exec sh "$0" "$@"`, script}, tt.args...)...)
			cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("%s %q: %v\n%s", tt.script, tt.args, err, out)
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
