package attack

import (
	"os"
	"path/filepath"
	"testing"
)

// expand of a volume whose file carries a foreign loop device refuses
// (exit 1) before it changes anything: the file keeps its size, nothing is
// left pending, and the foreign device is not resized.
func TestForeignLoopExpandCLI(t *testing.T) {
	for _, fb := range foreignBindings {
		t.Run(fb.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			u := c.create(s, "v", "--size", "64M")
			file := filepath.Join(s, u)
			c.bindForeign(file, u, fb)
			c.watch(file)
			before := c.snapshot()
			c.expectCode(c.sv(s, "expand", "v", "--size", "80M"), 1)
			c.unchanged(before)
		})
	}
}

// expand of a volume whose backing file is a symlink or has a second hard
// link refuses (exit 1) before it changes anything: the victim keeps its
// size and nothing is left pending.
func TestLinkedBackingFileExpandCLI(t *testing.T) {
	for _, kind := range []string{"symlink", "hard link"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			u := c.create(s, "v")
			file := filepath.Join(s, u)
			if kind == "symlink" {
				replaceWithSymlink(t, file, c.victim("host-file", 16<<20))
			} else {
				c.mkdir("victim")
				if err := os.Link(file, c.path("victim", "second")); err != nil {
					t.Fatal(err)
				}
				c.watch(c.path("victim", "second"))
			}
			before := c.snapshot()
			c.expectCode(c.sv(s, "expand", "v", "--size", "32M"), 1)
			c.unchanged(before)
		})
	}
}
