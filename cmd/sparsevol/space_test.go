package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// TestNoRoomAdvice: a command that finds no room in the store ends its
// one error line with what to do, naming the store, once: raise
// --overcommit-ratio only where the policy refused (exit 2), make room
// where the filesystem lacks it, up front (exit 2) or midway (exit 1).
func TestNoRoomAdvice(t *testing.T) {
	testutil.RequireRoot(t)
	small := func(t *testing.T, free int64) string {
		t.Helper()
		root := filepath.Join(testutil.FilesystemDir(t, "xfs", 320<<20), "store")
		if err := os.Mkdir(root, 0o700); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { checkNoLeaks(t, root) })
		var st unix.Statfs_t
		if err := unix.Statfs(root, &st); err != nil {
			t.Fatal(err)
		}
		f, err := os.Create(filepath.Join(filepath.Dir(root), "filler"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if n := int64(st.Bavail)*st.Bsize - free; n > 0 {
			if err := unix.Fallocate(int(f.Fd()), 0, 0, n); err != nil {
				t.Fatal(err)
			}
		}
		return root
	}
	for _, tc := range []struct {
		name   string
		root   func(t *testing.T) string
		args   []string
		code   int
		advice string
		not    string
	}{
		{"policy", func(t *testing.T) string { return newRoot(t) },
			[]string{"--overcommit-ratio", "1", "create", "big", "--size", "100T", "--no-start"},
			2, "or raise --overcommit-ratio", ""},
		{"thick", func(t *testing.T) string { return small(t, 8<<20) },
			[]string{"--overcommit-ratio", "100", "create", "thick", "--size", "64M", "--mode", "block", "--no-partition", "--preallocate", "--no-start"},
			2, "has no room left", "--overcommit-ratio"},
		{"midway", func(t *testing.T) string { return small(t, 8<<20) },
			[]string{"--overcommit-ratio", "100", "create", "x", "--size", "300M", "--fs", "xfs", "--no-start"},
			1, "has no room left", "--overcommit-ratio"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := tc.root(t)
			r := sparsevol(t, root, nil, append([]string{"--unit-dir", t.TempDir()}, tc.args...)...)
			t.Logf("exit %d, stderr:\n%s", r.code, r.stderr)
			if r.code != tc.code {
				t.Errorf("exit %d, want %d; stderr %s", r.code, tc.code, r.stderr)
			}
			if strings.Count(r.stderr, tc.advice) != 1 || !strings.Contains(r.stderr, root) {
				t.Errorf("stderr does not say %q once, naming the store %s:\n%s", tc.advice, root, r.stderr)
			}
			if n := strings.Count(r.stderr, "\nsparsevol: ") + strings.Count(r.stderr[:min(len(r.stderr), 11)], "sparsevol: "); n != 1 {
				t.Errorf("want one error line, got %d:\n%s", n, r.stderr)
			}
			if tc.not != "" && strings.Contains(r.stderr, tc.not) {
				t.Errorf("stderr suggests %s, which cannot help here:\n%s", tc.not, r.stderr)
			}
			entries, err := os.ReadDir(root)
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range entries {
				if !strings.HasPrefix(e.Name(), ".") {
					t.Errorf("left in the store: %s", e.Name())
				}
			}
		})
	}
}
