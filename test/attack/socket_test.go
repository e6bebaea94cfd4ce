package attack

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The CSI socket and kubelet's registration socket are 0600 (0660 with
// --socket-group) whatever the umask the plugin starts under.
func TestSocketModes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		extra func(p string) []string
		group bool
	}{
		{"umask 000", func(string) []string { return nil }, false},
		{"umask 000 with registration", func(dir string) []string {
			return []string{"--kubelet-registration-path", filepath.Join(dir, "reg.sock")}
		}, false},
		{"umask 000 with socket group", func(string) []string { return []string{"--socket-group", "disk"} }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			dir := c.mkdir("reg")
			p := c.startPlugin("000", tc.extra(dir)...)
			socks := []string{p.sock}
			if strings.Contains(tc.name, "registration") {
				socks = append(socks, filepath.Join(dir, "reg.sock"))
			}
			for _, s := range socks {
				fi, err := os.Stat(s)
				// The plugin listens on its sockets one after the other.
				for deadline := time.Now().Add(10 * time.Second); err != nil && time.Now().Before(deadline); {
					time.Sleep(20 * time.Millisecond)
					fi, err = os.Stat(s)
				}
				if err != nil {
					t.Errorf("socket %s: %v", s, err)
					continue
				}
				st := fi.Sys().(*syscall.Stat_t)
				want, gid := os.FileMode(0o600), uint32(0)
				if tc.group {
					want, gid = 0o660, 6 // disk
				}
				if fi.Mode().Perm() != want || st.Uid != 0 || st.Gid != gid {
					t.Errorf("socket %s: mode %v uid %d gid %d; want %v root:%d", s, fi.Mode().Perm(), st.Uid, st.Gid, want, gid)
				}
			}
		})
	}
}
