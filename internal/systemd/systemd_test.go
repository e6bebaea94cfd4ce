package systemd

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	systemdunit "github.com/sparsevol/sparsevol/deploy/systemd"
)

func TestRender(t *testing.T) {
	tests := []struct {
		name, binary, root string
		want, notWant      []string
	}{
		{"defaults", "", "",
			[]string{"ExecStart=/usr/local/bin/sparsevol --udev-timeout=80s attach %i", "ExecStop=/usr/local/bin/sparsevol detach %i",
				"RequiresMountsFor=/var/lib/sparsevol", "Before=kubelet.service", "Environment=SPARSEVOL_ROOT=/var/lib/sparsevol"}, nil},
		{"other binary and store", "/opt/bin/sparsevol", "/srv/store",
			[]string{"ExecStart=/opt/bin/sparsevol --udev-timeout=80s attach %i", "RequiresMountsFor=/srv/store", "SPARSEVOL_ROOT=/srv/store"},
			[]string{"/usr/local/bin", "/var/lib/sparsevol"}},
		{"binary inside the default store", "/var/lib/sparsevol/bin/sparsevol", "/srv/store",
			[]string{"ExecStart=/var/lib/sparsevol/bin/sparsevol --udev-timeout=80s attach %i", "ExecStop=/var/lib/sparsevol/bin/sparsevol detach %i",
				"RequiresMountsFor=/srv/store\n", "Environment=SPARSEVOL_ROOT=/srv/store\n"},
			[]string{"/srv/store/bin", "/usr/local/bin"}},
		{"store inside the default binary's directory", "/opt/bin/sparsevol", "/usr/local/bin/sparsevol.d",
			[]string{"ExecStart=/opt/bin/sparsevol --udev-timeout=80s attach %i", "RequiresMountsFor=/usr/local/bin/sparsevol.d\n",
				"Environment=SPARSEVOL_ROOT=/usr/local/bin/sparsevol.d\n"},
			[]string{"/opt/bin/sparsevol.d", "/var/lib/sparsevol"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			unit := render(systemdunit.Template, tt.binary, tt.root)
			for _, w := range tt.want {
				if !strings.Contains(unit, w) {
					t.Errorf("unit lacks %q", w)
				}
			}
			for _, w := range tt.notWant {
				if strings.Contains(unit, w) {
					t.Errorf("unit still has %q", w)
				}
			}
		})
	}
}

// TestRenderShipped: with the default binary and store every shipped unit
// is rendered byte for byte as shipped; with others, only the lines of the
// fields render sets change, and no default is left in any of them.
func TestRenderShipped(t *testing.T) {
	const binary, root = "/var/lib/sparsevol/bin/sparsevol", "/srv/store"
	fields := []string{"ExecStart=", "ExecStop=", "RequiresMountsFor=", "Environment=SPARSEVOL_ROOT="}
	for _, u := range shipped {
		t.Run(u.name, func(t *testing.T) {
			for _, d := range [][2]string{{"", ""}, {defaultBinary, defaultRoot}} {
				if got := render(u.text, d[0], d[1]); got != u.text {
					t.Errorf("render(%q, %q) differs from the shipped unit:\n%s", d[0], d[1], got)
				}
			}
			got := strings.Split(render(u.text, binary, root), "\n")
			want := strings.Split(u.text, "\n")
			if len(got) != len(want) {
				t.Fatalf("rendered %d lines, shipped %d", len(got), len(want))
			}
			for i := range got {
				field := slices.ContainsFunc(fields, func(f string) bool { return strings.HasPrefix(want[i], f) })
				switch {
				case !field && got[i] != want[i]:
					t.Errorf("line %d changed: %q, shipped %q", i+1, got[i], want[i])
				case field && (strings.Contains(got[i], defaultBinary) || strings.Contains(strings.ReplaceAll(got[i], binary, ""), defaultRoot)):
					t.Errorf("line %d keeps a default: %q", i+1, got[i])
				}
			}
		})
	}
}

// TestBootUnitRequiresNoMount: the boot unit serves every store, so no
// store's mount may be one it requires: a failed mount of the default
// store (a disk of its own) would fail it, and with it the volumes of
// every other store. It wants the mounts the generator names (scenario
// 12 of test/vm proves that a failed one costs only its volumes).
func TestBootUnitRequiresNoMount(t *testing.T) {
	for _, root := range []string{"", "/srv/store"} {
		for line := range strings.SplitSeq(render(systemdunit.Boot, "", root), "\n") {
			key, value, _ := strings.Cut(line, "=")
			if key == "RequiresMountsFor" || (key == "Requires" || key == "BindsTo" || key == "Requisite") && strings.Contains(value, ".mount") {
				t.Errorf("root %q: the boot unit has %q", root, line)
			}
		}
	}
}

// TestUnitsVerify runs systemd-analyze verify on the shipped units and on
// an instance of the template with the generator's boot-mode drop-in; any
// diagnostic about them (it exits 0 on mere warnings) fails the test.
func TestUnitsVerify(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatal("systemd-analyze not installed (Debian package systemd); .ci/run installs it")
	}
	dir := t.TempDir()
	bin, _ := os.Executable() // an existing executable for ExecStart
	uuid := "0b7e4bd6-1c2b-4a57-9d6a-0e5d7f4e2f10"
	m := Manager{Dir: filepath.Join(dir, "etc"), RunDir: filepath.Join(dir, "run")}
	paths, err := m.Install(context.Background(), bin, dir)
	if err != nil {
		t.Fatal(err)
	}
	enable(t, m, uuid, "")
	gen := filepath.Join(dir, "generator")
	if err := m.Generate(gen); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(m.Dir, UnitName(uuid)), []byte(render(systemdunit.Template, bin, dir)), 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"verify", "--man=no", filepath.Join(m.Dir, UnitName(uuid))}
	for _, p := range paths {
		if strings.HasSuffix(p, ".service") {
			args = append(args, p)
		}
	}
	cmd := exec.Command(analyze, args...)
	// The generator's directory and the units, then the host's (the
	// trailing colon), as systemd would order them.
	cmd.Env = append(os.Environ(), "SYSTEMD_UNIT_PATH="+gen+":"+m.Dir+":")
	out, err := cmd.CombinedOutput()
	// Lines about the host's own units (no systemd running here) are not ours.
	var ours []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if strings.Contains(line, "sparsevol") {
			ours = append(ours, line)
		}
	}
	if err != nil || len(ours) > 0 {
		t.Fatalf("systemd-analyze %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// TestCheckOverride: a template in the unit directory passes only where
// it runs the packaged binary in every ExecStart= and ExecStop=; else the
// error names what to do with what is there, and a FIFO, even behind a
// link, is reported without waiting for a writer.
func TestCheckOverride(t *testing.T) {
	const pkgBin = "/usr/bin/sparsevol"
	tests := []struct {
		name    string
		plant   func(t *testing.T, dir, path string)
		want    []string // in the error; none: no error
		notWant []string
	}{
		{"none", func(t *testing.T, dir, path string) {}, nil, nil},
		{"installed for the packaged binary", func(t *testing.T, dir, path string) {
			write(t, path, render(systemdunit.Template, pkgBin, ""))
		}, nil, nil},
		{"installed for another binary", func(t *testing.T, dir, path string) {
			write(t, path, render(systemdunit.Template, "/usr/local/bin/sparsevol", ""))
		}, []string{`runs "/usr/local/bin/sparsevol", not /usr/bin/sparsevol`, "sparsevol units uninstall"}, []string{"is a link", "move it out"}},
		{"another binary's ExecStop only", func(t *testing.T, dir, path string) {
			write(t, path, strings.Replace(render(systemdunit.Template, pkgBin, ""), "ExecStop="+pkgBin, "ExecStop=/opt/x", 1))
		}, []string{`runs "/opt/x"`, "sparsevol units uninstall"}, nil},
		{"operator's unit without ExecStart", func(t *testing.T, dir, path string) {
			write(t, path, "[Unit]\nDescription=mine\n")
		}, []string{"runs nothing", "not a unit sparsevol installs", "move it out of"}, []string{"units uninstall"}},
		{"masked", func(t *testing.T, dir, path string) {
			link(t, "/dev/null", path)
		}, []string{"is masked", "systemctl unmask " + TemplateName}, []string{"overrides", "rm "}},
		{"linked unit of the packaged binary", func(t *testing.T, dir, path string) {
			write(t, filepath.Join(dir, "..", "unit"), "ExecStart=-"+pkgBin+" attach %i\n")
			link(t, filepath.Join(dir, "..", "unit"), path)
		}, nil, nil},
		{"dangling link", func(t *testing.T, dir, path string) {
			link(t, filepath.Join(dir, "..", "gone"), path)
		}, []string{"cannot be read", "is a link", "rm "}, nil},
		{"link to a FIFO", func(t *testing.T, dir, path string) {
			fifo := filepath.Join(dir, "..", "fifo")
			if err := unix.Mkfifo(fifo, 0o644); err != nil {
				t.Fatal(err)
			}
			link(t, fifo, path)
		}, []string{"cannot be read", "not a regular file", "is a link", "rm "}, []string{"units uninstall"}},
		{"directory", func(t *testing.T, dir, path string) {
			if err := os.Mkdir(path, 0o755); err != nil {
				t.Fatal(err)
			}
		}, []string{"cannot be read", "not a unit sparsevol installs"}, []string{"units uninstall"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := Manager{Dir: filepath.Join(t.TempDir(), "etc", "systemd", "system")}
			if err := os.MkdirAll(m.Dir, 0o755); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(m.Dir, TemplateName)
			tt.plant(t, m.Dir, path)
			err := m.CheckOverride(pkgBin)
			if len(tt.want) == 0 {
				if err != nil {
					t.Fatalf("CheckOverride = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatal("CheckOverride = nil, want an error")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("CheckOverride = %v, want it to say %q", err, w)
				}
			}
			for _, w := range tt.notWant {
				if strings.Contains(err.Error(), w) {
					t.Errorf("CheckOverride = %v, want it not to say %q", err, w)
				}
			}
		})
	}
}

func write(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

func link(t *testing.T, target, path string) {
	t.Helper()
	if err := os.Symlink(target, path); err != nil {
		t.Fatal(err)
	}
}
