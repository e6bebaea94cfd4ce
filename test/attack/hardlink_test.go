package attack

import (
	"os"
	"path/filepath"
	"testing"
)

// Hard-linked backing file: delete does not report success while the data
// lives on through the other link, and an untagged foreign device on the
// other link is neither adopted nor detached.
func TestHardLinkedBackingFileCLI(t *testing.T) {
	for _, tc := range []struct {
		name    string
		foreign bool
		op      string
		codes   []int
	}{
		{"attach", false, "attach", []int{1}},
		{"delete", false, "delete", []int{1}},
		{"attach with foreign device on other link", true, "attach", []int{1}},
		{"detach with foreign device on other link", true, "detach", []int{0, 1}},
		{"delete with foreign device on other link", true, "delete", []int{1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			u := c.create(s, "v")
			other := c.path("victim", "other-link")
			c.mkdir("victim")
			if err := os.Link(filepath.Join(s, u), other); err != nil {
				t.Fatal(err)
			}
			c.watch(other)
			if tc.foreign {
				c.foreignLoop(other, 0, 0, false, "")
			}
			before := c.snapshot()
			c.expectCode(c.sv(s, tc.op, "v"), tc.codes...)
			c.unchanged(before)
		})
	}
}
