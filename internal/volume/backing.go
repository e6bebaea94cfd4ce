package volume

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// The backing file rules, in one place. A volume's backing file is always
// <root>/<uuid>: the metadata's backingFile is written for people and never
// read back as a path. It is opened relative to the store directory,
// never through a symbolic link, and only when it is a regular file with
// exactly one link on the store's own filesystem: a symlink could point at
// any file of the host, a second link would keep the data alive after a
// delete, and a mount over the name would be someone else's file.

// dirID identifies the store directory as Open found it (openPrivate).
// Backing files are looked up relative to a descriptor of it that each
// operation opens (dirFD) and closes: a Store holds no descriptor between
// calls, so it never keeps the store's filesystem from being unmounted.
type dirID struct {
	dev, ino uint64
}

// dirFD opens the store directory (O_PATH) and checks it is still the one
// Open found. The caller closes the fd.
func (s *Store) dirFD() (int, error) {
	fd, err := unix.Open(s.root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, &os.PathError{Op: "open", Path: s.root, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Dev != s.dir.dev || st.Ino != s.dir.ino {
		unix.Close(fd)
		return -1, fmt.Errorf("store %s was replaced since it was opened: %w", s.root, ErrUnsafe)
	}
	return fd, nil
}

// statBacking returns the backing file's stat without following a link.
// A missing file is an fs.ErrNotExist error; a file that breaks the rules
// is ErrUnsafe, with the stat filled in.
func (s *Store) statBacking(uuid string) (unix.Stat_t, error) {
	var st unix.Stat_t
	dir, err := s.dirFD()
	if err != nil {
		return st, err
	}
	defer unix.Close(dir)
	return s.statIn(dir, uuid, "backing file", s.backingPath(uuid))
}

// statIn is statBacking for the file name in the directory dir (the store
// directory, or its snapshot directory); kind and path name it in errors
// ("backing file", "/var/lib/sparsevol/<uuid>").
func (s *Store) statIn(dir int, name, kind, path string) (unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return st, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return st, s.checkFile(kind, path, &st)
}

// checkFile applies the rules to a stat of the file at path: a backing
// file <root>/<uuid> or a snapshot's file (kind says which).
func (s *Store) checkFile(kind, path string, st *unix.Stat_t) error {
	var why string
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFLNK:
		why = "is a symbolic link; sparsevol never follows one"
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		why = "is not a regular file"
	case st.Nlink != 1:
		why = "has " + strconv.FormatUint(uint64(st.Nlink), 10) + " links; its data would outlive a delete through the others"
	case st.Dev != s.dir.dev:
		why = "is not on the store's filesystem (something is mounted over it)"
	default:
		return nil
	}
	return fmt.Errorf("%s %s %s (inspect it with `ls -li %s`): %w", kind, path, why, path, ErrUnsafe)
}

// openBacking opens the backing file of volume uuid with flags (O_RDONLY
// or O_RDWR), after proving it follows the rules. It first opens the name
// with O_PATH|O_NOFOLLOW, which has no side effects on any kind of file,
// checks what that descriptor refers to, and only then opens that same
// inode for I/O through /proc/self/fd: a file swapped under the name in
// between cannot be opened instead. The caller owns the returned fd and
// closes it.
func (s *Store) openBacking(uuid string, flags int) (int, loop.FileID, error) {
	dir, err := s.dirFD()
	if err != nil {
		return -1, loop.FileID{}, err
	}
	defer unix.Close(dir)
	return s.openIn(dir, uuid, "backing file", s.backingPath(uuid), flags)
}

// openIn is openBacking for the file name in the directory dir (the store
// directory, or its snapshot directory); kind and path name it as for
// statIn.
func (s *Store) openIn(dir int, name, kind, path string, flags int) (int, loop.FileID, error) {
	pfd, err := unix.Openat(dir, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, loop.FileID{}, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		return -1, loop.FileID{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if err := s.checkFile(kind, path, &st); err != nil {
		return -1, loop.FileID{}, err
	}
	fd, err := unix.Open(procFD(pfd), flags|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, loop.FileID{}, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return fd, loop.FileID{Dev: st.Dev, Inode: st.Ino}, nil
}

// createBacking makes a new, empty backing file for uuid, or opens the one
// a crashed create left (openBacking's rules apply to it). The caller
// closes the fd.
func (s *Store) createBacking(uuid string) (int, loop.FileID, error) {
	dir, err := s.dirFD()
	if err != nil {
		return -1, loop.FileID{}, err
	}
	defer unix.Close(dir)
	fd, err := unix.Openat(dir, uuid, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if errors.Is(err, unix.EEXIST) {
		return s.openBacking(uuid, unix.O_RDWR)
	}
	if err != nil {
		return -1, loop.FileID{}, &os.PathError{Op: "create", Path: s.backingPath(uuid), Err: err}
	}
	id, err := loop.FileIDOfFD(fd)
	if err != nil {
		unix.Close(fd)
		return -1, loop.FileID{}, fmt.Errorf("create %s: %w", s.backingPath(uuid), err)
	}
	return fd, id, nil
}

// removeBacking unlinks <root>/<uuid>. unlinkat never follows a link: a
// symlink planted there goes, its target stays.
func (s *Store) removeBacking(uuid string) error {
	dir, err := s.dirFD()
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	if err := unix.Unlinkat(dir, uuid, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "remove", Path: s.backingPath(uuid), Err: err}
	}
	return nil
}

// sizeBacking grows the open backing file fd to size: a hole for thin
// volumes, allocated blocks (fallocate) for thick ones. It never shrinks,
// and repeating it is harmless, which crash recovery needs. It flushes
// nothing: the caller's next flush of the store makes the new size
// durable (Create's last metadata record, expand's fsync).
func sizeBacking(fd int, size int64, preallocate bool) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("size backing file: %w", err)
	}
	var err error
	switch {
	case preallocate:
		err = unix.Fallocate(fd, 0, 0, size)
	case st.Size >= size:
		return nil
	default:
		err = unix.Ftruncate(fd, size)
	}
	if err != nil {
		return fmt.Errorf("size backing file to %d: %w", size, err)
	}
	return nil
}

// allocated is what the backing file really occupies (st_blocks), 0 if it
// is missing or breaks the rules.
func (s *Store) allocated(uuid string) int64 {
	st, err := s.statBacking(uuid)
	if err != nil {
		return 0
	}
	return st.Blocks * 512
}

// procFD is the path through which the kernel reaches the object fd is
// open on, without looking a name up again.
func procFD(fd int) string { return "/proc/self/fd/" + strconv.Itoa(fd) }
