package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// ExpandOptions choose how far Expand goes.
type ExpandOptions struct {
	// FileOnly grows the backing file (and the loop device if attached)
	// but leaves partition and filesystem to a later GrowFilesystem, as
	// the CSI controller/node split wants.
	FileOnly bool
}

// Expand grows a volume to newSize (rounded up to a MiB): file, then
// LOOP_SET_CAPACITY, then the partition of a partitioned block volume, then
// the filesystem (online where mounted, through a private temporary mount
// otherwise). Shrinking is refused. Each step is idempotent, and the target
// is recorded before the first, so a rerun after a crash finishes it. If
// growing the file fails and leaves it as it was, nothing stays pending;
// after a later step fails, the expansion is pending (Status says
// expanding) until a rerun finishes it or AbandonExpand takes it back. A
// mounted filesystem someone froze is refused (refuseFrozen) before
// anything is recorded, unless FileOnly.
func (s *Store) Expand(ctx context.Context, ref string, newSize int64, opts ExpandOptions) (*Volume, error) {
	if err := checkSize(newSize); err != nil {
		return nil, fmt.Errorf("expand %s: %w", Quote(ref), err)
	}
	newSize = RoundUpMiB(newSize)
	var out *Volume
	err := s.withVolume(ref, func(v *Volume) error {
		if v.State != StateReady {
			return fmt.Errorf("expand %s: state %s: %w", v.Name, v.State, ErrNotReady)
		}
		// Prove the file and its devices the volume's before anything is
		// recorded or grown: a refused expand changes nothing.
		fd, _, devs, err := s.openOwned(v, "expand")
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if !opts.FileOnly && len(devs) > 0 {
			if err := refuseFrozen(v, devs[0]); err != nil {
				return fmt.Errorf("expand %w", err)
			}
		}
		switch {
		case v.ExpandingTo != 0 && newSize == v.ExpandingTo:
			// Resume an interrupted expansion.
		case newSize < v.SizeBytes:
			return fmt.Errorf("expand %s: %s is smaller than the current %s; volumes only grow: %w",
				v.Name, FormatSize(newSize), FormatSize(v.SizeBytes), ErrInvalid)
		case v.ExpandingTo != 0 && newSize < v.ExpandingTo:
			// The file may already have that size: a smaller target would
			// record less than what is on disk.
			return fmt.Errorf("expand %s: an expansion to %s is pending; finish it first with --size %s, or abandon it with --abandon: %w",
				v.Name, FormatSize(v.ExpandingTo), FormatSize(v.ExpandingTo), ErrInvalid)
		case newSize == v.SizeBytes && v.ExpandingTo == 0:
			if opts.FileOnly {
				out = v
				return nil
			}
			// Same size: still make sure device and filesystem caught up.
		default:
			// Check and record under the store lock, as create does, so
			// that a concurrent create cannot promise the same space.
			// Order volume lock, then store lock: create never takes a
			// volume lock while holding the store lock.
			unlock, err := s.lock(storeLock)
			if err != nil {
				return err
			}
			delta := newSize - max(v.SizeBytes, v.ExpandingTo)
			err = s.checkSpace(delta, v.Preallocate)
			if err == nil {
				err = s.roomFor(growthMetadata(v, delta), "the new metadata of "+v.Name+"'s filesystem")
			}
			if err == nil {
				v.ExpandingTo = newSize
				err = s.writeMeta(v)
			}
			unlock()
			if err != nil {
				return fmt.Errorf("expand %s: %w", v.Name, err)
			}
		}
		crashPoint("expand:recorded")
		target := max(newSize, v.SizeBytes)
		err = sizeBacking(fd, target, v.Preallocate)
		if err == nil {
			err = unix.Fsync(fd) // the size, before a device or filesystem relies on it
		}
		if err != nil {
			return s.fileNotGrown(v, fmt.Errorf("expand %s: %w", v.Name, s.inStore(err)))
		}
		crashPoint("expand:file")
		// The partition table and filesystem grow in the backing file.
		if err := s.growDevice(ctx, v, opts.FileOnly); err != nil {
			return s.inStore(err)
		}
		crashPoint("expand:grown")
		v.SizeBytes, v.ExpandingTo = target, 0
		if err := s.writeMeta(v); err != nil {
			return err
		}
		s.log.Info("volume expanded", "volume", v.Name, "uuid", v.UUID, "size", v.SizeBytes)
		out = v
		return nil
	})
	return out, err
}

// growthMetadata bounds what growing v's filesystem by delta bytes
// writes into the holes of a thin backing file: ext4's new group
// descriptors, their backups and bitmaps (docs/design.md, "A full
// store"). resize2fs that finds no room for them midway leaves a
// filesystem e2fsck must repair, so the room is proven before anything
// grows. A thick file has its room already (checkSpace); XFS grows its
// new allocation groups in one transaction that fails whole.
func growthMetadata(v *Volume, delta int64) int64 {
	if v.Preallocate || v.FSType != "ext4" {
		return 0
	}
	return 16<<20 + delta/1024
}

// fileNotGrown is called, under v's lock, when growing v's backing file
// failed with cause: if the file is no larger than v's size, nothing
// changed, and the target recorded for it goes again (a target that can
// never be reached would otherwise hold its space and block every other
// expansion). A file grown in part keeps the expansion pending.
func (s *Store) fileNotGrown(v *Volume, cause error) error {
	if v.ExpandingTo == 0 {
		return cause
	}
	st, err := s.statBacking(v.UUID)
	if err != nil || st.Size > v.SizeBytes {
		return cause
	}
	v.ExpandingTo = 0
	if err := s.writeMeta(v); err != nil {
		return errors.Join(cause, err)
	}
	return cause
}

// AbandonExpand takes back a pending expansion: the backing file goes back
// to the volume's recorded size and nothing is pending any more. Only
// while nothing beyond that size can be in use: no loop device has grown,
// no partition table or filesystem reaches beyond it. Otherwise it refuses
// with ErrBusy, changing nothing: the expansion must be finished. With no
// expansion pending it is ErrInvalid.
func (s *Store) AbandonExpand(ref string) (*Volume, error) {
	var out *Volume
	err := s.withVolume(ref, func(v *Volume) error {
		if v.State != StateReady {
			return fmt.Errorf("abandon expansion of %s: state %s: %w", v.Name, v.State, ErrNotReady)
		}
		if v.ExpandingTo == 0 {
			return fmt.Errorf("abandon expansion of %s: no expansion is pending: %w", v.Name, ErrInvalid)
		}
		s.cleanupTempMount(v) // ours, left by an expansion that crashed
		fd, id, err := s.openBacking(v.UUID, unix.O_RDWR)
		if err != nil {
			return fmt.Errorf("abandon expansion of %s: %w", v.Name, err)
		}
		defer unix.Close(fd)
		if err := s.usedBeyond(v, fd, id); err != nil {
			return fmt.Errorf("abandon expansion of %s to %s (finish it instead: `sparsevol expand %s --size %s`): %w",
				v.Name, FormatSize(v.ExpandingTo), v.UUID, FormatSize(v.ExpandingTo), err)
		}
		if err := shrinkBacking(fd, v.SizeBytes); err != nil {
			return fmt.Errorf("abandon expansion of %s: %w", v.Name, err)
		}
		crashPoint("abandon:file")
		v.ExpandingTo = 0
		if err := s.writeMeta(v); err != nil {
			return err
		}
		s.log.Info("expansion abandoned", "volume", v.Name, "uuid", v.UUID, "size", v.SizeBytes)
		out = v
		return nil
	})
	return out, err
}

// usedBeyond returns an error if anything may use v's open backing file fd
// (identity id) beyond v.SizeBytes: a loop device someone else bound to
// it (ErrUnsafe), one of ours with a larger capacity, or a partition table
// or filesystem in the file that reaches further (read from the file
// itself: no device shows more of it) (ErrBusy).
func (s *Store) usedBeyond(v *Volume, fd int, id loop.FileID) error {
	bound, err := loop.Bound(id)
	if err != nil {
		return err
	}
	ours, foreign := s.devicesOf(v, []loop.FileID{id}, id, bound)
	if len(foreign) > 0 {
		return s.foreignError("abandon the expansion of", v, id, foreign)
	}
	for _, d := range ours {
		size, err := loop.Size(d.Path)
		if err != nil {
			return err
		}
		if int64(size) > v.SizeBytes {
			return fmt.Errorf("%s has grown to %s already: %w", d.Path, FormatSize(int64(size)), ErrBusy)
		}
	}
	what, end, err := contentEnd(v, fd)
	if err != nil {
		return fmt.Errorf("cannot tell how far %s reaches: %w: %w", what, err, ErrBusy)
	}
	if end > v.SizeBytes {
		return fmt.Errorf("%s has grown to %s already: %w", what, FormatSize(end), ErrBusy)
	}
	return nil
}

// shrinkBacking cuts the open backing file fd back to size, which Expand
// had grown; a file no larger is left alone.
func shrinkBacking(fd int, size int64) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("shrink backing file: %w", err)
	}
	if st.Size <= size {
		return nil
	}
	err := unix.Ftruncate(fd, size)
	if err == nil {
		err = unix.Fsync(fd)
	}
	if err != nil {
		return fmt.Errorf("shrink backing file to %d: %w", size, err)
	}
	return nil
}

// GrowFilesystem brings the volume's device, partition and filesystem up to
// the size of its backing file (the node half of a CSI expansion): online
// where the filesystem is mounted, else through a device of its own that it
// detaches again. A mounted filesystem someone froze is refused
// (refuseFrozen) before the device grows.
func (s *Store) GrowFilesystem(ctx context.Context, ref string) error {
	return s.withVolume(ref, func(v *Volume) error {
		return s.growDevice(ctx, v, false)
	})
}

// growDevice propagates the file size to the attached device(s), and unless
// fileOnly, to the partition and the filesystem. A detached volume is
// attached for the filesystem step and detached again.
func (s *Store) growDevice(ctx context.Context, v *Volume, fileOnly bool) error {
	// A crashed offline expansion may have left its temporary mount; it
	// must not pass for a user's mount below.
	s.cleanupTempMount(v)
	fd, id, devs, err := s.openOwned(v, "expand")
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if !fileOnly && len(devs) > 0 {
		if err := refuseFrozen(v, devs[0]); err != nil {
			return fmt.Errorf("expand %w", err)
		}
	}
	owner := v.owner(id)
	for _, d := range devs {
		if err := loop.SetCapacity(d.Path, owner); err != nil {
			return fmt.Errorf("expand %s: %w", v.Name, err)
		}
	}
	if fileOnly || (v.Mode == ModeBlock && !v.Partitioned) {
		return nil
	}
	var dev *loop.Device
	if len(devs) > 0 {
		dev = devs[0]
	} else {
		if dev, err = s.bind(v, fd); err != nil {
			return err
		}
		defer func() {
			if err := loop.Detach(dev.Path, owner); err != nil {
				s.log.Warn("detach after offline expand", "volume", v.Name, "error", err)
			} else {
				s.removeIdentity(dev)
			}
		}()
	}
	// Hold the device so its number cannot be rebound to another file
	// while sgdisk, e2fsck or resize2fs work on it by path.
	held, err := loop.Hold(dev.Path, owner)
	if err != nil {
		return fmt.Errorf("expand %s: %w", v.Name, err)
	}
	defer held.Close()
	if v.Partitioned {
		return s.growPartition(ctx, v, dev)
	}
	return s.growFS(ctx, v, held.Device)
}

// growPartition moves the GPT backup header to the new end and recreates
// partition 1 with the same start, GUID, type and name up to the end; then
// tells the kernel, where it shows partitions at all.
func (s *Store) growPartition(ctx context.Context, v *Volume, dev *loop.Device) error {
	table, err := s.readPartitionTable(ctx, dev.Path)
	if err != nil {
		return fmt.Errorf("expand %s: %w", v.Name, err)
	}
	if len(table.Partitions) != 1 {
		return fmt.Errorf("expand %s: partition table of %s is not one GPT partition", v.Name, dev.Path)
	}
	p := table.Partitions[0]
	if _, err := s.run.run(ctx, "sgdisk", "--move-second-header", dev.Path); err != nil {
		return fmt.Errorf("expand %s: %w", v.Name, err)
	}
	start := strconv.FormatInt(p.Start, 10)
	if _, err := s.run.run(ctx, "sgdisk", "--delete=1", "--new=1:"+start+":0", "--partition-guid=1:"+v.UUID,
		"--typecode=1:8300", "--change-name=1:"+partitionName, dev.Path); err != nil {
		return fmt.Errorf("expand %s: %w", v.Name, err)
	}
	if parts, _ := loop.Partitions(dev.Path); len(parts) > 0 {
		if _, err := s.run.run(ctx, "partx", "--update", "--nr", "1", dev.Path); err != nil {
			return fmt.Errorf("expand %s: %w", v.Name, err)
		}
	}
	return nil
}

// growFS grows the filesystem on dev (held and proven v's by the caller):
// online where it is mounted (resize2fs on the device for ext4; for XFS
// the grow ioctl on the mount point, opened and proven on dev by
// openMountOf, never a path a tool looks up again); offline for an
// unmounted ext4 (e2fsck, then resize2fs: no capability beyond access to
// the device needed); through a private temporary mount for an unmounted
// XFS, which only grows mounted. The tools run as every program the
// store runs: dying with the CLI.
func (s *Store) growFS(ctx context.Context, v *Volume, dev *loop.Device) error {
	device := dev.Path
	mounts, err := loop.MountPoints(device)
	if err != nil {
		return fmt.Errorf("expand %s: %w", v.Name, err)
	}
	switch {
	case v.FSType == "ext4":
		if len(mounts) == 0 {
			// e2fsck -p exits 1 when it fixed something, which is fine here.
			if out, err := s.run.run(ctx, "e2fsck", "-f", "-p", device); err != nil && exitCode(err) != 1 {
				return fmt.Errorf("expand %s: %w (%s)", v.Name, err, out)
			}
		}
		if _, err := s.run.run(ctx, "resize2fs", device); err != nil {
			return fmt.Errorf("expand %s: %w", v.Name, err)
		}
		return nil
	case v.FSType != "xfs":
		return fmt.Errorf("expand %s: sparsevol grows ext4 and xfs, not %q", v.Name, v.FSType)
	case len(mounts) > 0:
		if growMountRace != nil {
			growMountRace(mounts[0])
		}
		if err := growMountedXFS(dev, mounts); err != nil {
			return fmt.Errorf("expand %s: grow the filesystem: %w", v.Name, err)
		}
		return nil
	}
	err = s.tempMount(v, dev, "", func(fd int) error {
		crashPoint("expand:mounted")
		size, err := loop.Size(device)
		if err != nil {
			return err
		}
		return growXFSData(fd, size)
	})
	if err != nil {
		return fmt.Errorf("expand %s: %w", v.Name, err)
	}
	return nil
}

// growMountRace, when a test sets it, runs between the mount table's
// answer and the opening of the mount point it gave: where a hostile
// writer of a directory on the way would swap it.
var growMountRace func(mountpoint string)

// growMountedXFS grows the XFS filesystem on dev, mounted at mounts
// (from the mount table), to the size of dev, through a descriptor of the
// first mount point proven to be on dev (openMountIn), which it closes
// again.
func growMountedXFS(dev *loop.Device, mounts []string) error {
	devnum, err := dev.DevT()
	if err != nil {
		return err
	}
	size, err := loop.Size(dev.Path)
	if err != nil {
		return err
	}
	fd, _, err := openMountIn(mounts, devnum)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return growXFSData(fd, size)
}

// tempMount mounts v's filesystem on dev (held by the caller, who holds
// v's lock) with the mount data given, privately below the store's lock
// directory, runs fn with a descriptor of its root, proven on dev
// (openMountOf), which tempMount closes when fn returns, and unmounts it
// again. A crash leaves the mount to cleanupTempMount, which every
// operation on v runs. Nothing is mounted by a path that could be
// swapped: see mountTempRoot.
func (s *Store) tempMount(v *Volume, dev *loop.Device, data string, fn func(fd int) error) error {
	devnum, err := dev.DevT()
	if err != nil {
		return err
	}
	s.cleanupTempMount(v)
	defer s.cleanupTempMount(v)
	root, err := s.mountTempRoot(v)
	if err != nil {
		return err
	}
	defer unix.Close(root)
	// The filesystem goes on a directory of the private tmpfs: opened
	// by its name in the tmpfs root's descriptor (a lookup that enters
	// the mount), and unmounted by that name, the tmpfs left to
	// cleanupTempMount.
	fsDir := filepath.Join(s.tempMountDir(v), "fs")
	if err := unix.Mkdirat(root, "fs", 0o700); err != nil {
		return &os.PathError{Op: "mkdir", Path: fsDir, Err: err}
	}
	at, err := unix.Openat(root, "fs", unix.O_PATH|unix.O_NOFOLLOW|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: fsDir, Err: err}
	}
	err = unix.Mount(dev.Path, procFD(at), v.FSType, unix.MS_NOATIME|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, data)
	unix.Close(at)
	if err != nil {
		return fmt.Errorf("temporary mount of %s: %w", dev.Path, err)
	}
	if tempMountedRace != nil {
		tempMountedRace(fsDir)
	}
	fd, err := openMountOf(filepath.Join(procFD(root), "fs"), devnum)
	if err != nil {
		return fmt.Errorf("temporary mount of %s at %s: %w", dev.Path, fsDir, err)
	}
	err = fn(fd)
	unix.Close(fd)
	if err != nil {
		return err
	}
	if err := unix.Unmount(fsDir, unix.UMOUNT_NOFOLLOW); err != nil {
		return fmt.Errorf("unmount %s: %w", fsDir, err)
	}
	return nil
}

// tempMountRace, when a test sets it, runs between the opening of the
// temporary mount point and the mount on it: where a hostile writer of
// the lock directory would swap it.
var tempMountRace func(path string)

// tempMountedRace, when a test sets it, runs between the mount of the
// volume's filesystem on the temporary mount point and its opening.
var tempMountedRace func(dir string)

// mountTempRoot mounts a new private tmpfs at the lock directory's
// mnt-<uuid> and returns an fd of its root, which the caller closes. The
// directory is made and opened in the lock directory's proven fd without
// following links, and the tmpfs, made detached (fsopen, fsmount), is
// attached to that open directory (move_mount), never to a path looked up
// again. The path then must name the new mount (device and inode), since
// tempMount unmounts by it: a mount point cannot be renamed or removed, so
// what the check sees stays. What is not a directory, or was swapped for
// something else before the attach, is refused (ErrUnsafe) and left for
// cleanupTempMount's warning; the tmpfs is detached again.
//
// Private, so that the filesystem mounted below it does not propagate
// into other mount namespaces (kubelet's, containers').
func (s *Store) mountTempRoot(v *Volume) (int, error) {
	dir, err := s.lockDirFD()
	if err != nil {
		return -1, err
	}
	defer unix.Close(dir)
	name, path := tempMountName(v), s.tempMountDir(v)
	if err := unix.Mkdirat(dir, name, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
		return -1, &os.PathError{Op: "mkdir", Path: path, Err: err}
	}
	notDir := fmt.Errorf("temporary mount point %s is not a directory (inspect it with `ls -l %s` and remove it): %w", path, path, ErrUnsafe)
	at, err := unix.Openat(dir, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	switch {
	case errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP):
		return -1, notDir
	case err != nil:
		return -1, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(at)
	if tempMountRace != nil {
		tempMountRace(path)
	}
	root, err := newTmpfs()
	if err != nil {
		return -1, fmt.Errorf("private mount point %s: %w", path, err)
	}
	ok := false
	defer func() {
		if !ok {
			unix.Unmount(procFD(root), unix.MNT_DETACH)
			unix.Close(root)
		}
	}()
	if err := unix.MoveMount(root, "", at, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return -1, fmt.Errorf("private mount point %s: %w", path, err)
	}
	if err := unix.Mount("", procFD(root), "", unix.MS_PRIVATE, ""); err != nil {
		return -1, fmt.Errorf("private mount point %s: %w", path, err)
	}
	var want, got unix.Stat_t
	if err := unix.Fstat(root, &want); err != nil {
		return -1, fmt.Errorf("private mount point %s: %w", path, err)
	}
	if err := unix.Fstatat(dir, name, &got, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return -1, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if got.Dev != want.Dev || got.Ino != want.Ino {
		if got.Mode&unix.S_IFMT != unix.S_IFDIR {
			return -1, notDir
		}
		return -1, fmt.Errorf("temporary mount point %s was replaced while it was mounted on (inspect it with `ls -l %s` and remove it): %w", path, path, ErrUnsafe)
	}
	ok = true
	return root, nil
}

// newTmpfs makes a small tmpfs, mode 0700, not attached anywhere yet, and
// returns an fd of its root (fsmount), which the caller attaches and
// closes.
func newTmpfs() (int, error) {
	fsfd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen tmpfs: %w", err)
	}
	defer unix.Close(fsfd)
	for _, kv := range [][2]string{{"source", "sparsevol-expand"}, {"size", "64k"}, {"mode", "0700"}} {
		if err := unix.FsconfigSetString(fsfd, kv[0], kv[1]); err != nil {
			return -1, fmt.Errorf("tmpfs %s=%s: %w", kv[0], kv[1], err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("create tmpfs: %w", err)
	}
	root, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsmount tmpfs: %w", err)
	}
	return root, nil
}

func tempMountName(v *Volume) string { return "mnt-" + v.UUID }

func (s *Store) tempMountDir(v *Volume) string {
	return filepath.Join(s.root, lockDir, tempMountName(v))
}

// cleanupTempMount removes what an offline expansion mounted, including
// what a crashed one left behind; the directory is ours by its path, and
// is neither followed nor unmounted through if it is a link (or anything
// but a directory): that is left, with a warning. A lazy unmount of the
// private tmpfs takes the filesystem below it along.
func (s *Store) cleanupTempMount(v *Volume) {
	dir := s.tempMountDir(v)
	fi, err := os.Lstat(dir)
	if err != nil {
		return
	}
	if !fi.IsDir() {
		s.log.Warn("left a temporary mount point that is not a directory", "path", dir, "mode", fi.Mode().String())
		return
	}
	for range 4 {
		if err := unix.Unmount(dir, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil {
			break
		}
	}
	os.Remove(dir)
}

func exitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return -1
}
