package attack

import (
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
)

// The generator runs as root at every boot and daemon-reload and reads
// the unit directory: links of enabled instances, their drop-ins. A link
// whose name is not a volume UUID, a drop-in with a store or mount that is
// not a plain absolute path, a FIFO or a link for a drop-in: each is
// refused (exit 2) without blocking, and only the volume it names is left
// out; the others get their drop-ins. A link at the boot-done marker is
// refused too (exit 1), never written through.
func TestGeneratorHostileUnits(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	units := c.path("units")
	c.mustSV(s, "units", "install", "--offline")
	victim := c.victim("host-file", 4096)
	const good = "0aaaaaaa-0000-4000-8000-000000000001"
	bad := map[string]func(dropIn string) error{
		"0bbbbbbb-0000-4000-8000-000000000002": func(p string) error {
			return os.WriteFile(p, []byte("[Unit]\nRequiresMountsFor=\"/a %h/b\"\n[Service]\nEnvironment=SPARSEVOL_ROOT=../evil\n"), 0o644)
		},
		"0ccccccc-0000-4000-8000-000000000003": func(p string) error { return syscall.Mkfifo(p, 0o644) },
		"0ddddddd-0000-4000-8000-000000000004": func(p string) error { return os.Symlink(victim, p) },
	}
	wants := filepath.Join(units, "multi-user.target.wants")
	if err := os.MkdirAll(wants, 0o755); err != nil {
		t.Fatal(err)
	}
	names := []string{good, "x\n[Service]\nExecStartPre=sh -c id"}
	for uuid, plant := range bad {
		names = append(names, uuid)
		dir := filepath.Join(units, "sparsevol@"+uuid+".service.d")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := plant(filepath.Join(dir, "10-store.conf")); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range names {
		if err := os.Symlink(filepath.Join(units, "sparsevol@.service"), filepath.Join(wants, "sparsevol@"+name+".service")); err != nil {
			t.Fatal(err)
		}
	}
	out := c.mkdir("generator")
	run := c.mkdir("run")
	before := c.snapshot()
	c.expectCode(c.sv(s, "--run-dir", run, "units", "generate", out), 2)
	entries, err := os.ReadDir(out)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range entries {
		got = append(got, e.Name())
	}
	if want := []string{"sparsevol-boot.service.d", "sparsevol@" + good + ".service.d"}; !slices.Equal(got, want) {
		t.Errorf("generated %q, want %q", got, want)
	}
	if err := os.Symlink(victim, filepath.Join(run, "boot-done")); err != nil {
		t.Fatal(err)
	}
	c.expectCode(c.sv(s, "--run-dir", run, "units", "boot-done"), 1)
	c.unchanged(before)
}
