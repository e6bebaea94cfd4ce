package volume

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// TestWriteBehind: what a copy wrote more than the window behind it is
// written back (clean, not under writeback), what is within the window
// may still be dirty, and a file that takes no sync_file_range (a pipe)
// turns write-behind off without failing the copy.
func TestWriteBehind(t *testing.T) {
	// On a filesystem with writeback (a tmpfs has none).
	f, err := os.Create(filepath.Join(testutil.FilesystemDir(t, "ext4", 64<<20), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const mib = 1 << 20
	wb := &writeBehind{fd: int(f.Fd()), kick: mib, window: 2 * mib}
	chunk := bytes.Repeat([]byte{7}, mib/2)
	for off := int64(0); off < 8*mib; off += int64(len(chunk)) {
		if _, err := f.WriteAt(chunk, off); err != nil {
			t.Fatal(err)
		}
		if err := wb.wrote(off, int64(len(chunk))); err != nil {
			t.Fatalf("wrote at %d: %v", off, err)
		}
	}
	if wb.off {
		t.Fatal("write-behind turned itself off on a regular file")
	}
	if wb.inFlight > wb.window {
		t.Errorf("%d bytes in flight, window %d", wb.inFlight, wb.window)
	}
	var cs unix.Cachestat_t
	err = unix.Cachestat(uint(f.Fd()), &unix.CachestatRange{Off: 0, Len: 5 * mib}, &cs, 0)
	if errors.Is(err, unix.ENOSYS) {
		t.Fatalf("cachestat: %v (kernel before 6.5: the test cannot see the page cache)", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if cs.Dirty != 0 || cs.Writeback != 0 {
		t.Errorf("first 5 MiB, more than the window behind: %d pages dirty, %d under writeback, want none", cs.Dirty, cs.Writeback)
	}

	var p [2]int
	if err := unix.Pipe(p[:]); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	pw := &writeBehind{fd: p[1], kick: 1, window: 1}
	if err := pw.wrote(0, 4096); err != nil || !pw.off {
		t.Errorf("pipe: wrote = %v, off = %v; want nil, true", err, pw.off)
	}
}

// TestSparseCopy: the copy holds the source's bytes at their offsets,
// holes stay holes, and the size is the one asked for.
func TestSparseCopy(t *testing.T) {
	const mib = 1 << 20
	tests := map[string]struct {
		size   int64
		ranges [][2]int64 // data ranges of the source
	}{
		"empty":            {4 * mib, nil},
		"one at the start": {4 * mib, [][2]int64{{0, 4096}}},
		"spread":           {64 * mib, [][2]int64{{mib, 3 * mib}, {20 * mib, 20*mib + 8192}, {40 * mib, 60 * mib}}},
		"to the end":       {8 * mib, [][2]int64{{6 * mib, 8 * mib}}},
		"beyond the size":  {8 * mib, [][2]int64{{7 * mib, 9 * mib}}},
	}
	fs := testutil.FilesystemDir(t, "ext4", 256<<20) // SEEK_DATA exact to the block
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			dir, err := os.MkdirTemp(fs, "")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			src, err := os.Create(filepath.Join(dir, "src"))
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			for i, r := range tc.ranges {
				b := bytes.Repeat([]byte{byte(i + 1)}, int(r[1]-r[0]))
				if _, err := src.WriteAt(b, r[0]); err != nil {
					t.Fatal(err)
				}
			}
			if err := src.Truncate(max(tc.size, lastEnd(tc.ranges))); err != nil {
				t.Fatal(err)
			}
			dst, err := os.Create(filepath.Join(dir, "dst"))
			if err != nil {
				t.Fatal(err)
			}
			defer dst.Close()
			if err := sparseCopy(context.Background(), int(dst.Fd()), int(src.Fd()), tc.size, nil); err != nil {
				t.Fatal(err)
			}
			if fi, _ := dst.Stat(); fi.Size() != tc.size {
				t.Errorf("size %d, want %d", fi.Size(), tc.size)
			}
			want := make([]byte, tc.size)
			if _, err := src.ReadAt(want, 0); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, tc.size)
			if _, err := dst.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Error("the copy's bytes differ from the source's")
			}
			var copied int64
			eachDataRange(int(dst.Fd()), tc.size, func(start, end int64) error { copied += end - start; return nil })
			var data int64
			for _, r := range tc.ranges {
				data += min(r[1], tc.size) - min(r[0], tc.size)
			}
			if copied > data+64<<10 { // allocation rounds to blocks
				t.Errorf("the copy holds %d bytes of data, the source %d: holes were written", copied, data)
			}
		})
	}
}

func lastEnd(ranges [][2]int64) int64 {
	var end int64
	for _, r := range ranges {
		end = max(end, r[1])
	}
	return end
}
