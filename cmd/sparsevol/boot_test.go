package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/systemd"
)

// enableByHand leaves on disk what `systemctl enable` and the instance's
// drop-in leave (no systemd runs here).
func enableByHand(t *testing.T, unitDir, uuid, root string) {
	t.Helper()
	m := systemd.Manager{Dir: unitDir}
	wants := filepath.Join(unitDir, "multi-user.target.wants")
	for _, d := range []string{wants, filepath.Dir(m.DropInPath(uuid))} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(filepath.Join(unitDir, systemd.TemplateName), filepath.Join(wants, systemd.UnitName(uuid))); err != nil {
		t.Fatal(err)
	}
	dropIn := "[Unit]\nRequiresMountsFor=" + root + "\n\n[Service]\nEnvironment=SPARSEVOL_ROOT=" + root + "\n"
	if err := os.WriteFile(m.DropInPath(uuid), []byte(dropIn), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestAttachBoot: `attach --boot` (sparsevol-boot.service) attaches the
// volumes of the enabled units of every store, leaves the others alone,
// marks what came up, reports a volume it cannot bring up without giving
// up on the rest, and ends boot mode; the generator then leaves the
// instances alone.
func TestAttachBoot(t *testing.T) {
	rootA, rootB := newRoot(t), newRoot(t)
	dir := t.TempDir()
	unitDir, runDir := filepath.Join(dir, "units"), filepath.Join(dir, "run")
	flags := []string{"--unit-dir", unitDir, "--run-dir", runDir}
	create := func(root, name string) string {
		t.Helper()
		return strings.TrimSpace(mustRun(t, root, "create", name, "--size", "16M", "--no-start"))
	}
	a1, a2, off := create(rootA, "a1"), create(rootA, "a2"), create(rootA, "off")
	b1 := create(rootB, "b1")
	gone := "0badc0de-0000-4000-8000-000000000000" // enabled, but its volume was removed by hand
	for _, e := range []struct{ uuid, root string }{{a1, rootA}, {a2, rootA}, {b1, rootB}, {gone, rootA}} {
		enableByHand(t, unitDir, e.uuid, e.root)
	}
	t.Cleanup(func() {
		sparsevol(t, rootA, nil, "detach", "--all")
		sparsevol(t, rootB, nil, "detach", "--all")
	})

	// The generator before the boot unit ran: a boot-mode drop-in for every
	// enabled instance.
	gen := filepath.Join(dir, systemd.GeneratorName)
	if err := os.Symlink(os.Args[0], gen); err != nil {
		t.Fatal(err)
	}
	generate := func() string {
		t.Helper()
		out := t.TempDir()
		cmd := exec.Command(gen, append(flags, out, out, out)...)
		cmd.Env = append(os.Environ(), asCLI+"=1")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", gen, err, b)
		}
		return out
	}
	out := generate()
	for _, uuid := range []string{a1, a2, b1, gone} {
		if _, err := os.Stat(filepath.Join(out, systemd.UnitName(uuid)+".d", "50-boot.conf")); err != nil {
			t.Errorf("generator at boot: no drop-in for %s: %v", uuid, err)
		}
	}

	r := sparsevol(t, rootA, nil, append(flags, "attach", "--boot")...)
	if r.code == 0 || !strings.Contains(r.stderr, gone) {
		t.Errorf("attach --boot with a missing volume: exit %d, stderr %q; want a failure naming %s", r.code, r.stderr, gone)
	}
	for _, v := range []struct {
		root, name, uuid string
		want             bool
	}{{rootA, "a1", a1, true}, {rootA, "a2", a2, true}, {rootB, "b1", b1, true}, {rootA, "off", off, false}} {
		_, err := os.Stat(filepath.Join(runDir, "attached", v.uuid))
		if marked := err == nil; marked != v.want {
			t.Errorf("%s: attached marker present %v, want %v", v.name, marked, v.want)
		}
		attached := false
		for _, st := range statuses(t, v.root) {
			if st.UUID == v.uuid {
				attached = st.Attached
			}
		}
		if attached != v.want {
			t.Errorf("%s: attached %v after attach --boot, want %v (enabled: %v)", v.name, attached, v.want, v.want)
		}
		if v.want && !strings.Contains(r.stdout, v.name+"\t/dev/loop") {
			t.Errorf("attach --boot output lacks %s:\n%s", v.name, r.stdout)
		}
	}
	if _, err := os.Stat(filepath.Join(runDir, "boot-done")); err != nil {
		t.Errorf("boot not marked done: %v", err)
	}
	// Detach takes the marker away: an instance restarted in boot mode
	// fails its assertion instead of claiming a volume that is not there.
	mustRun(t, rootA, append(flags, "detach", "a1")...)
	if _, err := os.Stat(filepath.Join(runDir, "attached", a1)); !os.IsNotExist(err) {
		t.Errorf("a1's marker still there after detach (%v)", err)
	}
	// After the boot the generator writes no instance drop-ins.
	out = generate()
	if entries, _ := filepath.Glob(filepath.Join(out, "sparsevol@*")); len(entries) != 0 {
		t.Errorf("generator after the boot wrote %v", entries)
	}
}
