package attack

import (
	"fmt"
	"path/filepath"
	"testing"
)

// A backing file replaced by a symlink is never followed: attach refuses
// (exit 1); the victim is not bound and no link is published to it.
func TestSymlinkedBackingFileAttach(t *testing.T) {
	symlinkedBackingFile(t, "attach")
}

// symlinkedBackingFile runs op on a volume whose backing file is a
// symlink to a victim, without and with a foreign loop device on the
// victim: exit 1, and nothing changed.
func symlinkedBackingFile(t *testing.T, op string) {
	for _, foreign := range []bool{false, true} {
		t.Run(fmt.Sprintf("foreign device on victim=%v", foreign), func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			u := c.create(s, "v")
			victim := c.victim("host-file", 16<<20)
			replaceWithSymlink(t, filepath.Join(s, u), victim)
			if foreign {
				c.foreignLoop(victim, 0, 0, false, "")
			}
			before := c.snapshot()
			c.expectCode(c.sv(s, op, "v"), 1)
			c.unchanged(before)
		})
	}
}
