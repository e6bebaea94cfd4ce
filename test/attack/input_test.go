package attack

import (
	"os"
	"strings"
	"testing"
)

// Names are ASCII letters, digits, '.', '_', '-', not starting with '-' or
// '.', never UUID-shaped (so no name can stand for another volume's UUID).
// Upper-case UUIDs count as UUID-shaped (the safe reading).
func TestBadNamesCLI(t *testing.T) {
	for _, tc := range []struct {
		name string
		vol  func(existing string) string
	}{
		{"another volume's uuid", func(u string) string { return u }},
		{"a fresh uuid", func(string) string { return "0b6e1f4c-8a3d-4f2e-9c1b-7d5a3e2f1c0d" }},
		{"an upper-case uuid", func(u string) string { return strings.ToUpper(u) }},
		{"right-to-left override", func(string) string { return "data\u202egpj.exe" }},
		{"no-break space", func(string) string { return "my\u00a0data" }},
		{"narrow no-break space", func(string) string { return "my\u202fdata" }},
		{"non-ascii letter", func(string) string { return "donn\u00e9es" }},
		{"colon", func(string) string { return "a:b" }},
		{"at sign", func(string) string { return "a@b" }},
		{"backslash", func(string) string { return `a\b` }},
		{"dollar", func(string) string { return "a$b" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			u := c.create(s, "first")
			before := c.snapshot()
			c.expectCode(c.sv(s, "create", tc.vol(u), "--no-start", "--size", "16M"), 2)
			c.unchanged(before)
		})
	}
}

// Sizes that are not what they look like are refused with exit 2 ("10iB"
// was 10 bytes; a large enough number shows it past the minimum size).
func TestBadSizesCLI(t *testing.T) {
	for _, size := range []string{"16777216iB", "1_000_000_000", "16_000K", "1_6M"} {
		t.Run(size, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			before := c.snapshot()
			c.expectCode(c.sv(s, "create", "v", "--no-start", "--size", size), 2)
			c.unchanged(before)
		})
	}
}

// An overcommit ratio that is not a non-negative finite number, from the
// flag or the environment, is refused with exit 2 by every command (the
// code before refused a NaN create only by accident, as "not enough
// space", and let list run), and create makes nothing.
func TestOvercommitRatioCLI(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  []string
		args []string
	}{
		{"flag NaN", nil, []string{"--overcommit-ratio", "NaN"}},
		{"flag Inf", nil, []string{"--overcommit-ratio", "Inf"}},
		{"flag negative", nil, []string{"--overcommit-ratio", "-1"}},
		{"env NaN", []string{"SPARSEVOL_OVERCOMMIT_RATIO=NaN"}, nil},
		{"env Inf", []string{"SPARSEVOL_OVERCOMMIT_RATIO=+Inf"}, nil},
		{"env negative", []string{"SPARSEVOL_OVERCOMMIT_RATIO=-2"}, nil},
		{"env garbage", []string{"SPARSEVOL_OVERCOMMIT_RATIO=abc"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			before := c.snapshot()
			c.expectCode(c.svEnv(tc.env, s, append(tc.args, "list")...), 2)
			r := c.svEnv(tc.env, s, append(tc.args, "create", "v", "--no-start", "--size", "16M")...)
			c.expectCode(r, 2)
			if strings.Contains(r.stderr, "not enough space") {
				t.Errorf("refused as a space problem, not as a bad ratio: %v", r)
			}
			c.unchanged(before)
		})
	}
}

// An unknown subcommand is a usage error: exit 2.
func TestUnknownSubcommand(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	c.create(s, "v")
	before := c.snapshot()
	c.expectCode(c.sv(s, "frobnicate", "v"), 2)
	c.unchanged(before)
}

// A size of a hundred thousand digits is refused before it is parsed
// (exit 2), and the refusal does not echo it back.
func TestOverlongSizeCLI(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	before := c.snapshot()
	r := c.sv(s, "create", "v", "--no-start", "--size", strings.Repeat("9", 100000))
	c.expectCode(r, 2)
	if len(r.stderr) > 1024 {
		t.Errorf("the refusal is %d bytes long: the size was echoed", len(r.stderr))
	}
	c.unchanged(before)
}

// Store roots the units could not name (a space, a specifier, a new line
// that would start a setting of its own) are refused by every command
// with exit 2, and the store stays as it was, its mode included.
func TestUnitUnsafeStoreRootCLI(t *testing.T) {
	for _, tc := range []struct{ name, dir string }{
		{"space", "st ore"},
		{"specifier", "st%Hore"},
		{"new line", "st\nExecStartPre=x"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store(tc.dir)
			if err := os.Chmod(s, 0o755); err != nil {
				t.Fatal(err)
			}
			before := c.snapshot()
			for _, args := range [][]string{{"list"}, {"create", "v", "--no-start", "--size", "16M"}, {"units", "install", "--offline"}} {
				c.expectCode(c.sv(s, args...), 2)
			}
			c.unchanged(before)
			if fi, err := os.Stat(s); err != nil || fi.Mode().Perm() != 0o755 {
				t.Errorf("store %q after the refusals: %v, %v; want mode 0755 as it was", s, fi.Mode(), err)
			}
			if entries, _ := os.ReadDir(s); len(entries) != 0 {
				t.Errorf("store %q holds %v after the refusals", s, entries)
			}
			if _, err := os.Lstat(c.path("units")); !os.IsNotExist(err) {
				t.Errorf("units install wrote the unit directory: %v", err)
			}
		})
	}
}
