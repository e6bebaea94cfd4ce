package volume

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	osexec "os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// smallStore opens a store in a directory of a small filesystem of
// fsType (size bytes), which fillStore fills.
func smallStore(t *testing.T, fsType string, size int64, opts Options) *Store {
	t.Helper()
	root := filepath.Join(testutil.FilesystemDir(t, fsType, size), "store")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, dev := range boundUnder(root) {
			osexec.Command("losetup", "-d", dev).Run()
			t.Errorf("leaked loop device %s", dev)
		}
	})
	s, err := Open(root, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// fillStore leaves free bytes available on s's filesystem, with a file
// beside the store.
func fillStore(t *testing.T, s *Store, free int64) {
	t.Helper()
	f, err := os.CreateTemp(filepath.Dir(s.Root()), "filler-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(f.Name()) })
	defer f.Close()
	if n := freeBytes(t, s) - free; n > 0 {
		if err := unix.Fallocate(int(f.Fd()), 0, 0, n); err != nil {
			t.Fatal(err)
		}
	}
}

// freeBytes is what s's filesystem has available.
// refusedForSpace runs op, which must be refused with ErrNoSpace (what
// says what it asked for) before it changes the store or takes any of
// what is free.
func refusedForSpace(t *testing.T, s *Store, what string, op func() error) {
	t.Helper()
	before, free := storeTree(t, s), freeBytes(t, s)
	if err := op(); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("%s with %dKiB free: %v, want ErrNoSpace", what, free>>10, err)
	}
	if after := storeTree(t, s); !slices.Equal(after, before) {
		t.Errorf("the store changed:\n%q\nwas\n%q", after, before)
	}
	if got := freeBytes(t, s); got < free {
		t.Errorf("free space %d after the refusal, %d before", got, free)
	}
}

func freeBytes(t *testing.T, s *Store) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(s.Root(), &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}

// storeTree lists every name below s's root.
func storeTree(t *testing.T, s *Store) []string {
	t.Helper()
	var names []string
	err := filepath.WalkDir(s.Root(), func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		names = append(names, path)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// TestCopyRefusedBeyondFreeSpace: on a store whose filesystem shares no
// extents, a copy of data (a snapshot, a restore, a clone) that the free
// space cannot hold is refused with ErrNoSpace before anything is
// copied, though the overcommit policy would promise it: the store is
// not filled up (every thin volume's writes would fail meanwhile) and
// nothing is left.
func TestCopyRefusedBeyondFreeSpace(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		op   func(s *Store) error
	}{
		{"snapshot", func(s *Store) error {
			_, err := s.CreateSnapshot(ctx, "v", "s2", SnapshotOptions{})
			return err
		}},
		{"from snapshot", func(s *Store) error {
			_, err := s.Create(ctx, CreateRequest{Name: "r", FromSnapshot: "s"})
			return err
		}},
		{"clone", func(s *Store) error {
			_, err := s.Create(ctx, CreateRequest{Name: "c", CloneOf: "v"})
			return err
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := smallStore(t, "ext4", 256<<20, Options{OvercommitRatio: 10})
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 96 << 20, Mode: ModeBlock, NoPartition: true})
			writeFileAt(t, v.BackingFile, 0, 64<<20)
			if _, err := s.CreateSnapshot(ctx, v.Name, "s", SnapshotOptions{}); err != nil {
				t.Fatal(err)
			}
			fillStore(t, s, 16<<20)
			refusedForSpace(t, s, "copy of 64MiB", func() error { return tt.op(s) })
		})
	}
}

// fillUp leaves s's filesystem no room for a new file: with inodes, it
// uses up its inodes (empty files); otherwise its blocks. It returns the
// directory of the files it made.
func fillUp(t *testing.T, s *Store, inodes bool) string {
	t.Helper()
	dir, err := os.MkdirTemp(filepath.Dir(s.Root()), "filler-")
	if err != nil {
		t.Fatal(err)
	}
	if !inodes {
		fillStore(t, s, 1<<20) // the rest in blocks: XFS maps extents too
	}
	for i := 0; ; i++ {
		fd, err := unix.Open(filepath.Join(dir, strconv.Itoa(i)), unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
		if err == nil && !inodes {
			err = unix.Fallocate(fd, 0, 0, 4096)
		}
		if fd >= 0 {
			unix.Close(fd)
		}
		if errors.Is(err, unix.ENOSPC) {
			return dir
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// TestDeleteOnFullStore: where the store's filesystem has no room left
// for a new file (no block on XFS, whose reserve root cannot use; no
// inode on ext4), a snapshot and a volume are still deleted, leaving
// nothing: deleting them is how the room is made.
func TestDeleteOnFullStore(t *testing.T) {
	tests := []struct {
		fs     string // the store's
		size   int64
		inodes bool
	}{
		{"xfs", 320 << 20, false},
		{"ext4", 64 << 20, true},
	}
	ctx := context.Background()
	for _, tt := range tests {
		name := tt.fs + "-blocks"
		if tt.inodes {
			name = tt.fs + "-inodes"
		}
		t.Run(name, func(t *testing.T) {
			s := smallStore(t, tt.fs, tt.size, Options{})
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true})
			writeFileAt(t, v.BackingFile, 0, 1<<20)
			sn, err := s.CreateSnapshot(ctx, v.Name, "s", SnapshotOptions{})
			if err != nil {
				t.Fatal(err)
			}
			fillUp(t, s, tt.inodes)
			if err := s.DeleteSnapshot(ctx, "s"); err != nil {
				t.Errorf("delete snapshot: %v", err)
			}
			if err := s.Delete(ctx, v.Name, DetachOptions{}); err != nil {
				t.Errorf("delete volume: %v", err)
			}
			left := slices.DeleteFunc(storeTree(t, s), func(p string) bool {
				return !strings.Contains(p, v.UUID) && !strings.Contains(p, sn.UUID)
			})
			if len(left) > 0 {
				t.Errorf("left in the store: %q", left)
			}
		})
	}
}

// TestCreateWithOneInodeLeft: a create on a store with one inode left
// (room for its record, none for its lock file) fails leaving the store
// as it was, not with a record that stays creating.
func TestCreateWithOneInodeLeft(t *testing.T) {
	s := smallStore(t, "ext4", 64<<20, Options{})
	rawVolume(t, s, "first") // the store's own directories and locks
	filler := fillUp(t, s, true)
	if err := os.Remove(filepath.Join(filler, "0")); err != nil {
		t.Fatal(err)
	}
	before := storeTree(t, s)
	_, err := s.Create(context.Background(), CreateRequest{Name: "v", SizeBytes: MiB, Mode: ModeBlock, NoPartition: true})
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("create with one inode left: %v, want ENOSPC", err)
	}
	if after := storeTree(t, s); !slices.Equal(after, before) {
		t.Errorf("the store changed:\n%q\nwas\n%q", after, before)
	}
}

// TestNoRoomMidway: an operation that runs out of room on the store's
// filesystem midway (mkfs.xfs, a record's rename or temporary file) fails
// with ErrNoRoom, not ErrNoSpace (nothing refused it up front), as a
// *SpaceError naming the store, and leaves the store as it was. An
// import's data is refused before it fills the filesystem (ErrNoSpace:
// each record must find room beside the spare an import leaves), with
// the store as it was too.
func TestNoRoomMidway(t *testing.T) {
	ctx := context.Background()
	first := func(s *Store) io.Reader {
		rawVolume(t, s, "first") // the store's own directories and locks
		return nil
	}
	tests := []struct {
		name   string
		fs     string // the store's
		size   int64
		inodes bool                     // fill the inodes, not the blocks
		setup  func(s *Store) io.Reader // before the store is filled
		op     func(s *Store, in io.Reader) error
		refuse bool // refused before the filesystem is full: ErrNoSpace
	}{
		{"create ext4", "xfs", 320 << 20, false, first, func(s *Store, _ io.Reader) error {
			// mke2fs zeroes a file by punching holes and needs little
			// room: this one fails at its ready record, after mkfs.
			_, err := s.Create(ctx, CreateRequest{Name: "v", SizeBytes: 1 << 30})
			return err
		}, false},
		{"create xfs", "xfs", 320 << 20, false, first, func(s *Store, _ io.Reader) error {
			_, err := s.Create(ctx, CreateRequest{Name: "v", SizeBytes: 300 << 20, FSType: "xfs"})
			return err
		}, false},
		{"import", "ext4", 64 << 20, false, func(s *Store) io.Reader {
			v := mustCreate(t, s, CreateRequest{Name: "src", SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true})
			writeFileAt(t, v.BackingFile, 0, 8<<20)
			var stream bytes.Buffer
			if _, err := s.Export(ctx, v.Name, &stream, StreamOptions{}); err != nil {
				t.Fatal(err)
			}
			return &stream
		}, func(s *Store, in io.Reader) error {
			_, err := s.Import(ctx, in, ImportRequest{Name: "v"})
			return err
		}, true},
		{"record", "ext4", 64 << 20, true, func(s *Store) io.Reader {
			rawVolume(t, s, "v")
			return nil
		}, func(s *Store, _ io.Reader) error {
			_, err := s.Change("v", Change{Labels: map[string]string{"k": "v"}})
			return err
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := smallStore(t, tt.fs, tt.size, Options{OvercommitRatio: 1e6})
			var in io.Reader
			if tt.setup != nil {
				in = tt.setup(s)
			}
			if tt.inodes {
				fillUp(t, s, true)
			} else {
				fillStore(t, s, 256<<10)
			}
			before := storeTree(t, s)
			err := tt.op(s, in)
			var se *SpaceError
			want, not := ErrNoRoom, ErrNoSpace
			if tt.refuse {
				want, not = ErrNoSpace, nil
			}
			if !errors.Is(err, want) || (not != nil && errors.Is(err, not)) || !errors.As(err, &se) || se.Store != s.Root() {
				t.Fatalf("on a full store: %v (%#v), want %v as a *SpaceError of %s", err, se, want, s.Root())
			}
			if after := storeTree(t, s); !slices.Equal(after, before) {
				t.Errorf("the store changed:\n%q\nwas\n%q", after, before)
			}
		})
	}
}

// TestThinExpandNeedsRoomForMetadata: growing a thin ext4 volume writes
// new group descriptors and their backups into the file's holes; where
// the store has no room for them, the expansion is refused before
// anything grows (resize2fs would stop midway and leave the filesystem
// for e2fsck to repair). With room, it grows.
func TestThinExpandNeedsRoomForMetadata(t *testing.T) {
	ctx := context.Background()
	s := smallStore(t, "ext4", 256<<20, Options{OvercommitRatio: 1e9})
	v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 300 << 20})
	if _, err := s.Expand(ctx, "v", 1<<30, ExpandOptions{}); err != nil {
		t.Fatalf("expand to 1GiB with %dMiB free: %v", freeBytes(t, s)>>20, err)
	}
	fillStore(t, s, 256<<10)
	before := storeTree(t, s)
	record, err := os.ReadFile(filepath.Join(s.Root(), v.UUID+".json"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Expand(ctx, "v", 2<<40, ExpandOptions{})
	var se *SpaceError
	if !errors.Is(err, ErrNoSpace) || !errors.As(err, &se) || !strings.Contains(err.Error(), "metadata") {
		t.Fatalf("expand to 2TiB with 256KiB free = %v; want ErrNoSpace for the filesystem's metadata", err)
	}
	if after := storeTree(t, s); !slices.Equal(after, before) {
		t.Errorf("the store changed:\n%q\nwas\n%q", after, before)
	}
	if got, _ := os.ReadFile(filepath.Join(s.Root(), v.UUID+".json")); !bytes.Equal(got, record) {
		t.Errorf("the record changed:\n%s\nwas\n%s", got, record)
	}
	if fi, err := os.Stat(filepath.Join(s.Root(), v.UUID)); err != nil || fi.Size() != 1<<30 {
		t.Errorf("backing file %v, %v; want it still 1GiB", fi, err)
	}
	if out, err := osexec.Command("e2fsck", "-fn", filepath.Join(s.Root(), v.UUID)).CombinedOutput(); err != nil {
		t.Errorf("e2fsck -fn after the refusal: %v\n%s", err, out)
	}
	if err := s.Delete(ctx, "v", DetachOptions{}); err != nil {
		t.Error(err)
	}
}

// fullStream is a stream of a whole-device raw volume of size bytes, every
// byte of it data (0xab).
func fullStream(t *testing.T, size int64) []byte {
	t.Helper()
	var b bytes.Buffer
	h := &StreamHeader{Name: "v", UUID: "0b9d5a10-8c5e-4a57-b1a3-7f3e9c2d4e64", SizeBytes: size, Mode: ModeBlock}
	sw, err := newStreamWriter(&b, h)
	if err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Repeat([]byte{0xab}, maxExtent)
	for off := int64(0); off < size; off += maxExtent {
		if err := sw.extent(off, chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := sw.close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// TestImportCountsItsDataOnce: an import needs the room for its volume
// once. Its data, already in the store's unnamed file when the volume is
// reserved, is the new volume's own allocation, not space that is gone:
// a full 64 MiB stream imports into a store with 96 MiB free, overcommit
// ratio 1.
func TestImportCountsItsDataOnce(t *testing.T) {
	const size = 64 << 20
	s := smallStore(t, "ext4", 256<<20, Options{})
	fillStore(t, s, size+size/2)
	v, err := s.Import(context.Background(), bytes.NewReader(fullStream(t, size)), ImportRequest{Name: "i"})
	if err != nil {
		t.Fatalf("import of %s with %s free: %v", FormatSize(size), FormatSize(size+size/2), err)
	}
	if got := allocated(t, v.BackingFile); got < size {
		t.Errorf("imported volume allocates %d bytes, want its %d", got, size)
	}
}

// TestImportStopsBeforeTheStoreIsFull: the check of a stream's header is
// the overcommit policy's, no reservation: the data that follows must
// find room as it comes. A full 64 MiB stream into a store with 48 MiB
// free (ratio 10) is refused with ErrNoSpace while the filesystem keeps
// importSpare free, instead of filling it (failing every thin volume's
// writes meanwhile) and meeting ENOSPC; nothing is left.
func TestImportStopsBeforeTheStoreIsFull(t *testing.T) {
	const size = 64 << 20
	s := smallStore(t, "ext4", 256<<20, Options{OvercommitRatio: 10})
	fillStore(t, s, 48<<20)
	minFree := freeBytes(t, s)
	progress := func(done, total int64) { minFree = min(minFree, freeBytes(t, s)) }
	_, err := s.Import(context.Background(), bytes.NewReader(fullStream(t, size)), ImportRequest{Name: "i", StreamOptions: StreamOptions{Progress: progress}})
	if !errors.Is(err, ErrNoSpace) || errors.Is(err, unix.ENOSPC) {
		t.Fatalf("import of %s with 48Mi free = %v; want ErrNoSpace refused before the filesystem is full", FormatSize(size), err)
	}
	if minFree < 8<<20 {
		t.Errorf("the import left %s free on the store's filesystem, want about 16Mi", FormatSize(minFree))
	}
	if files, _ := os.ReadDir(s.root); len(files) > 1 { // the lock directory
		t.Errorf("a refused import left %v", files)
	}
}
