package volume

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/loop"
)

// RecoverOptions tune Recover.
type RecoverOptions struct {
	// Scan, if set, is called as the device is read for its data (chunks
	// that are not all zeroes), with the bytes read and the device's size.
	Scan func(done, total int64)
	// Progress, if set, is called as that data is then copied, with the
	// bytes of the device covered and its size.
	Progress func(done, total int64)
}

// recoverChunk is how much Recover reads at a time.
const recoverChunk = 1 << 20

// Recover brings an orphaned volume back: its backing file was removed
// while a device of ours still holds the inode, so the data is reachable
// only through that device. Recover copies the device into a new backing
// file, sparse (chunks of zeroes stay holes), puts it at <root>/<uuid>,
// detaches the old device, records the new file and attaches the volume
// again. It refuses, changing nothing, while the device is in use (a copy
// of a mounted filesystem is not consistent: unmount it first), when
// the volume is not orphaned, when its record is not ready (ErrNotReady:
// one left creating or deleting; withVolume refuses a broken or newer
// record, ErrBroken, ErrNewer), when the store's filesystem has not the
// room for the copy (ErrNoSpace, see copyOut), and when a device was
// written during the copy (ErrBusy, unwrittenSince). A crash midway
// leaves the old device and a temporary file (recoverTempName) that the
// next Recover replaces and Delete removes.
func (s *Store) Recover(ctx context.Context, ref string, opts RecoverOptions) (*Status, error) {
	var out *Status
	err := s.withVolume(ref, func(v *Volume) error {
		if v.State != StateReady {
			return fmt.Errorf("recover %s: state %s: %w (only a ready volume is recovered; `sparsevol delete --force %s` removes it and its device)", v.Name, v.State, ErrNotReady, v.UUID)
		}
		if _, err := s.statBacking(v.UUID); !isNotExist(err) {
			return fmt.Errorf("recover %s: its backing file is there; only an orphaned volume is recovered: %w", v.Name, ErrInvalid)
		}
		ids, present := s.backingIDs(v)
		bound, err := loop.Bound(ids...)
		if err != nil {
			return fmt.Errorf("recover %s: %w", v.Name, err)
		}
		ours, _ := s.devicesOf(v, ids, present, bound)
		if len(ours) == 0 {
			return fmt.Errorf("recover %s: no device of the volume holds its data any more; restore the file from a backup, or delete the volume: %w", v.Name, ErrInvalid)
		}
		if err := busy(ours); err != nil {
			return fmt.Errorf("recover %s: %w (unmount it first: a copy of a mounted filesystem is not consistent)", v.Name, err)
		}
		dev := ours[0]
		if err := s.copyOut(ctx, v, dev, opts, s.unwrittenSince(ours)); err != nil {
			return fmt.Errorf("recover %s: %w", v.Name, err)
		}
		for _, d := range ours {
			// A deferred detach is fine: the old device goes at its
			// opener's last close, and nothing publishes it any more.
			if err := s.detachOwn(v, d); err != nil && !errors.Is(err, loop.ErrDeferred) {
				return fmt.Errorf("recover %s: the data is back in %s, but: %w", v.Name, v.BackingFile, err)
			}
		}
		s.unpublish(v, ours)
		s.log.Info("volume recovered", "volume", v.Name, "uuid", v.UUID, "from", dev.Path)
		attached, _, err := s.attachLocked(ctx, v)
		if err != nil {
			return err
		}
		out = s.status(v, []*loop.Device{attached}, nil)
		return nil
	})
	return out, err
}

// copyOut copies dev (held while it is read) into a temporary file of the
// store and, once unwritten says nothing wrote to the volume's devices
// meanwhile, renames it to <root>/<uuid>. It reads the device once for the
// chunks that hold data (deviceData), removes the copy a killed recover
// left, and refuses, before it creates anything, a copy the store's
// filesystem has not the room for (roomFor, ErrNoSpace); then it copies
// those chunks (copyRanges), so the copy is sparse.
func (s *Store) copyOut(ctx context.Context, v *Volume, dev *loop.Device, opts RecoverOptions, unwritten func() error) error {
	held, err := loop.Hold(dev.Path, v.owner(dev.Backing))
	if err != nil {
		return err
	}
	defer held.Close()
	// O_EXCL: nobody mounts it while it is copied.
	src, err := os.OpenFile(dev.Path, os.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer src.Close()
	size, err := src.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("size of %s: %w", dev.Path, err)
	}
	buf := make([]byte, recoverChunk)
	data, need, err := deviceData(ctx, src, size, buf, opts.Scan)
	if err != nil {
		return err
	}
	dir, err := s.dirFD()
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	// What a killed recover left goes before the room is counted: its
	// space is the new copy's.
	tmp := recoverTempName(v.UUID)
	_ = unix.Unlinkat(dir, tmp, 0)
	if err := s.roomFor(need, "the copy of the data on "+dev.Path); err != nil {
		return err
	}
	fd, err := unix.Openat(dir, tmp, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return &os.PathError{Op: "create", Path: s.backingPath(tmp), Err: err}
	}
	dst := os.NewFile(uintptr(fd), s.backingPath(tmp))
	defer dst.Close()
	done := false
	defer func() {
		if !done {
			_ = unix.Unlinkat(dir, tmp, 0)
		}
	}()
	ranges := func(fn func(start, end int64) error) error {
		for _, r := range data {
			if err := fn(r.start, r.end); err != nil {
				return err
			}
		}
		return nil
	}
	cp := func(off, n int64) (int64, error) {
		n = min(n, int64(len(buf)))
		if _, err := src.ReadAt(buf[:n], off); err != nil {
			return 0, fmt.Errorf("read %s at %d: %w", dev.Path, off, err)
		}
		if _, err := dst.WriteAt(buf[:n], off); err != nil {
			return 0, fmt.Errorf("write %s: %w", dst.Name(), err)
		}
		return n, nil
	}
	if err := copyRanges(ctx, fd, size, ranges, cp, opts.Progress); err != nil {
		return s.inStore(err)
	}
	if err := flushCopy(fd, CopySparse); err != nil {
		return err
	}
	if err := unwritten(); err != nil {
		return err
	}
	if err := unix.Renameat2(dir, tmp, dir, v.UUID, unix.RENAME_NOREPLACE); err != nil {
		return fmt.Errorf("rename %s to %s: %w", tmp, v.BackingFile, err)
	}
	done = true
	return fsutil.SyncDir(s.root)
}

// unwrittenSince reads the write counters of devs (an orphaned volume's
// devices, found unused) and returns the check that, after a copy, no
// write reached them: the copy then holds all they hold, and their
// detach loses nothing. A writer that came and went meanwhile (one that
// opens the device for each write is seldom an opener at Busy's look)
// moves the counters: ErrBusy, the copy is not used. Readers do not
// matter, and the copy's own exclusive open of the device keeps mounts
// out. Where the kernel keeps no counters for a device, nothing is
// checked after the copy, and the log says so.
func (s *Store) unwrittenSince(devs []*loop.Device) func() error {
	before := make([]*loop.Writes, len(devs))
	for i, d := range devs {
		w, err := loop.WritesOf(d)
		if err != nil {
			s.log.Warn("recover cannot tell writes to the device from its counters; it checks for users only", "device", d.Path, "error", err)
			continue
		}
		before[i] = &w
	}
	return func() error {
		for i, d := range devs {
			if before[i] == nil {
				continue
			}
			if w, err := loop.WritesOf(d); err != nil || w != *before[i] || !w.Idle() {
				return fmt.Errorf("%s was written while it was copied, so the copy may miss what was written: stop the writer and recover again: %w", d.Path, ErrBusy)
			}
		}
		return nil
	}
}

// dataRange is a range [start, end) of a device that holds data.
type dataRange struct{ start, end int64 }

// deviceData reads the first size bytes of the device src in chunks of
// len(buf) and returns the ranges of the chunks that are not all zeroes,
// adjacent ones merged, and how many bytes they hold. progress, if set,
// is called with the bytes read so far and size.
func deviceData(ctx context.Context, src *os.File, size int64, buf []byte, progress func(done, total int64)) ([]dataRange, int64, error) {
	var out []dataRange
	var need int64
	for off := int64(0); off < size; {
		if err := ctx.Err(); err != nil {
			return nil, 0, err
		}
		n, err := src.ReadAt(buf[:min(int64(len(buf)), size-off)], off)
		if n > 0 && !allZero(buf[:n]) {
			if k := len(out) - 1; k >= 0 && out[k].end == off {
				out[k].end += int64(n)
			} else {
				out = append(out, dataRange{off, off + int64(n)})
			}
			need += int64(n)
		}
		off += int64(n)
		if progress != nil {
			progress(off, size)
		}
		if err != nil && !(errors.Is(err, io.EOF) && off >= size) {
			return nil, 0, fmt.Errorf("read %s at %d: %w", src.Name(), off, err)
		}
	}
	return out, need, nil
}

// recoverTempPrefix and the volume's UUID name the copy Recover makes of
// its device before it is renamed to <root>/<uuid> (recoverTempName).
const recoverTempPrefix = ".recover-"

func recoverTempName(uuid string) string { return recoverTempPrefix + uuid }

// removeRecoverTemp removes the copy a killed Recover of volume uuid
// left, if there is one; the caller holds the volume's lock.
func (s *Store) removeRecoverTemp(uuid string) error {
	dir, err := s.dirFD()
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	if err := unix.Unlinkat(dir, recoverTempName(uuid), 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "remove", Path: s.backingPath(recoverTempName(uuid)), Err: err}
	}
	return nil
}

// zeros is what allZero compares with: bytes.Equal is a vectorised
// memcmp, where a loop over the bytes is not.
var zeros [64 << 10]byte

func allZero(b []byte) bool {
	for len(b) > 0 {
		n := min(len(b), len(zeros))
		if !bytes.Equal(b[:n], zeros[:n]) {
			return false
		}
		b = b[n:]
	}
	return true
}
