package unixsock_test

import (
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/sparsevol/sparsevol/internal/csi"
	"github.com/sparsevol/sparsevol/internal/kubelet"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/unixsock"
)

// listens are the three ways a socket is listened on, which share
// unixsock's rules.
var listens = []struct {
	name   string
	listen func(path string, gid int) (net.Listener, error)
}{
	{"csi", csi.Listen},
	{"kubelet", kubelet.Listen},
	{"unixsock", func(path string, gid int) (net.Listener, error) { return unixsock.Listen(path, gid) }},
}

// TestSocketMode makes the CSI and the registration socket under umask
// 000, with and without a group, and checks mode and group, also as seen
// by a watcher polling the path while the socket is made.
func TestSocketMode(t *testing.T) {
	testutil.RequireRoot(t) // chown to another group
	old := syscall.Umask(0)
	t.Cleanup(func() { syscall.Umask(old) })

	groups := []struct {
		name    string
		gid     int
		mode    fs.FileMode
		wantGid int
	}{
		{"owner only", unixsock.NoGroup, 0o600, 0},
		{"group", 4242, 0o660, 4242},
	}
	for _, l := range listens {
		for _, g := range groups {
			t.Run(l.name+"/"+g.name, func(t *testing.T) {
				dir, err := os.MkdirTemp("", "svsock") // short: sun_path is 108 bytes
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { os.RemoveAll(dir) })
				path := filepath.Join(dir, "sub", "csi.sock")
				if err := os.Mkdir(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				seen := watch(t, path)
				ln, err := l.listen(path, g.gid)
				if err != nil {
					t.Fatal(err)
				}
				bad := seen()
				fi, err := os.Lstat(path)
				if err != nil {
					t.Fatal(err)
				}
				if fi.Mode()&fs.ModeSocket == 0 || fi.Mode().Perm() != g.mode {
					t.Errorf("socket mode %v, want socket %v", fi.Mode(), g.mode)
				}
				if gid := int(fi.Sys().(*syscall.Stat_t).Gid); gid != g.wantGid {
					t.Errorf("socket group %d, want %d", gid, g.wantGid)
				}
				if bad != 0 {
					t.Errorf("a watcher saw the socket with mode %v while it was made", bad)
				}
				if ents, _ := os.ReadDir(filepath.Dir(path)); len(ents) != 1 {
					t.Errorf("socket directory holds %d entries, want the socket alone", len(ents))
				}
				c, err := net.Dial("unix", path)
				if err != nil {
					t.Fatalf("dial: %v", err)
				}
				c.Close()
				if err := ln.Close(); err != nil {
					t.Fatal(err)
				}
				if _, err := os.Lstat(path); !os.IsNotExist(err) {
					t.Errorf("socket left after Close: %v", err)
				}
			})
		}
	}
}

// watch polls path until stop and returns the first mode it saw other
// than the final one, if any: stop waits for one more look.
func watch(t *testing.T, path string) (stop func() fs.FileMode) {
	t.Helper()
	var done atomic.Bool
	var first fs.FileMode
	var wg sync.WaitGroup
	var modes []fs.FileMode
	wg.Add(1)
	go func() {
		defer wg.Done()
		for !done.Load() {
			if fi, err := os.Lstat(path); err == nil {
				modes = append(modes, fi.Mode())
			}
		}
	}()
	return func() fs.FileMode {
		done.Store(true)
		wg.Wait()
		fi, err := os.Lstat(path)
		if err != nil {
			return 0
		}
		for _, m := range modes {
			if m != fi.Mode() && first == 0 {
				first = m
			}
		}
		return first
	}
}

func TestLookupGroup(t *testing.T) {
	tests := []struct {
		in   string
		gid  int
		fail bool
	}{
		{"root", 0, false},
		{"0", 0, false},
		{"4242", 4242, false},
		{"-1", 0, true},
		{"no-such-group-sparsevol", 0, true},
		{"", 0, true},
	}
	for _, tc := range tests {
		gid, err := unixsock.LookupGroup(tc.in)
		if tc.fail != (err != nil) || (!tc.fail && gid != tc.gid) {
			t.Errorf("LookupGroup(%q) = %d, %v; want %d, failure %v", tc.in, gid, err, tc.gid, tc.fail)
		}
	}
}

func TestListenKeepsOtherFiles(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "not-a-socket")
	if err := os.WriteFile(file, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := unixsock.Listen(file, unixsock.NoGroup); err == nil {
		t.Fatal("Listen replaced a regular file")
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "x" {
		t.Fatalf("regular file changed: %q %v", b, err)
	}
}

// shortDir is a fresh directory with a short path (sun_path is 108
// bytes), removed at the end of the test.
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "svsock")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// staleSocket leaves a socket at path that nobody listens on.
func staleSocket(t *testing.T, path string) {
	t.Helper()
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
}

// TestListenExisting: what is at the path decides. A stale socket is
// replaced; a socket someone listens on is refused with ErrInUse and
// left to its listener, as is any other file, a symbolic link (to a live
// or a stale socket) included. The CSI and registration sockets alike.
func TestListenExisting(t *testing.T) {
	tests := []struct {
		name  string
		setup func(t *testing.T, dir, path string)
		ok    bool
		inUse bool
	}{
		{"nothing", func(t *testing.T, dir, path string) {}, true, false},
		{"stale socket", func(t *testing.T, dir, path string) { staleSocket(t, path) }, true, false},
		{"live socket", func(t *testing.T, dir, path string) { testutil.LiveSocket(t, path) }, false, true},
		{"link to a live socket", func(t *testing.T, dir, path string) {
			testutil.LiveSocket(t, filepath.Join(dir, "other.sock"))
			if err := os.Symlink(filepath.Join(dir, "other.sock"), path); err != nil {
				t.Fatal(err)
			}
		}, false, false},
		{"link to a stale socket", func(t *testing.T, dir, path string) {
			staleSocket(t, filepath.Join(dir, "other.sock"))
			if err := os.Symlink(filepath.Join(dir, "other.sock"), path); err != nil {
				t.Fatal(err)
			}
		}, false, false},
		{"directory", func(t *testing.T, dir, path string) {
			if err := os.Mkdir(path, 0o700); err != nil {
				t.Fatal(err)
			}
		}, false, false},
	}
	for _, l := range listens {
		for _, tc := range tests {
			t.Run(l.name+"/"+tc.name, func(t *testing.T) {
				dir := shortDir(t)
				path := filepath.Join(dir, "csi.sock")
				tc.setup(t, dir, path)
				before, _ := os.Lstat(path)
				if err := unixsock.Vacant(path); (err == nil) != tc.ok || errors.Is(err, unixsock.ErrInUse) != tc.inUse {
					t.Errorf("Vacant: %v, want ok %v, in use %v", err, tc.ok, tc.inUse)
				}
				ln, err := l.listen(path, unixsock.NoGroup)
				if (err == nil) != tc.ok || errors.Is(err, unixsock.ErrInUse) != tc.inUse {
					t.Fatalf("listen: %v, want ok %v, in use %v", err, tc.ok, tc.inUse)
				}
				if tc.ok {
					if err := ln.Close(); err != nil {
						t.Fatal(err)
					}
					return
				}
				after, err := os.Lstat(path)
				if err != nil || !os.SameFile(before, after) {
					t.Errorf("refused listen changed %s: %v", path, err)
				}
				if ents, _ := os.ReadDir(dir); len(ents) > 2 {
					t.Errorf("refused listen left %d entries in the directory", len(ents))
				}
			})
		}
	}
}
