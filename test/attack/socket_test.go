package attack

import (
	"errors"
	"os"
	"os/exec"
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

// Another user cannot connect to the plugin's sockets (the code before
// let anyone create volumes and delete root's files through them), even
// when the directory around them lets everyone in.
func TestSocketRefusesOtherUsers(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	reg := filepath.Join(c.mkdir("reg"), "reg.sock")
	p := c.startPlugin("000", "--kubelet-registration-path", reg)
	client := nobodyClient(t)
	for _, dir := range []string{c.dir, filepath.Dir(reg), p.sockDir} {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, sock := range []string{p.sock, reg} {
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if _, err := os.Stat(sock); err == nil {
				break
			}
		}
		cmd := exec.Command(client)
		cmd.Env = []string{dialEnv + "=" + sock}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 3 || !strings.Contains(string(out), "permission denied") {
			t.Errorf("uid 65534 connecting to %s: %v %s; want permission denied", sock, err, out)
		}
	}
}

// nobodyClient copies the test binary where any user may run it.
func nobodyClient(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "atk-client-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	client := filepath.Join(dir, "client")
	if err := os.WriteFile(client, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return client
}
