package attack

import (
	"path/filepath"
	"testing"
)

// limit of a volume whose file carries a foreign loop device refuses (exit
// 1) before it changes anything: not the metadata, not the device. Lifting
// limits needs no cgroup v2, so this runs the same on every host.
func TestForeignLoopLimitCLI(t *testing.T) {
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
			c.expectCode(c.sv(s, "limit", "v", "--write-iops", "max"), 1)
			c.expectCode(c.sv(s, "limit", "v", "--clear"), 1)
			c.unchanged(before)
		})
	}
}
