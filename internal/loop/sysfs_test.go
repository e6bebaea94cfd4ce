package loop_test

import (
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

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

// TestReadersAreNoWrites: reads in flight, however many, never make a
// device's write counters move or look busy with a write: a reader
// (udev's probe, a backup) changes no data, and a copy that proves the
// device unwritten by its counters must not be refused for it.
func TestReadersAreNoWrites(t *testing.T) {
	testutil.RequireRoot(t)
	file := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(file, make([]byte, 64<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	dev, err := loop.Get(testutil.Losetup(t, file, "--direct-io=on"))
	if err != nil {
		t.Fatal(err)
	}
	before, err := loop.WritesOf(dev)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var readers sync.WaitGroup
	for i := range 4 {
		readers.Go(func() {
			fd, err := unix.Open(dev.Path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Error(err)
				return
			}
			defer unix.Close(fd)
			// Page-aligned, as O_DIRECT wants.
			buf, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
			if err != nil {
				t.Error(err)
				return
			}
			defer unix.Munmap(buf)
			for off := int64(i) << 20; ; off = (off + 4<<20) % (64 << 20) {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := unix.Pread(fd, buf, off); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	deadline := time.Now().Add(time.Second)
	for samples := 0; time.Now().Before(deadline); samples++ {
		w, err := loop.WritesOf(dev)
		if err != nil || w != before || !w.Idle() {
			t.Errorf("sample %d under readers: %+v, %v; want %+v, no write in flight", samples, w, err, before)
			break
		}
	}
	close(stop)
	readers.Wait()
}
