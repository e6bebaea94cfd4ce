package cli

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/systemd"
)

// tree renders every path under dir with its mode: what a refused command
// must leave as it was.
func tree(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		fmt.Fprintf(&b, "%q %s\n", path, fi.Mode())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// TestUnsafeUnitPathsExitTwo: a store root or binary that systemd's unit
// syntax would read as more than a path (a newline injecting a setting, a
// specifier, a space splitting ExecStart=) is refused with exit 2 and one
// line, and nothing is written: no unit, no generator link, no store
// made private.
func TestUnsafeUnitPathsExitTwo(t *testing.T) {
	const injected = "/srv/st %H\nExecStartPre=/bin/touch /tmp/pwned"
	tests := []struct {
		name  string
		store string // a directory made, mode 0755, under the test's directory
		args  []string
		env   []string
	}{
		{"root injecting a setting", "", []string{"--root", injected, "units", "install", "--offline"}, nil},
		{"root with a space", "", []string{"--root", "/srv/my store", "units", "install", "--offline"}, nil},
		{"root with a specifier", "", []string{"--root", "/srv/st%H", "units", "install", "--offline"}, nil},
		{"root from the environment", "", []string{"units", "install", "--offline"}, []string{"SPARSEVOL_ROOT=" + injected}},
		{"binary with a space", "", []string{"--root", "/srv/store", "units", "install", "--offline", "--binary", "/opt/my tools/sparsevol"}, nil},
		{"binary injecting a setting", "", []string{"--root", "/srv/store", "units", "install", "--offline", "--binary", "/usr/bin/sparsevol\nExecStartPre=/bin/sh"}, nil},
		{"binary with a variable", "", []string{"--root", "/srv/store", "units", "install", "--offline", "--binary", "/opt/$X/sparsevol"}, nil},
		{"binary with a quote", "", []string{"--root", "/srv/store", "units", "install", "--offline", "--binary", `/opt/"x"/sparsevol`}, nil},
		{"binary relative", "", []string{"--root", "/srv/store", "units", "install", "--offline", "--binary", "bin/sparsevol"}, nil},
		{"binary not clean", "", []string{"--root", "/srv/store", "units", "install", "--offline", "--binary", "/usr/local/bin/../bin/sparsevol"}, nil},
		{"store command, store with a specifier", "st%H", []string{"list"}, nil},
		{"store command, store with a newline", "st\nx", []string{"list"}, nil},
		{"store command, store with a space", "my store", []string{"list"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			args := append([]string{"--unit-dir", filepath.Join(dir, "etc", "systemd", "system")}, tt.args...)
			if tt.store != "" {
				store := filepath.Join(dir, tt.store)
				if err := os.Mkdir(store, 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Chmod(store, 0o755); err != nil {
					t.Fatal(err)
				}
				args = append([]string{"--root", store}, args...)
			}
			for _, e := range tt.env {
				k, v, _ := strings.Cut(e, "=")
				t.Setenv(k, v)
			}
			before := tree(t, dir)
			var stdout, stderr bytes.Buffer
			if code := Main(args, &stdout, &stderr); code != ExitInvalid {
				t.Fatalf("sparsevol %q: exit %d, want %d; stdout %q, stderr %q", args, code, ExitInvalid, stdout.String(), stderr.String())
			}
			if lines := strings.Split(strings.TrimSpace(stderr.String()), "\n"); len(lines) != 1 || !strings.Contains(lines[0], "choose a path without it") && !strings.Contains(lines[0], "give ") {
				t.Errorf("want one line saying what to do, got %q", stderr.String())
			}
			if after := tree(t, dir); after != before {
				t.Errorf("refused command changed files:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

// TestUnitsInstallBinaryInDefaultStore: a binary below the default store,
// with another store, keeps its own path in ExecStart= and ExecStop=.
func TestUnitsInstallBinaryInDefaultStore(t *testing.T) {
	unitDir := filepath.Join(t.TempDir(), "etc", "systemd", "system")
	args := []string{"--unit-dir", unitDir, "--root", "/srv/store", "units", "install", "--offline", "--binary", "/var/lib/sparsevol/bin/sparsevol"}
	var stdout, stderr bytes.Buffer
	if code := Main(args, &stdout, &stderr); code != ExitOK {
		t.Fatalf("sparsevol %q: exit %d: %s", args, code, stderr.String())
	}
	data, err := os.ReadFile(filepath.Join(unitDir, systemd.TemplateName))
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{
		"\nExecStart=/var/lib/sparsevol/bin/sparsevol --udev-timeout=80s attach %i\n",
		"\nExecStop=/var/lib/sparsevol/bin/sparsevol detach %i\n",
		"\nEnvironment=SPARSEVOL_ROOT=/srv/store\n",
		"\nRequiresMountsFor=/srv/store\n",
	} {
		if !bytes.Contains(data, []byte(w)) {
			t.Errorf("%s lacks %q:\n%s", systemd.TemplateName, strings.TrimSpace(w), data)
		}
	}
}
