package systemd

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

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
