package attack

import (
	"fmt"
	"path/filepath"
	"testing"
)

// A failed expand that changed nothing leaves nothing pending: the store
// listing is as before, and later expands and creates work.
func TestFailedExpandLeavesNothingPending(t *testing.T) {
	for _, attached := range []bool{false, true} {
		t.Run(fmt.Sprintf("attached=%v", attached), func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			u := c.create(s, "v")
			if attached {
				c.attach(s, u)
			} else {
				c.watch(filepath.Join(s, u))
			}
			before := c.snapshot()
			// 20 TiB is beyond the largest file of ext4 (EFBIG).
			c.expectCode(c.sv(s, "--overcommit-ratio", "1e9", "expand", "v", "--size", "20T"), 1, 2)
			c.unchanged(before)
			c.expectCode(c.sv(s, "expand", "v", "--size", "32M"), 0)
			c.expectCode(c.sv(s, "create", "w", "--no-start", "--size", "16M"), 0)
			if st := c.status(s, "v"); st.SizeBytes != 32<<20 || st.State != "ready" {
				t.Errorf("after expand to 32M: state %s, size %d", st.State, st.SizeBytes)
			}
		})
	}
}
