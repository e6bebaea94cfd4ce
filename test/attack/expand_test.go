package attack

import (
	"fmt"
	"path/filepath"
	"strings"
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

// An expand killed after growing the file is shown as such (state
// expanding, with its target) and can be finished, or abandoned.
func TestPartialExpand(t *testing.T) {
	for _, finish := range []string{"finish", "abandon"} {
		t.Run(finish, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			u := c.create(s, "v")
			c.attach(s, u)
			r := c.svEnv([]string{"SPARSEVOL_TEST_CRASH_AT=expand:file"}, s, "expand", "v", "--size", "32M")
			if r.code != -1 {
				t.Fatalf("the expand was not killed after growing the file: %v", r)
			}
			out := c.mustSV(s, "status", "v", "-o", "json")
			if st := c.status(s, "v"); st.State != "expanding" || !strings.Contains(out, "33554432") {
				t.Errorf("status after a partial expand to 32Mi: want state expanding naming 33554432, got:\n%s", out)
			}
			if lst := c.mustSV(s, "list", "-o", "json"); !strings.Contains(lst, `"expanding"`) {
				t.Errorf("list after a partial expand does not say expanding:\n%s", lst)
			}
			want := int64(32 << 20)
			if finish == "finish" {
				c.expectCode(c.sv(s, "expand", "v", "--size", "32M"), 0)
			} else {
				c.expectCode(c.sv(s, "expand", "v", "--abandon"), 0)
				want = 16 << 20
			}
			if st := c.status(s, "v"); st.State != "ready" || st.SizeBytes != want || st.ExpandingTo != 0 {
				t.Errorf("after %s: state %s size %d expandingTo %d; want ready, %d", finish, st.State, st.SizeBytes, st.ExpandingTo, want)
			}
			c.expectCode(c.sv(s, "expand", "v", "--size", "48M"), 0)
		})
	}
}
