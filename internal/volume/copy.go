package volume

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// CopyMethod says how a file's content was copied.
type CopyMethod string

const (
	// CopyReflink: FICLONE, every extent shared with the source (XFS with
	// reflink, btrfs). Instant, and costs nothing until either side is
	// written.
	CopyReflink CopyMethod = "reflink"
	// CopySparse: the source's data ranges (SEEK_DATA/SEEK_HOLE) copied
	// with copy_file_range; holes stay holes.
	CopySparse CopyMethod = "sparse-copy"
)

// copyChunk bounds one copy_file_range call, so that a cancelled context
// and the progress callback are seen in time, and the copy's writeback
// starts behind it (writebehind.go).
const copyChunk = 16 << 20

// copyFile makes the open, empty file dst, a file of the store, a copy
// of the first size bytes of the open file src: FICLONE where the
// filesystem shares extents, else a sparse copy that reads and writes
// only the source's data ranges and never writes a hole, with its
// writeback started as it goes. A sparse copy allocates its data at
// once: one that the store's filesystem has no room for is refused
// (roomFor, ErrNoSpace) before anything is written. dst ends with size
// bytes; nothing is flushed (see flushCopy). progress, if set, is called
// with the bytes of the source covered so far. The caller owns both fds.
func (s *Store) copyFile(ctx context.Context, dst, src int, size int64, progress func(done, total int64)) (CopyMethod, error) {
	err := unix.IoctlFileClone(dst, src)
	switch {
	case err == nil:
		if progress != nil {
			progress(size, size)
		}
		return CopyReflink, nil
	case !cloneUnsupported(err):
		return "", fmt.Errorf("clone (FICLONE): %w", err)
	}
	need, err := dataBytes(src, size)
	if err != nil {
		return "", err
	}
	if err := s.roomFor(need, "a copy of the data (the store's filesystem shares no extents)"); err != nil {
		return "", err
	}
	if err := sparseCopy(ctx, dst, src, size, progress); err != nil {
		return "", err
	}
	return CopySparse, nil
}

// flushCopy makes the copy in fd, made by method, durable before a record
// names it. Copied data is fsynced. A clone is metadata only: on XFS,
// whose log commits in order, the flush of the record that follows
// (fsutil.FlushOnce) makes it durable too, so it is not flushed on its
// own; elsewhere (btrfs logs per inode) it is fsynced.
func flushCopy(fd int, method CopyMethod) error {
	if method == CopyReflink {
		var st unix.Statfs_t
		if err := unix.Fstatfs(fd, &st); err == nil && st.Type == unix.XFS_SUPER_MAGIC {
			return nil
		}
	}
	if err := unix.Fsync(fd); err != nil {
		return fmt.Errorf("flush the copy: %w", err)
	}
	return nil
}

// cloneUnsupported reports the errors FICLONE gives where the files
// cannot share extents (other filesystem, no reflink, no such ioctl).
func cloneUnsupported(err error) bool {
	return errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) ||
		errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.ENOSYS)
}

// sparseCopy copies the data ranges of src below size to the same offsets
// of dst and sets dst's size.
func sparseCopy(ctx context.Context, dst, src int, size int64, progress func(done, total int64)) error {
	ranges := func(fn func(start, end int64) error) error { return eachDataRange(src, size, fn) }
	cp := func(off, n int64) (int64, error) { return copyRange(src, dst, off, n) }
	return copyRanges(ctx, dst, size, ranges, cp, progress)
}

// copyRanges is the loop of every sparse copy into the store's file dst:
// for each range [start, end) that ranges yields, in order, it calls cp
// with an offset and at most copyChunk bytes until the range is copied
// (cp copies at least one byte to the same offset of dst, and says how
// many), looking at ctx and calling progress (bytes of the source covered
// so far, size) between calls, with dst's writeback started behind it
// (writebehind.go); then it sets dst's size. Nothing is flushed.
func copyRanges(ctx context.Context, dst int, size int64, ranges func(fn func(start, end int64) error) error,
	cp func(off, n int64) (int64, error), progress func(done, total int64)) error {
	wb := newWriteBehind(dst)
	err := ranges(func(start, end int64) error {
		for off := start; off < end; {
			if err := ctx.Err(); err != nil {
				return err
			}
			n, err := cp(off, min(end-off, copyChunk))
			if err == nil {
				err = wb.wrote(off, n)
			}
			if err != nil {
				return err
			}
			off += n
			if progress != nil {
				progress(off, size)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	if err := unix.Ftruncate(dst, size); err != nil {
		return fmt.Errorf("size copy to %d: %w", size, err)
	}
	if progress != nil {
		progress(size, size)
	}
	return nil
}

// dataBytes is how many bytes of fd below size its data ranges hold:
// what a sparse copy of it writes.
func dataBytes(fd int, size int64) (int64, error) {
	var n int64
	err := eachDataRange(fd, size, func(start, end int64) error {
		n += end - start
		return nil
	})
	return n, err
}

// eachDataRange calls fn with each range [start, end) of fd below size
// that SEEK_DATA and SEEK_HOLE say holds data, in order.
func eachDataRange(fd int, size int64, fn func(start, end int64) error) error {
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole from off on
		}
		if err != nil {
			return fmt.Errorf("seek data at %d: %w", off, err)
		}
		if data >= size {
			return nil
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole at %d: %w", data, err)
		}
		hole = min(hole, size)
		if err := fn(data, hole); err != nil {
			return err
		}
		off = hole
	}
	return nil
}

// copyRange copies up to n bytes at off from src to the same offset of
// dst with copy_file_range and returns how many it copied (at least one).
func copyRange(src, dst int, off, n int64) (int64, error) {
	in, out := off, off
	for {
		c, err := unix.CopyFileRange(src, &in, dst, &out, int(n), 0)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return 0, fmt.Errorf("copy_file_range at %d: %w", off, err)
		case c == 0:
			return 0, fmt.Errorf("copy_file_range at %d: source ended early", off)
		}
		return int64(c), nil
	}
}
