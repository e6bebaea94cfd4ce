package volume

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/loop"
)

// A mounted filesystem is frozen (FIFREEZE) around the copy of its volume
// and always thawed (FITHAW):
//
//   - by thaw, which the caller defers;
//   - by a timer, when the freeze has lasted Options.FreezeTimeout: the
//     copy then fails (it may no longer be consistent) and leaves nothing;
//   - by a guard process, when this process dies in between, however
//     (SIGKILL, OOM, a panic): the guard, started before the freeze in a
//     session of its own, waits on a pipe from us and runs
//     `fsfreeze --unfreeze` unless we told it the thaw was done. The pipe
//     closes when our last fd of it does, that is when we exit. It thaws
//     the mount point we opened and proved, a copy of our descriptor it
//     inherits, never the path looked up again.
//
// The kernel never thaws by itself: a filesystem left frozen blocks every
// writer until someone thaws it.
//
// The guard dies with us where we are the first process of a PID
// namespace (the plugin in its container): the kernel kills every other
// process of the namespace then. For that, the store notes each freeze in
// its lock directory (frozen-<uuid>) from before FIFREEZE until the thaw
// is done, and ThawLeftovers, which the plugin runs at its start, thaws
// what a note names and a dead process left frozen.

// guardScript is the guard's program (sh -c): fd 3 is the mount point
// freeze opened and proved; fsfreeze inherits it, and /proc/self/fd/3
// names the directory of its own fd 3, not a path looked up again. $1 is
// the freeze note ("" for none), removed once the thaw worked. It
// ignores the signals a terminal sends the process group.
const guardScript = `trap '' INT TERM HUP QUIT; read -r x; [ "$x" = done ] || { fsfreeze --unfreeze /proc/self/fd/3 && { [ -z "$1" ] || rm -f -- "$1"; }; }`

// The freeze ioctls, _IOWR('X', 119, int) and _IOWR('X', 120, int).
const (
	ioctlFIFREEZE = 0xc0045877
	ioctlFITHAW   = 0xc0045878
)

// frozen is a filesystem this process froze. thaw is safe to call more
// than once and from the timer's goroutine.
type frozen struct {
	path    string
	note    string // the freeze note the guard removes after its thaw
	fd      int    // the mount point, opened and proven to be the device's fs
	guard   *exec.Cmd
	guardW  *os.File
	timer   *time.Timer
	since   time.Time
	once    sync.Once
	err     error
	expired bool // thawed by the timer, before the caller's thaw
	mu      sync.Mutex
	held    time.Duration
}

// freeze freezes the filesystem mounted at the first of mounts proven to
// be the filesystem of the block device devnum (the volume's data
// device; openMountIn): the directory's st_dev must be that device. It gives up with an
// error if FIFREEZE does not return within timeout, and thaws by itself
// when the freeze has lasted timeout. note, if not "", is the freeze
// note's path, which the guard removes after a thaw of its own. The
// caller calls thaw.
func freeze(mounts []string, devnum uint64, timeout time.Duration, note string) (*frozen, error) {
	fd, mountpoint, err := openMountIn(mounts, devnum)
	if err != nil {
		return nil, fmt.Errorf("freeze: %w", err)
	}
	f := &frozen{path: mountpoint, fd: fd, note: note}
	if err := f.startGuard(); err != nil {
		unix.Close(fd)
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- unix.IoctlSetInt(fd, ioctlFIFREEZE, 0) }()
	select {
	case err = <-done:
	case <-time.After(timeout):
		// Still freezing when it returns: the guard thaws once we are gone,
		// and a late success is thawed here. A late failure froze nothing
		// of ours, so the guard is dismissed without a thaw.
		go func() {
			if <-done == nil {
				f.thaw()
			} else {
				f.release(true)
			}
		}()
		return nil, fmt.Errorf("freeze %s: FIFREEZE did not return within %s: %w", mountpoint, timeout, ErrBusy)
	}
	if err != nil {
		// Nothing was frozen by us (EBUSY: someone else holds a freeze,
		// which is theirs to thaw): the guard must not thaw it.
		f.release(true)
		if errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("freeze %s: someone else froze it (a backup hook, `fsfreeze --freeze`); "+
				"retry once they thaw it (`fsfreeze --unfreeze %s`): %w: %w", mountpoint, mountpoint, ErrBusy, err)
		}
		return nil, fmt.Errorf("freeze %s: %w", mountpoint, err)
	}
	f.since = time.Now()
	f.timer = time.AfterFunc(timeout, func() {
		f.mu.Lock()
		f.expired = true
		f.mu.Unlock()
		f.thaw()
	})
	return f, nil
}

// openMountIn opens the first of mounts (a volume's mount points, as the
// mount table gave them) that openMountOf proves the filesystem of the
// block device devnum, and returns its fd and path: a mount point covered
// by another mount since, or swapped, is passed over for the next. None:
// the first one's error (ErrUnsafe where it was swapped). The caller
// closes the fd.
func openMountIn(mounts []string, devnum uint64) (fd int, at string, err error) {
	var first error
	for _, m := range mounts {
		fd, err := openMountOf(m, devnum)
		if err == nil {
			return fd, m, nil
		}
		if first == nil {
			first = fmt.Errorf("%s: %w", m, err)
		}
	}
	if first == nil {
		first = fmt.Errorf("no mount point: %w", ErrNotMounted)
	}
	return -1, "", first
}

// openMountOf opens the directory mountpoint (a mount point the mount
// table gave for the volume) without following a link, and proves it is
// the filesystem of the block device devnum: its st_dev. What is there
// otherwise (swapped since the table was read) is ErrUnsafe. The caller
// closes the fd.
func openMountOf(mountpoint string, devnum uint64) (int, error) {
	fd, err := unix.Open(mountpoint, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
		return -1, fmt.Errorf("it is not a directory any more (a link?): %w", ErrUnsafe)
	}
	if err != nil {
		return -1, err
	}
	return fsutil.CheckFD(fd, func(st *unix.Stat_t) error {
		if st.Dev != devnum {
			return fmt.Errorf("it is not the volume's filesystem any more (device %d:%d, want %d:%d): %w",
				unix.Major(st.Dev), unix.Minor(st.Dev), unix.Major(devnum), unix.Minor(devnum), ErrUnsafe)
		}
		return nil
	})
}

// startGuard starts the thaw-on-exit guard (see above). The guard gets
// its own copy of f.fd as its fd 3, which it holds until it exits; f.fd
// stays f's.
func (f *frozen) startGuard() error {
	mnt, err := unix.FcntlInt(uintptr(f.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("freeze %s: guard: %w", f.path, err)
	}
	mntFile := os.NewFile(uintptr(mnt), f.path)
	defer mntFile.Close() // the guard holds its copy
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("freeze %s: guard: %w", f.path, err)
	}
	cmd := exec.Command("sh", "-c", guardScript, "sparsevol-thaw-guard", f.note)
	cmd.Stdin = r
	cmd.ExtraFiles = []*os.File{mntFile} // fd 3
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		r.Close()
		w.Close()
		return fmt.Errorf("freeze %s: start guard: %w", f.path, err)
	}
	r.Close() // the guard holds its end; ours would keep the pipe open
	f.guard, f.guardW = cmd, w
	return nil
}

// thaw thaws the filesystem (once), dismisses the guard and returns the
// error of FITHAW, or one saying the freeze had lasted too long and was
// ended by the timer: the copy made under it may not be consistent.
func (f *frozen) thaw() error {
	f.once.Do(func() {
		if f.timer != nil {
			f.timer.Stop()
		}
		f.mu.Lock()
		f.held = time.Since(f.since)
		f.mu.Unlock()
		err := unix.IoctlSetInt(f.fd, ioctlFITHAW, 0)
		if err != nil {
			f.err = fmt.Errorf("thaw %s: %w", f.path, err)
		}
		f.release(err == nil)
	})
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err == nil && f.expired {
		return fmt.Errorf("the filesystem at %s stayed frozen beyond the freeze timeout and was thawed before the copy ended: %w", f.path, ErrBusy)
	}
	return f.err
}

// thawed reports whether thaw, called before, thawed the filesystem
// (FITHAW succeeded, from thaw or the timer).
func (f *frozen) thawed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err == nil
}

// release dismisses the guard and closes the mount point. noThaw tells
// the guard that nothing is left for it to thaw: the thaw is done, or
// FIFREEZE failed and froze nothing of ours. Without it the guard runs
// fsfreeze --unfreeze (a FITHAW that failed, tried once more).
func (f *frozen) release(noThaw bool) {
	if noThaw {
		f.guardW.WriteString("done\n")
	}
	f.guardW.Close()
	f.guard.Wait()
	unix.Close(f.fd)
}

// heldFor is how long the filesystem was frozen (after thaw).
func (f *frozen) heldFor() time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.held
}

// freezeNoteName is the lock directory's note of a freeze of volume
// uuid's filesystem held by some process (see above).
func freezeNoteName(uuid string) string { return "frozen-" + uuid }

// freezeNotePath is the note's path, for the guard (sh), which has no fd.
func (s *Store) freezeNotePath(uuid string) string {
	return filepath.Join(s.root, lockDir, freezeNoteName(uuid))
}

// noteFreeze writes volume uuid's freeze note; the caller holds its lock.
func (s *Store) noteFreeze(uuid string) error {
	dir, err := s.lockDirFD()
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	fd, err := unix.Openat(dir, freezeNoteName(uuid), unix.O_CREAT|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("note the freeze of %s: %w", uuid, err)
	}
	return unix.Close(fd)
}

// clearFreezeNote removes volume uuid's freeze note, if there is one.
func (s *Store) clearFreezeNote(uuid string) {
	dir, err := s.lockDirFD()
	if err != nil {
		return
	}
	defer unix.Close(dir)
	unix.Unlinkat(dir, freezeNoteName(uuid), 0)
}

// ThawLeftovers thaws the filesystems that a process killed while it
// held a snapshot's freeze left frozen (their notes, see above), and
// removes the notes. Each volume's lock is tried first, without waiting:
// a note whose volume is locked belongs to a live process (a snapshot in
// progress, with its guard), whose freeze is left to it. A mount point is
// thawed only once proven the volume's filesystem (openMountOf); one that
// is not frozen any more is no error. A filesystem unmounted while frozen
// is thawed through a private mount of the volume's device
// (thawUnmounted).
func (s *Store) ThawLeftovers() error {
	f, err := fsutil.OpenDir(filepath.Join(s.root, lockDir))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("thaw leftovers: %w", err)
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return fmt.Errorf("thaw leftovers: %w", err)
	}
	var errs []error
	for _, name := range names {
		uuid, ok := strings.CutPrefix(name, "frozen-")
		if !ok || !ValidUUID(uuid) {
			continue
		}
		if err := s.thawLeftover(uuid); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// thawLeftover thaws volume uuid's filesystem under its lock, if the lock
// is free and the freeze note still there, then removes the note.
func (s *Store) thawLeftover(uuid string) error {
	unlock, err := s.tryLock(uuid)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return nil // held: the holder is alive and thaws its own freeze
	}
	if err != nil {
		return err
	}
	defer unlock()
	dir, err := s.lockDirFD()
	if err != nil {
		return err
	}
	var st unix.Stat_t
	err = unix.Fstatat(dir, freezeNoteName(uuid), &st, unix.AT_SYMLINK_NOFOLLOW)
	unix.Close(dir)
	if err != nil {
		return nil // thawed and cleared meanwhile
	}
	v, err := s.readMeta(uuid)
	if errors.Is(err, ErrNewer) {
		return fmt.Errorf("thaw %s: %w", uuid, err) // the note stays for the newer binary
	}
	if err != nil {
		s.clearFreezeNote(uuid) // no volume, nothing of it mounted to thaw
		return nil
	}
	// One superblock: a thaw through any of its mounts thaws them all.
	status := s.statusOf(v)
	if !status.Attached {
		s.clearFreezeNote(uuid) // no device, nothing of it frozen
		return nil
	}
	if len(status.MountPoints) == 0 {
		if err := s.thawUnmounted(v); err != nil {
			return err
		}
		s.clearFreezeNote(uuid)
		return nil
	}
	m := status.MountPoints[0]
	var dev unix.Stat_t
	if err := unix.Stat(status.DataDevice, &dev); err != nil {
		return fmt.Errorf("thaw %s: %w", v.Name, err)
	}
	fd, err := openMountOf(m, dev.Rdev)
	if err != nil {
		return fmt.Errorf("thaw %s at %s: %w", v.Name, m, err)
	}
	thawed, err := thawFD(fd)
	unix.Close(fd)
	if err != nil {
		return fmt.Errorf("thaw %s at %s: %w", v.Name, m, err)
	}
	if thawed {
		s.log.Warn("thawed a filesystem a killed snapshot left frozen", "volume", v.Name, "mount", m)
	}
	s.clearFreezeNote(uuid)
	return nil
}

// thawUnmounted thaws v's filesystem where no mount shows it; the caller
// holds v's lock. A filesystem unmounted while frozen stays frozen and
// active, holding the device, and a new mount of the device gets it
// again: v's device, proven v's and held, is mounted privately
// (tempMount), thawed through the mount's root proven on the device, and
// unmounted, which lets the filesystem go. A device nothing claims
// (loop.Busy: an active filesystem claims its device) holds nothing
// frozen and is not mounted.
func (s *Store) thawUnmounted(v *Volume) error {
	if v.Mode != ModeFilesystem {
		return nil
	}
	fd, id, ours, err := s.openOwned(v, "thaw")
	if err != nil {
		return err
	}
	unix.Close(fd)
	if len(ours) == 0 {
		return nil
	}
	held, err := loop.Hold(ours[0].Path, v.owner(id))
	if err != nil {
		return fmt.Errorf("thaw %s: %w", v.Name, err)
	}
	defer held.Close()
	if loop.Busy(held.Device.Path) == nil {
		return nil
	}
	var thawed bool
	err = s.tempMount(v, held.Device, "", func(root int) (err error) {
		thawed, err = thawFD(root)
		return err
	})
	if err != nil {
		return fmt.Errorf("thaw %s through a private mount of %s (see what else holds the device with `sparsevol status %s`; the plugin tries again at its next start): %w",
			v.Name, held.Device.Path, v.Name, err)
	}
	if thawed {
		s.log.Warn("thawed a filesystem a killed snapshot left frozen and that was unmounted since", "volume", v.Name, "device", held.Device.Path)
	}
	return nil
}

// thawFD thaws the filesystem of fd (FITHAW), a descriptor the caller
// proved on the volume's filesystem and keeps; thawed says it was
// frozen. One not frozen (EINVAL) is no error.
func thawFD(fd int) (thawed bool, err error) {
	err = unix.IoctlSetInt(fd, ioctlFITHAW, 0)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.EINVAL):
		return false, nil
	}
	return false, fmt.Errorf("FITHAW: %w", err)
}

// refuseFrozen returns ErrBusy, naming the mount point and how to thaw
// it, where v's filesystem on dev (v's device, proven by the caller, who
// holds v's lock) is mounted and someone froze it (FIFREEZE: `fsfreeze
// --freeze`, a backup hook): growing a frozen filesystem waits in the
// kernel, unkillable and with v's lock held, until it is thawed. The
// mount point is one proven on dev (openMountIn), asked by
// refuseFrozenAt. Where it cannot tell (no mount point proven, no
// fspick), nothing is refused, and a freeze after the check still holds
// the grow until the thaw.
func refuseFrozen(v *Volume, dev *loop.Device) error {
	if v.Mode != ModeFilesystem {
		return nil
	}
	mounts, err := loop.MountPoints(dev.Path)
	if err != nil || len(mounts) == 0 {
		return nil
	}
	devnum, err := dev.DevT()
	if err != nil {
		return nil
	}
	fd, at, err := openMountIn(mounts, devnum)
	if err != nil {
		return nil
	}
	defer unix.Close(fd)
	if err := refuseFrozenAt(fd, at, "growing it would wait until it is thawed"); err != nil {
		return fmt.Errorf("%s: %w", v.Name, err)
	}
	return nil
}

// refuseFrozenAt returns ErrBusy, naming the mount point at and how to
// thaw it, where the filesystem of fd (its mount point at, opened and
// proven by the caller, who keeps fd) is frozen; why says what the
// caller's operation would do to a frozen filesystem. The kernel tells a
// frozen filesystem by refusing to reconfigure it (EBUSY); an empty
// reconfigure changes nothing of one that is not frozen. Where it cannot
// tell (no fspick), nothing is refused.
func refuseFrozenAt(fd int, at, why string) error {
	fc, err := unix.Fspick(fd, "", unix.FSPICK_EMPTY_PATH|unix.FSPICK_CLOEXEC)
	if err != nil {
		return nil
	}
	defer unix.Close(fc)
	if err := unix.FsconfigReconfigure(fc); errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("the filesystem at %s is frozen (someone's `fsfreeze --freeze`, a backup hook), and %s; "+
			"retry once they thaw it (`fsfreeze --unfreeze %s`): %w", at, why, at, ErrBusy)
	}
	return nil
}
