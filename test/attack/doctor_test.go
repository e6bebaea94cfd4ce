package attack

import (
	"io"
	"os"
	"path/filepath"
	"testing"
)

// doctor scopes orphans to this store: another store's devices are not
// to be detached.
func TestDoctorScopesOrphans(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	a, b := c.store("a"), c.store("b")
	u := c.create(a, "v")
	dev := c.attach(a, u)
	r := c.sv(b, "doctor")
	c.expectCode(r, 0, 1)
	if advisesDetach(r.stdout+r.stderr, dev) {
		t.Errorf("doctor of store b advises detaching store a's %s:\n%s", dev, r.stdout)
	}
}

// doctor fails (exit 1) when the store's filesystem is full.
func TestDoctorFullStore(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.mountTmpfs("s", 16<<20)
	c.create(s, "v", "--size", "8M")
	fill, err := os.Create(filepath.Join(s, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(fill, io.LimitReader(zeroReader{}, 32<<20)) // until ENOSPC
	fill.Close()
	c.expectCode(c.sv(s, "doctor"), 1)
}

// pv validates the names it prints into a manifest: exit 2.
func TestPVInvalidNames(t *testing.T) {
	for _, tc := range []struct{ name, flag, value string }{
		{"name with punctuation", "--name", "Bad_Name!"},
		{"storage class with a space", "--storage-class", "a b"},
		{"node with a newline", "--node", "n1\nkind: Secret"},
		{"upper-case name", "--name", "Data"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			c.create(s, "v")
			r := c.sv(s, "pv", "v", tc.flag, tc.value)
			c.expectCode(r, 2)
			if r.code == 2 && r.stdout != "" {
				t.Errorf("refused, but printed a manifest: %s", r.stdout)
			}
		})
	}
}
