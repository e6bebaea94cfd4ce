package attack

import (
	"os"
	"path/filepath"
	"testing"
)

// adopt refuses (exit 2) a file that is another store's volume, a
// symlink, hard-linked, or bound to any loop device; neither store
// changes.
func TestAdoptRefusesForeignFiles(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(c *kase) string // returns the path to adopt
	}{
		{"another store's attached volume", func(c *kase) string {
			a := c.store("a")
			u := c.create(a, "v")
			c.attach(a, u)
			return filepath.Join(a, u)
		}},
		{"another store's detached volume", func(c *kase) string {
			a := c.store("a")
			return filepath.Join(a, c.create(a, "v"))
		}},
		{"symlink", func(c *kase) string {
			img := c.ext4Image("image")
			link := c.path("victim", "link")
			if err := os.Symlink(img, link); err != nil {
				c.t.Fatal(err)
			}
			return link
		}},
		{"hard-linked", func(c *kase) string {
			img := c.ext4Image("image")
			if err := os.Link(img, c.path("victim", "second-link")); err != nil {
				c.t.Fatal(err)
			}
			return img
		}},
		{"bound to a foreign loop device", func(c *kase) string {
			img := c.ext4Image("image")
			c.foreignLoop(img, 0, 0, false, "")
			return img
		}},
		{"bound read-only at an offset", func(c *kase) string {
			img := c.ext4Image("image")
			c.foreignLoop(img, 1<<20, 0, true, "")
			return img
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			path := tc.setup(c)
			b := c.store("b")
			c.watch(path)
			before := c.snapshot()
			c.expectCode(c.sv(b, "adopt", path), 2)
			c.unchanged(before)
		})
	}
}
