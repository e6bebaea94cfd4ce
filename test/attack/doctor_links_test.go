package attack

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// doctor reports symlinked and hard-linked backing files.
func TestDoctorLinkedBackingFiles(t *testing.T) {
	for _, kind := range []string{"symlinked", "hard-linked"} {
		t.Run(kind+" backing file", func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			u := c.create(s, "v")
			file := filepath.Join(s, u)
			if kind == "symlinked" {
				replaceWithSymlink(t, file, c.ext4Image("elsewhere"))
			} else {
				c.mkdir("victim")
				if err := os.Link(file, c.path("victim", "second")); err != nil {
					t.Fatal(err)
				}
			}
			r := c.sv(s, "doctor")
			c.expectCode(r, 0, 1)
			word := map[string]string{"symlinked": "symlink", "hard-linked": "link"}[kind]
			reported := false
			for _, line := range strings.Split(r.stdout+r.stderr, "\n") {
				if (strings.Contains(line, u) || strings.Contains(line, "\"v\"") || strings.Contains(line, " v ")) && strings.Contains(strings.ToLower(line), word) {
					reported = true
				}
			}
			if !reported {
				t.Errorf("doctor does not report the %s backing file of v (%s):\n%s", kind, u, r.stdout)
			}
		})
	}
}
