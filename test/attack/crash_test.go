//go:build crashtest

package attack

import (
	"strings"
	"testing"
)

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
