package attack

import (
	"path/filepath"
	"testing"
)

// A loop device on a volume's file that is not provably the volume's
// (offset, size limit, read-only flag, tag) is never taken for it:
// attach and delete refuse with exit 1, detach leaves it alone, and the
// device, the file and the /dev/sparsevol link stay as they were.
//
// Detach of a volume whose only device is foreign has no exit code in the
// contract (it is idempotent when nothing is attached); the case accepts 0
// or 1 and asserts that nothing changed.
func TestForeignLoopOnVolumeFileCLI(t *testing.T) {
	for _, fb := range foreignBindings {
		for _, op := range []struct {
			name  string
			codes []int
		}{{"attach", []int{1}}, {"delete", []int{1}}, {"detach", []int{0, 1}}} {
			t.Run(fb.name+"/"+op.name, func(t *testing.T) {
				t.Parallel()
				c := newCase(t)
				s := c.store("s")
				u := c.create(s, "v", "--size", "64M")
				file := filepath.Join(s, u)
				c.bindForeign(file, u, fb)
				c.watch(file)
				before := c.snapshot()
				c.expectCode(c.sv(s, op.name, "v"), op.codes...)
				c.unchanged(before)
			})
		}
	}
}
