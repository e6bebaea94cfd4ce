package loop_test

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// DevT is the kernel's number for the device, the one its /dev node has.
func TestDevTMatchesNode(t *testing.T) {
	testutil.RequireRoot(t)
	file := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(file, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	path := testutil.Losetup(t, file)
	devs, err := loop.List()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	for _, d := range devs {
		if d.Path != path {
			continue
		}
		got, err := d.DevT()
		if err != nil {
			t.Fatal(err)
		}
		if got != st.Rdev {
			t.Fatalf("DevT of %s = %d:%d, its node is %d:%d", path, unix.Major(got), unix.Minor(got), unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		return
	}
	t.Fatalf("%s not listed", path)
}
