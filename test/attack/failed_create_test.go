package attack

import "testing"

// A failed create (mkfs error, EFBIG, ENOSPC during mkfs) leaves nothing:
// no metadata, no file, no device; a rerun with other arguments works.
func TestFailedCreateLeavesNothing(t *testing.T) {
	for _, tc := range []struct {
		name   string
		tmpfs  int64 // store on a tmpfs of this size; 0: on the test's filesystem
		args   []string
		global []string
	}{
		{name: "mkfs error", args: []string{"--size", "16M", "--mkfs-option", "-I 100"}},
		{name: "file too large", args: []string{"--size", "20T"}, global: []string{"--overcommit-ratio", "1e9"}},
		{name: "store full during mkfs", tmpfs: 8 << 20, args: []string{"--size", "256M"}, global: []string{"--overcommit-ratio", "1000"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			if tc.tmpfs > 0 {
				s = c.mountTmpfs("s", tc.tmpfs)
			}
			before := c.snapshot()
			r := c.sv(s, append(tc.global, append([]string{"create", "v"}, tc.args...)...)...)
			if r.code == 0 {
				t.Fatalf("the failure did not happen: %v", r)
			}
			c.unchanged(before)
			c.expectCode(c.sv(s, append(tc.global, "create", "v", "--no-start", "--size", "16M")...), 0)
		})
	}
}
