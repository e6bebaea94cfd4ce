package volume

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"golang.org/x/sys/unix"
)

// fill writes n MiB of incompressible data to dir/name and syncs it.
func fill(t *testing.T, dir, name string, mib int) {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, MiB)
	for i := range buf {
		buf[i] = byte(i*31 + i>>8)
	}
	for i := range mib {
		buf[0] = byte(i)
		if _, err := f.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// removeSynced deletes dir/name and syncs the filesystem, so the blocks are
// free (and, with a discard mount, discarded) when it returns.
func removeSynced(t *testing.T, dir, name string) {
	t.Helper()
	if err := os.Remove(filepath.Join(dir, name)); err != nil {
		t.Fatal(err)
	}
	syncfs(t, dir)
}

func syncfs(t *testing.T, dir string) {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		t.Fatal(err)
	}
}

// rawFITRIM is what an fstrim timer does to every mounted filesystem.
func rawFITRIM(t *testing.T, dir string) {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := fstrimRange{Len: math.MaxUint64}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fitrim, uintptr(unsafe.Pointer(&r))); errno != 0 {
		t.Fatalf("FITRIM %s: %v", dir, errno)
	}
}

func attachMounted(t *testing.T, s *Store, v *Volume, options string) string {
	t.Helper()
	st, err := s.Attach(context.Background(), v.UUID)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Detach(v.UUID, DetachOptions{}) })
	dir := t.TempDir()
	if err := unix.Mount(st.DataDevice, dir, v.FSType, 0, options); err != nil {
		t.Fatalf("mount %s -o %q: %v", st.DataDevice, options, err)
	}
	t.Cleanup(func() { unix.Unmount(dir, 0) }) // runs before the detach
	return dir
}

// TestTrimReclaims writes data into thin volumes, deletes it and trims:
// the backing file must give the space back, down to about what it held
// before the write.
func TestTrimReclaims(t *testing.T) {
	const written = 256 // MiB
	for _, fs := range []string{"ext4", "xfs"} {
		t.Run(fs, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			v := mustCreate(t, s, CreateRequest{Name: "thin-" + fs, SizeBytes: 1 << 30, FSType: fs})
			dir := attachMounted(t, s, v, "")
			fresh := allocated(t, v.BackingFile)
			fill(t, dir, "data", written)
			removeSynced(t, dir, "data")
			full := allocated(t, v.BackingFile)
			if full < fresh+written*MiB*9/10 {
				t.Fatalf("after writing %d MiB the file holds %d bytes, fresh %d: writes did not allocate", written, full, fresh)
			}
			res, err := s.Trim(ctx, v.Name)
			if err != nil {
				t.Fatal(err)
			}
			if res.MountPoint != dir || res.Thick || res.Skipped != "" {
				t.Errorf("result %+v: want mount point %s, thin, not skipped", res, dir)
			}
			// After the trim the mounted filesystem may write again (XFS's
			// log re-allocated 128 KiB once): the reported figure must match
			// a measurement, give or take that.
			if after := allocated(t, v.BackingFile); res.AllocatedBefore != full || abs(res.AllocatedAfter-after) > MiB {
				t.Errorf("result before/after %d/%d, measured %d/%d", res.AllocatedBefore, res.AllocatedAfter, full, after)
			}
			// XFS frees a deleted file's extents in a background worker; on
			// a loaded machine a trim right after the delete can come before
			// it. A later trim gets the rest: what counts is that trims give
			// the space back.
			for try := 0; full-res.AllocatedAfter < written*MiB*9/10 && try < 10; try++ {
				time.Sleep(100 * time.Millisecond)
				if res, err = s.Trim(ctx, v.Name); err != nil {
					t.Fatal(err)
				}
			}
			if reclaimed := full - res.AllocatedAfter; reclaimed < written*MiB*9/10 {
				t.Errorf("reclaimed %d bytes of %d MiB deleted", reclaimed, written)
			}
			if res.AllocatedAfter > fresh+fresh/20+MiB {
				t.Errorf("after trim the file holds %d bytes, the fresh filesystem held %d", res.AllocatedAfter, fresh)
			}
		})
	}
}

// TestTrimThickStaysAllocated: discards from inside a thick volume (an
// fstrim timer) punch holes; sparsevol trim and the next attach fill them,
// and trim itself never deallocates.
func TestTrimThickStaysAllocated(t *testing.T) {
	for _, fs := range []string{"ext4", "xfs"} {
		t.Run(fs, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			v := mustCreate(t, s, CreateRequest{Name: "thick-" + fs, SizeBytes: 512 << 20, FSType: fs, Preallocate: true})
			if got := allocated(t, v.BackingFile); got < v.SizeBytes {
				t.Fatalf("thick volume created with %d of %d bytes allocated", got, v.SizeBytes)
			}
			st, err := s.Attach(ctx, v.UUID)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Detach(v.UUID, DetachOptions{}) })
			dir := t.TempDir()
			t.Cleanup(func() { unix.Unmount(dir, 0) })
			// punch frees 64 MiB inside the volume and FITRIMs it as an
			// fstrim timer would; the unmount waits for every discard.
			punch := func() int64 {
				t.Helper()
				if err := unix.Mount(st.DataDevice, dir, fs, 0, ""); err != nil {
					t.Fatal(err)
				}
				fill(t, dir, "data", 64)
				removeSynced(t, dir, "data")
				rawFITRIM(t, dir)
				if err := unix.Unmount(dir, 0); err != nil {
					t.Fatal(err)
				}
				got := allocated(t, v.BackingFile)
				if got >= v.SizeBytes {
					t.Fatalf("FITRIM inside the thick volume punched nothing (allocated %d)", got)
				}
				return got
			}

			// sparsevol trim of a mounted thick volume: no FITRIM.
			if err := unix.Mount(st.DataDevice, dir, fs, 0, ""); err != nil {
				t.Fatal(err)
			}
			fill(t, dir, "data", 64)
			removeSynced(t, dir, "data")
			res, err := s.Trim(ctx, v.Name)
			if err != nil {
				t.Fatal(err)
			}
			if !res.Thick || res.MountPoint != dir || res.AllocatedAfter < v.SizeBytes || res.FilesystemTrimmedBytes != 0 {
				t.Errorf("trim of a thick volume: %+v; want no FITRIM and full allocation", res)
			}
			if err := unix.Unmount(dir, 0); err != nil {
				t.Fatal(err)
			}

			// Holes punched from inside: trim fills them.
			punched := punch()
			res, err = s.Trim(ctx, v.Name)
			if err != nil {
				t.Fatal(err)
			}
			if res.AllocatedBefore != punched || res.AllocatedAfter < v.SizeBytes || res.ReclaimedBytes() >= 0 {
				t.Errorf("trim after an outside fstrim: before %d (measured %d), after %d, want >= %d", res.AllocatedBefore, punched, res.AllocatedAfter, v.SizeBytes)
			}

			// Punched again, then detached and attached: attach fills them.
			punch()
			if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Attach(ctx, v.UUID); err != nil {
				t.Fatal(err)
			}
			if got := allocated(t, v.BackingFile); got < v.SizeBytes {
				t.Errorf("after re-attach the thick file holds %d of %d bytes", got, v.SizeBytes)
			}
		})
	}
}

// TestReallocateKeepsFileSize: a thick volume whose record says another
// size than its backing file (a stale or hostile record, a crash in the
// middle of an expansion) is re-allocated over the file's own size, by
// trim and by attach: the file, and so the device, keep their size.
func TestReallocateKeepsFileSize(t *testing.T) {
	const size = 16 << 20
	for _, tt := range []struct {
		name   string
		record int64
		reallo func(t *testing.T, s *Store, v *Volume)
	}{
		{"trim, record larger", size + 64<<20, func(t *testing.T, s *Store, v *Volume) {
			if _, err := s.Trim(context.Background(), v.Name); err != nil {
				t.Fatal(err)
			}
		}},
		{"attach, record larger", size + 64<<20, func(t *testing.T, s *Store, v *Volume) {
			if _, err := s.Attach(context.Background(), v.Name); err != nil {
				t.Fatal(err)
			}
		}},
		{"attach, record smaller", size / 2, func(t *testing.T, s *Store, v *Volume) {
			if _, err := s.Attach(context.Background(), v.Name); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			v := mustCreate(t, s, CreateRequest{Name: "thick", SizeBytes: size, Mode: ModeBlock, NoPartition: true, Preallocate: true})
			punchHole(t, v.BackingFile, 10*MiB, 4*MiB) // beyond the smaller record's size
			v.SizeBytes = tt.record
			if err := s.writeMeta(v); err != nil {
				t.Fatal(err)
			}
			tt.reallo(t, s, v)
			fi, err := os.Stat(v.BackingFile)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Size() != size {
				t.Fatalf("backing file after the re-allocation: %d bytes, want %d", fi.Size(), size)
			}
			if got := allocated(t, v.BackingFile); got < size {
				t.Errorf("backing file holds %d of %d bytes: the hole was not filled", got, size)
			}
			if st, err := s.Status(v.Name); err == nil && st.Device != "" {
				if n, err := loop.Size(st.Device); err != nil || int64(n) != size {
					t.Errorf("device %s: %d bytes, %v; want %d", st.Device, n, err, size)
				}
			}
		})
	}
}

// TestReallocateFillsAHoleTheExtentTreeHides: a file's blocks count the
// filesystem's extent tree too, so a thick file of many extents with a
// hole of one block has as many blocks as bytes. The hole is filled all
// the same.
func TestReallocateFillsAHoleTheExtentTreeHides(t *testing.T) {
	const size = 1 << 30 // ext4 keeps 128 MiB per unwritten extent: a tree block
	s := newStore(t, Options{})
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	v := mustCreate(t, s, CreateRequest{Name: "thick", SizeBytes: size, Mode: ModeBlock, NoPartition: true, Preallocate: true})
	punchHole(t, v.BackingFile, 512*MiB, 4096)
	holed := allocated(t, v.BackingFile)
	if holed < size {
		t.Skipf("the store's filesystem shows the hole in the file's blocks (%d of %d bytes): nothing hidden to test", holed, size)
	}
	if _, err := s.Attach(context.Background(), v.Name); err != nil {
		t.Fatal(err)
	}
	// SEEK_HOLE takes unwritten extents for holes: the blocks tell.
	if got := allocated(t, v.BackingFile); got != holed+4096 {
		t.Errorf("thick file after attach holds %d bytes, %d with the hole: the hole was not filled", got, holed)
	}
}

// TestReallocateNeedsRoom: filling the holes of a thick volume takes
// space of the store's filesystem, which other volumes share: where it
// lacks the room, trim refuses with ErrNoSpace and attach goes on
// without (logging it), and neither takes any of what is free.
func TestReallocateNeedsRoom(t *testing.T) {
	ctx := context.Background()
	var logs bytes.Buffer
	s := smallStore(t, "ext4", 128<<20, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	v := mustCreate(t, s, CreateRequest{Name: "thick", SizeBytes: 48 << 20, Mode: ModeBlock, NoPartition: true, Preallocate: true})
	punchHole(t, v.BackingFile, 8*MiB, 32*MiB)
	holey := allocated(t, v.BackingFile)
	fillStore(t, s, 8*MiB)
	free := freeBytes(t, s)

	if _, err := s.Trim(ctx, v.Name); !errors.Is(err, ErrNoSpace) {
		t.Errorf("Trim of a thick volume whose holes the store has no room for = %v, want ErrNoSpace", err)
	}
	if got, nowFree := allocated(t, v.BackingFile), freeBytes(t, s); got != holey || nowFree < free-MiB {
		t.Errorf("after the refused trim the file holds %d bytes (was %d), the store has %d free (was %d)", got, holey, nowFree, free)
	}
	if _, err := s.Attach(ctx, v.Name); err != nil {
		t.Fatalf("Attach of a thick volume whose holes the store has no room for: %v", err)
	}
	if got, nowFree := allocated(t, v.BackingFile), freeBytes(t, s); got != holey || nowFree < free-MiB {
		t.Errorf("after attach the file holds %d bytes (was %d), the store has %d free (was %d)", got, holey, nowFree, free)
	}
	if !strings.Contains(logs.String(), "could not be re-allocated") {
		t.Errorf("attach did not log the re-allocation it skipped; log:\n%s", logs.String())
	}
}

// punchHole punches length bytes at off out of the file at path, as
// discards from inside a volume do.
func punchHole(t *testing.T, path string, off, length int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, length); err != nil {
		t.Fatal(err)
	}
}

// TestTrimRefusals: nothing is trimmed that is not a mounted filesystem.
func TestTrimRefusals(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	mounted := mustCreate(t, s, CreateRequest{Name: "mounted", SizeBytes: 64 << 20})
	mustCreate(t, s, CreateRequest{Name: "unmounted", SizeBytes: 64 << 20})
	mustCreate(t, s, CreateRequest{Name: "block", SizeBytes: 8 << 20, Mode: ModeBlock, NoPartition: true})
	attachMounted(t, s, mounted, "")
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })

	tests := []struct {
		ref     string
		wantErr error
		skipped string
	}{
		{"mounted", nil, ""},
		{"unmounted", ErrNotMounted, "not mounted"},
		{"block", ErrInvalid, "block volume"},
		{"nosuch", ErrNotFound, ""},
	}
	for _, tt := range tests {
		t.Run(tt.ref, func(t *testing.T) {
			res, err := s.Trim(ctx, tt.ref)
			if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
				t.Fatalf("Trim(%s) error %v, want %v", tt.ref, err, tt.wantErr)
			}
			if res != nil && !strings.HasPrefix(res.Skipped, tt.skipped) {
				t.Errorf("Trim(%s) skipped %q, want prefix %q", tt.ref, res.Skipped, tt.skipped)
			}
		})
	}

	// A caller that gave up (while the lock was awaited) trims nothing.
	done, cancel := context.WithCancel(ctx)
	cancel()
	if res, err := s.Trim(done, "mounted"); !errors.Is(err, context.Canceled) || res.AllocatedAfter != res.AllocatedBefore {
		t.Errorf("Trim with a cancelled context = %+v, %v; want context.Canceled and nothing trimmed", res, err)
	}

	all, err := s.TrimAll(ctx)
	if err != nil {
		t.Fatalf("TrimAll: %v (skips are not errors)", err)
	}
	got := map[string]string{}
	for _, r := range all {
		got[r.Name] = r.Skipped
	}
	if len(got) != 3 || got["mounted"] != "" || got["unmounted"] != "not mounted" || got["block"] == "" {
		t.Errorf("TrimAll results %v", got)
	}
}

// TestTrimFrozenRefused: a trim of a filesystem someone else froze
// (fsfreeze --freeze, a backup hook) is refused with ErrBusy, saying how
// to thaw it, at once and with the backing file as it was: FITRIM would
// punch the free space out of the device under their freeze (or, where
// a kernel makes it wait for the thaw, hold the volume's lock until
// then). That freeze stays. TrimAll reports it among its errors. Once
// thawed, the trim works.
func TestTrimFrozenRefused(t *testing.T) {
	for _, tt := range []struct {
		fsType string
		size   int64
	}{
		{"ext4", 64 << 20},
		{"xfs", 300 << 20},
	} {
		t.Run(tt.fsType, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: tt.size, FSType: tt.fsType})
			dir := attachMounted(t, s, v, "")
			fill(t, dir, "data", 32)
			removeSynced(t, dir, "data")
			fd := frozenByOthers(t, dir) // thawed in its cleanup, before the unmount
			frozen := allocated(t, v.BackingFile)

			trimmed := func(name string, trim func() error) error {
				t.Helper()
				done := make(chan error, 1)
				go func() { done <- trim() }()
				select {
				case err := <-done:
					return err
				case <-time.After(10 * time.Second):
					unix.IoctlSetInt(fd, ioctlFITHAW, 0) // lets the blocked trim go on
					<-done
					t.Fatalf("%s of a frozen filesystem blocked until it was thawed", name)
				}
				return nil
			}
			err := trimmed("Trim", func() error { _, err := s.Trim(ctx, "v"); return err })
			if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "fsfreeze --unfreeze "+dir) {
				t.Fatalf("Trim of a frozen filesystem = %v, want ErrBusy saying how to thaw it", err)
			}
			err = trimmed("TrimAll", func() error { _, err := s.TrimAll(ctx); return err })
			if !errors.Is(err, ErrBusy) {
				t.Fatalf("TrimAll with a frozen filesystem = %v, want ErrBusy", err)
			}
			if got := allocated(t, v.BackingFile); got != frozen {
				t.Errorf("the refused trims changed the frozen volume's backing file: %d bytes allocated, %d before", got, frozen)
			}
			if err := unix.IoctlSetInt(fd, ioctlFIFREEZE, 0); !errors.Is(err, unix.EBUSY) {
				t.Fatalf("the other freeze is gone: FIFREEZE = %v, want EBUSY", err)
			}
			if err := unix.IoctlSetInt(fd, ioctlFITHAW, 0); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Trim(ctx, "v"); err != nil {
				t.Fatalf("Trim once thawed: %v", err)
			}
		})
	}
}

// TestDiscardMountReachesBackingFile: with the discard mount option the
// filesystem discards freed blocks itself, and the loop device punches
// them out of the backing file without any trim.
func TestDiscardMountReachesBackingFile(t *testing.T) {
	const written = 128 // MiB
	for _, fs := range []string{"ext4", "xfs"} {
		t.Run(fs, func(t *testing.T) {
			s := newStore(t, Options{})
			v := mustCreate(t, s, CreateRequest{Name: "discard-" + fs, SizeBytes: 512 << 20, FSType: fs})
			dir := attachMounted(t, s, v, "discard")
			fill(t, dir, "data", written)
			full := allocated(t, v.BackingFile)
			removeSynced(t, dir, "data")
			// Online discard is issued when the freeing transaction
			// commits; syncfs forces the commit, but XFS may hand the
			// discard to a worker. Poll the outcome, not the clock.
			deadline := time.Now().Add(30 * time.Second)
			for allocated(t, v.BackingFile) > full-written*MiB*9/10 && time.Now().Before(deadline) {
				syncfs(t, dir)
				time.Sleep(100 * time.Millisecond)
			}
			if after := allocated(t, v.BackingFile); after > full-written*MiB*9/10 {
				t.Errorf("with -o discard, deleting %d MiB left the file at %d bytes (was %d)", written, after, full)
			}
		})
	}
}

// TestDirectIOFallback: a volume whose loop block size is below the
// backing device's sector size cannot do direct I/O (an adopted 512-byte
// volume on a 4Kn disk); it must run buffered, log it, and say so in its
// status.
func TestDirectIOFallback(t *testing.T) {
	ctx := context.Background()
	s0 := newStore(t, Options{})
	// A 4Kn disk: a loop device with 4096-byte sectors over a file of
	// the test store, with ext4 on it, mounted as the store's root.
	disk := mustCreate(t, s0, CreateRequest{Name: "disk4k", SizeBytes: 256 << 20, Mode: ModeBlock, NoPartition: true})
	dev := attach4Kn(t, disk.BackingFile)
	run(t, "mkfs.ext4", "-q", "-F", dev)
	root := mountTemp(t, dev, "ext4")
	if err := os.Chmod(root, 0o700); err != nil {
		t.Fatal(err)
	}

	var logs bytes.Buffer
	s, err := Open(root, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name       string
		make       func(t *testing.T) string // returns the ref
		wantDirect bool
	}{
		{"created filesystem volume", func(t *testing.T) string {
			v := mustCreate(t, s, CreateRequest{Name: "native", SizeBytes: 32 << 20})
			if v.BlockSize != FilesystemBlockSize {
				t.Errorf("block size %d, want %d", v.BlockSize, FilesystemBlockSize)
			}
			return v.Name
		}, true},
		{"created block volume matches the 4096 alignment", func(t *testing.T) string {
			v := mustCreate(t, s, CreateRequest{Name: "raw", SizeBytes: 8 << 20, Mode: ModeBlock, NoPartition: true})
			if v.BlockSize != 4096 {
				t.Errorf("block size %d on a 4Kn store, want 4096", v.BlockSize)
			}
			return v.Name
		}, true},
		{"adopted 512 falls back to buffered", func(t *testing.T) string {
			path := filepath.Join(root, "old.img")
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(path, 32<<20); err != nil {
				t.Fatal(err)
			}
			run(t, "mkfs.ext4", "-q", "-F", path)
			vols, err := s.Adopt(ctx, []string{path}, "")
			if err != nil {
				t.Fatal(err)
			}
			return vols[0].UUID
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			logs.Reset()
			ref := tt.make(t)
			st, err := s.Attach(ctx, ref)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Detach(ref, DetachOptions{}) })
			if !st.DirectIO {
				t.Fatal("direct I/O was not requested")
			}
			if st.DirectIOActive != tt.wantDirect {
				t.Errorf("attach: directIO %v, want %v", st.DirectIOActive, tt.wantDirect)
			}
			again, err := s.Status(ref)
			if err != nil {
				t.Fatal(err)
			}
			if again.DirectIOActive != tt.wantDirect {
				t.Errorf("status: directIO %v, want %v", again.DirectIOActive, tt.wantDirect)
			}
			if warned := strings.Contains(logs.String(), "direct I/O refused"); warned == tt.wantDirect {
				t.Errorf("fallback logged %v, want %v; log:\n%s", warned, !tt.wantDirect, logs.String())
			}
		})
	}
}

// attach4Kn binds path to a loop device with 4096-byte sectors, with
// losetup, as a disk of a foreign tool would be.
func attach4Kn(t *testing.T, path string) string {
	t.Helper()
	return testutil.Losetup(t, path, "--sector-size", "4096", "--direct-io=on")
}

func abs(n int64) int64 {
	if n < 0 {
		return -n
	}
	return n
}

// BenchmarkKeepThickIntact is what attach (and attach --all at boot)
// pays per thick volume whose backing file lost nothing to discards.
func BenchmarkKeepThickIntact(b *testing.B) {
	testutil.RequireRoot(b)
	s, err := Open(b.TempDir(), Options{})
	if err != nil {
		b.Fatal(err)
	}
	v, err := s.Create(context.Background(), CreateRequest{Name: "thick", SizeBytes: 8 << 20, Mode: ModeBlock, NoPartition: true, Preallocate: true})
	if err != nil {
		b.Fatal(err)
	}
	fd, _, err := s.openBacking(v.UUID, unix.O_RDWR)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { unix.Close(fd) })
	b.ResetTimer()
	for range b.N {
		s.keepThick(v, fd)
	}
}
