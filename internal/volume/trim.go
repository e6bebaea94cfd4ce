package volume

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"sort"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrNotMounted: the operation needs the volume's filesystem mounted.
var ErrNotMounted = errors.New("volume not mounted")

// fitrim is FITRIM, _IOWR('X', 121, struct fstrim_range); x/sys/unix does
// not define it.
const fitrim = 0xC0185879

// fstrimRange is struct fstrim_range of <linux/fs.h>.
type fstrimRange struct {
	Start  uint64
	Len    uint64
	MinLen uint64
}

// TrimResult is what trim did to one volume. Reclaimed space is measured
// on the backing file (st_blocks before and after), not taken from the
// filesystem's own report, which counts free space it passed down whether
// or not it was allocated.
type TrimResult struct {
	Name       string `json:"name"`
	UUID       string `json:"uuid"`
	MountPoint string `json:"mountPoint,omitempty"`
	// Thick volumes are not trimmed: their backing file is re-allocated
	// instead, undoing whatever discards from inside the volume (fstrim,
	// a discard mount, zeroing) punched into it.
	Thick bool `json:"thick,omitempty"`
	// Skipped says why nothing was done ("" when something was).
	Skipped string `json:"skipped,omitempty"`
	// FilesystemTrimmedBytes is the filesystem's report: free space it
	// passed down as discards.
	FilesystemTrimmedBytes uint64 `json:"filesystemTrimmedBytes"`
	// FilesystemUsedBytes is what the mounted filesystem says it uses
	// (blocks minus free blocks), the floor trim can reach.
	FilesystemUsedBytes int64 `json:"filesystemUsedBytes"`
	AllocatedBefore     int64 `json:"allocatedBytesBefore"`
	AllocatedAfter      int64 `json:"allocatedBytesAfter"`
}

// ReclaimedBytes is what the backing file gave back to the store's
// filesystem; negative for a thick volume whose holes were re-allocated.
func (r *TrimResult) ReclaimedBytes() int64 { return r.AllocatedBefore - r.AllocatedAfter }

// Trim gives the free space of a mounted filesystem volume back to the
// store: FITRIM on its mount point makes the filesystem discard its free
// blocks, and the loop driver turns each discard into a hole punched in
// the backing file. A volume that is not mounted is reported with
// ErrNotMounted (nothing is mounted behind the back of whoever owns it);
// a block volume with ErrInvalid; a filesystem someone froze with ErrBusy
// (refuseFrozenAt). A thick volume is re-allocated instead (see
// TrimResult.Thick). ctx is honoured until FITRIM starts, which runs to
// its end.
func (s *Store) Trim(ctx context.Context, ref string) (*TrimResult, error) {
	var res *TrimResult
	err := s.withVolume(ref, func(v *Volume) error {
		var err error
		res, err = s.trim(ctx, v)
		return err
	})
	return res, err
}

// TrimAll trims every mounted filesystem volume and re-allocates every
// thick one. Volumes with nothing to do are reported with Skipped set;
// failures of single volumes are joined, the others still trimmed.
func (s *Store) TrimAll(ctx context.Context) ([]*TrimResult, error) {
	vols, err := s.List()
	if err != nil {
		return nil, err
	}
	sort.Slice(vols, func(i, j int) bool { return vols[i].Name < vols[j].Name })
	var out []*TrimResult
	var errs []error
	for _, lv := range vols {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		err := s.withVolume(lv.UUID, func(v *Volume) error {
			res, err := s.trim(ctx, v)
			switch {
			case err == nil:
				out = append(out, res)
			case errors.Is(err, ErrNotMounted), errors.Is(err, ErrInvalid), errors.Is(err, ErrNotReady):
				out = append(out, res)
				return nil
			}
			return err
		})
		if err != nil && !errors.Is(err, ErrNotFound) {
			errs = append(errs, err)
		}
	}
	return out, errors.Join(errs...)
}

// trim runs under v's lock. It always returns a result, with Skipped set
// when the error says why nothing was done. A ctx done (while the lock
// was awaited) does nothing.
func (s *Store) trim(ctx context.Context, v *Volume) (*TrimResult, error) {
	res := &TrimResult{Name: v.Name, UUID: v.UUID, Thick: v.Preallocate}
	res.AllocatedBefore = s.allocated(v.UUID)
	res.AllocatedAfter = res.AllocatedBefore
	if err := ctx.Err(); err != nil {
		return res, fmt.Errorf("trim %s: %w", v.Name, err)
	}
	if v.State != StateReady {
		res.Skipped = "not ready (" + string(v.State) + ")"
		return res, fmt.Errorf("trim %s: state %s: %w", v.Name, v.State, ErrNotReady)
	}
	st := s.statusOf(v)
	if len(st.MountPoints) > 0 {
		res.MountPoint = st.MountPoints[0]
	}
	if v.Preallocate {
		fd, _, err := s.openBacking(v.UUID, unix.O_RDWR)
		if err != nil {
			return res, fmt.Errorf("trim %s: %w", v.Name, err)
		}
		_, res.AllocatedAfter, err = s.reallocate(v, fd)
		unix.Close(fd)
		if err != nil {
			return res, fmt.Errorf("trim %s: %w", v.Name, err)
		}
		s.log.Info("thick volume re-allocated instead of trimmed", "volume", v.Name,
			"before", res.AllocatedBefore, "after", res.AllocatedAfter)
		return res, nil
	}
	if v.Mode != ModeFilesystem {
		res.Skipped = "block volume: discard from its consumer (blkdiscard, or a filesystem inside it) punches the holes"
		return res, fmt.Errorf("trim %s: %s: %w", v.Name, res.Skipped, ErrInvalid)
	}
	if res.MountPoint == "" {
		res.Skipped = "not mounted"
		return res, fmt.Errorf("trim %s: %w (trim runs where the filesystem is mounted)", v.Name, ErrNotMounted)
	}
	var dev unix.Stat_t
	if err := unix.Stat(st.DataDevice, &dev); err != nil {
		return res, fmt.Errorf("trim %s: %w", v.Name, err)
	}
	trimmed, used, at, err := fstrim(ctx, st.MountPoints, dev.Rdev)
	if at != "" {
		res.MountPoint = at
	}
	if err != nil {
		return res, fmt.Errorf("trim %s: %w", v.Name, err)
	}
	res.FilesystemTrimmedBytes, res.FilesystemUsedBytes = trimmed, used
	res.AllocatedAfter = s.allocated(v.UUID)
	s.log.Info("volume trimmed", "volume", v.Name, "mountPoint", res.MountPoint,
		"reclaimed", res.ReclaimedBytes(), "allocated", res.AllocatedAfter, "filesystemUses", used)
	return res, nil
}

// fstrim runs FITRIM over the whole filesystem mounted at the first of
// mounts proven to be the filesystem of the block device devnum
// (openMountIn), and returns the bytes the filesystem discarded, the
// bytes it uses and where it trimmed. A filesystem someone froze is
// refused with ErrBusy (refuseFrozenAt): its discards would change the
// device under their freeze. ctx is asked before FITRIM, not during it.
func fstrim(ctx context.Context, mounts []string, devnum uint64) (trimmed uint64, used int64, dir string, err error) {
	fd, dir, err := openMountIn(mounts, devnum)
	if err != nil {
		return 0, 0, "", fmt.Errorf("fstrim: %w", err)
	}
	f := os.NewFile(uintptr(fd), dir)
	defer f.Close()
	if err := refuseFrozenAt(fd, dir, "trimming it would change its device under that freeze"); err != nil {
		return 0, 0, dir, err
	}
	// Blocks of files just deleted may not be free yet: XFS frees them in
	// a background worker (which statfs flushes) and skips extents whose
	// freeing is not yet on disk (which syncfs forces). Both are cheap.
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &sfs); err != nil {
		return 0, 0, dir, fmt.Errorf("fstrim %s: statfs: %w", dir, err)
	}
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		return 0, 0, dir, fmt.Errorf("fstrim %s: syncfs: %w", dir, err)
	}
	if err := ctx.Err(); err != nil {
		return 0, 0, dir, fmt.Errorf("fstrim %s: %w", dir, err)
	}
	r := fstrimRange{Len: math.MaxUint64}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fitrim, uintptr(unsafe.Pointer(&r))); errno != 0 {
		return 0, 0, dir, fmt.Errorf("fstrim %s: FITRIM: %w", dir, errno)
	}
	if err := unix.Fstatfs(int(f.Fd()), &sfs); err != nil {
		return r.Len, 0, dir, fmt.Errorf("fstrim %s: statfs: %w", dir, err)
	}
	return r.Len, int64(sfs.Blocks-sfs.Bfree) * sfs.Bsize, dir, nil
}

// reallocate makes a thick volume's backing file (the open fd, which the
// caller closes; v names it) fully allocated again, over the file's own
// size: the record's may differ (stale, hostile, an expansion cut short),
// and the file's size is the device's, which re-allocation never changes
// (FALLOC_FL_KEEP_SIZE). fallocate allocates only the holes and never
// changes data (a hole reads as zeroes, and so does the unwritten extent
// that replaces it), so it is safe while the volume is attached and
// mounted. What is missing must fit in what the store's filesystem has
// free, which other volumes share (roomFor): otherwise ErrNoSpace, and
// nothing is allocated. Only a file that had holes filled is synced, so a
// boot over many intact thick volumes pays one fallocate each and no
// journal commits. before and after are the bytes the file held.
func (s *Store) reallocate(v *Volume, fd int) (before, after int64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, 0, fmt.Errorf("re-allocate: %w", err)
	}
	before, after = st.Blocks*512, st.Blocks*512
	// Blocks count the filesystem's extent tree too: a file whose blocks
	// cover its size may still have a hole that small, so fallocate runs
	// whatever they say.
	if missing := st.Size - before; missing > 0 {
		if err := s.roomFor(missing, "the holes of "+v.Name+"'s backing file"); err != nil {
			return before, after, fmt.Errorf("re-allocate: %w", err)
		}
	}
	if err := unix.Fallocate(fd, unix.FALLOC_FL_KEEP_SIZE, 0, st.Size); err != nil {
		return before, after, s.inStore(fmt.Errorf("re-allocate: fallocate: %w", err))
	}
	if err := unix.Fstat(fd, &st); err != nil {
		return before, after, fmt.Errorf("re-allocate: %w", err)
	}
	if after = st.Blocks * 512; after == before {
		return before, after, nil
	}
	if err := unix.Fsync(fd); err != nil {
		return before, after, fmt.Errorf("re-allocate: fsync: %w", err)
	}
	return before, after, nil
}

// keepThick re-allocates a thick volume before it is bound, so holes that
// discards punched while it was last attached (an fstrim timer, a discard
// mount) cannot survive a reboot. The caller holds v's lock; fd is its
// backing file, which the caller closes. A failure (no room for the holes
// on the store's filesystem among them) is logged, not fatal: the
// volume's data is intact either way.
func (s *Store) keepThick(v *Volume, fd int) {
	if !v.Preallocate {
		return
	}
	before, after, err := s.reallocate(v, fd)
	if err != nil {
		s.log.Warn("thick volume could not be re-allocated", "volume", v.Name, "err", err)
		return
	}
	if after != before {
		s.log.Warn("thick volume had lost allocation to discards; re-allocated", "volume", v.Name,
			"before", before, "after", after)
	}
}
