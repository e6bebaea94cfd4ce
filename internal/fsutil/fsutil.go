// Package fsutil holds the two ways sparsevol replaces files that others
// read at any moment (metadata, units, /dev links): never half-written,
// never missing.
package fsutil

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// WriteFileAtomic replaces path with data: a temporary file in the same
// directory, fsynced, renamed over path, then the directory fsynced, so a
// crash leaves either the old or the new content, never a torn file.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	return ReplaceFile(path, data, perm, FlushAll)
}

// Flush is how much of a replacement ReplaceFile makes durable before it
// returns. Whatever it is, a killed process leaves the old or the new
// content, never a torn file: the page cache outlives the process.
type Flush int

const (
	// FlushAll fsyncs the temporary file, renames it over path and fsyncs
	// the directory: a power cut at any moment leaves the old or the new
	// content.
	FlushAll Flush = iota
	// FlushNone flushes nothing: a power cut may lose the replacement,
	// and one before the filesystem wrote the new content back may leave
	// the file empty. For records that are worth nothing until a later
	// FlushOnce or FlushAll of the same filesystem.
	FlushNone
	// FlushOnce renames the temporary file over path and then fsyncs
	// path, one flush instead of two. On ext4 and XFS, whose journal
	// commits in order, that fsync makes the data, the rename and every
	// earlier change to the filesystem's metadata durable together (other
	// files' sizes and names included); a power cut before it returns may
	// leave path empty, as with FlushNone.
	FlushOnce
)

// ReplaceFile replaces path with data through a temporary file in the
// same directory, .tmp-<name>-<digits>, renamed over path, flushing as
// flush says. A failure removes the temporary file.
func ReplaceFile(path string, data []byte, perm os.FileMode, flush Flush) error {
	dir := filepath.Dir(path)
	tmp, fd, err := createTemp(dir, ".tmp-"+filepath.Base(path)+"-")
	if err != nil {
		return err
	}
	err = writeAll(fd, tmp, data)
	if err == nil && flush == FlushAll {
		err = fsync(fd, tmp)
	}
	if err == nil {
		if err = unix.Fchmod(fd, uint32(perm.Perm())); err != nil {
			err = &os.PathError{Op: "chmod", Path: tmp, Err: err}
		}
	}
	if err == nil {
		if err = unix.Rename(tmp, path); err != nil {
			err = &os.LinkError{Op: "rename", Old: tmp, New: path, Err: err}
		}
	}
	if err != nil {
		unix.Close(fd)
		unix.Unlink(tmp)
		return err
	}
	switch flush {
	case FlushAll:
		err = SyncDir(dir)
	case FlushOnce:
		err = fsync(fd, path) // the same inode, now named path
	}
	if cerr := unix.Close(fd); err == nil && cerr != nil {
		err = &os.PathError{Op: "close", Path: path, Err: cerr}
	}
	return err
}

// NoRoom reports whether err says the filesystem had no room for what
// was asked: no block or no inode left (ENOSPC), or the quota spent
// (EDQUOT).
func NoRoom(err error) bool {
	return errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT)
}

// Overwrite writes data over the file at path in place, from its start,
// cuts it to len(data) and fsyncs it: how a file is changed where the
// filesystem has no room for ReplaceFile's temporary file (NoRoom), as
// it makes no inode, and no block where data fits in those the file
// holds. It is not atomic: a crash may leave the file torn, so it is only
// for a file whose torn form its reader settles. A final symbolic link is
// not followed, and anything but a regular file with one link is refused
// before a byte is written (errors are *os.PathError).
func Overwrite(path string, data []byte) error {
	fd, _, err := openProven(path, unix.O_NOFOLLOW, unix.O_WRONLY, func(st *unix.Stat_t) error {
		if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink != 1 {
			return &os.PathError{Op: "overwrite", Path: path, Err: errNotSoleRegular}
		}
		return nil
	})
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for off := 0; off < len(data); {
		n, err := unix.Pwrite(fd, data[off:], int64(off))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return &os.PathError{Op: "write", Path: path, Err: err}
		}
		off += n
	}
	if err := unix.Ftruncate(fd, int64(len(data))); err != nil {
		return &os.PathError{Op: "truncate", Path: path, Err: err}
	}
	return fsync(fd, path)
}

// createTemp makes a new file prefix<digits> in dir, open for writing,
// as os.CreateTemp does, on a plain fd: metadata files need no poller.
func createTemp(dir, prefix string) (string, int, error) {
	for try := 0; ; try++ {
		name := filepath.Join(dir, prefix+strconv.FormatUint(uint64(rand.Uint32()), 10))
		fd, err := unix.Open(name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
		if err == nil {
			return name, fd, nil
		}
		if !errors.Is(err, unix.EEXIST) || try == 100 {
			return "", -1, &os.PathError{Op: "createtemp", Path: filepath.Join(dir, prefix+"*"), Err: err}
		}
	}
}

// writeAll writes data to fd (the file path), short writes continued.
func writeAll(fd int, path string, data []byte) error {
	for len(data) > 0 {
		n, err := unix.Write(fd, data)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return &os.PathError{Op: "write", Path: path, Err: err}
		}
		data = data[n:]
	}
	return nil
}

func fsync(fd int, path string) error {
	if err := unix.Fsync(fd); err != nil {
		return &os.PathError{Op: "sync", Path: path, Err: err}
	}
	return nil
}

// ReadRegular returns the content of the regular file path, as
// os.ReadFile does (its errors are *os.PathError), read through a plain
// fd (a regular file needs no poller). What is there is input, not
// trusted: a final symbolic link is not followed, anything but a regular
// file is refused before it is opened (openProven: opening a FIFO wakes
// its writer, a device node's open arms a watchdog or holds a loop
// device, a terminal's may make it the controlling one), and so is a
// file of more than limit bytes.
func ReadRegular(path string, limit int64) ([]byte, error) {
	return readRegular(path, limit, unix.O_NOFOLLOW, nil)
}

// ReadOwnRegular is ReadRegular for a file the caller made itself (by
// ReplaceFile) and trusts only while no one else can change it: a file
// that is not this process's effective user's, has more than one link
// (a name elsewhere to write it through), or is writable by group or
// others is refused before a byte is read (errNotOwn).
func ReadOwnRegular(path string, limit int64) ([]byte, error) {
	return readRegular(path, limit, unix.O_NOFOLLOW, func(st *unix.Stat_t) error {
		if st.Uid != uint32(os.Geteuid()) || st.Nlink != 1 || st.Mode&0o022 != 0 {
			return errNotOwn
		}
		return nil
	})
}

// ReadRegularFollowing is ReadRegular for a file an administrator may
// put in place as a symbolic link (a unit file `systemctl link` made):
// the links are followed, and what they lead to must be a regular file
// of at most limit bytes, refused before a byte is read otherwise.
func ReadRegularFollowing(path string, limit int64) ([]byte, error) {
	return readRegular(path, limit, 0, nil)
}

// readRegular is ReadRegular, with follow (0 or O_NOFOLLOW) saying
// whether a final symbolic link is followed and check, if set, what else
// the open regular file must be.
func readRegular(path string, limit int64, follow int, check func(st *unix.Stat_t) error) ([]byte, error) {
	fd, st, err := openProven(path, follow, unix.O_RDONLY, func(st *unix.Stat_t) error {
		switch {
		case st.Mode&unix.S_IFMT == unix.S_IFLNK:
			return &os.PathError{Op: "open", Path: path, Err: errSymlink}
		case st.Mode&unix.S_IFMT != unix.S_IFREG:
			return &os.PathError{Op: "read", Path: path, Err: errNotRegular}
		}
		if check != nil {
			if err := check(st); err != nil {
				return &os.PathError{Op: "read", Path: path, Err: err}
			}
		}
		if st.Size > limit {
			return &os.PathError{Op: "read", Path: path, Err: fmt.Errorf("%d bytes, more than %d", st.Size, limit)}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	data := make([]byte, 0, max(st.Size, 0)+1)
	for {
		if len(data) == cap(data) {
			if int64(len(data)) > limit {
				return nil, &os.PathError{Op: "read", Path: path, Err: fmt.Errorf("more than %d bytes", limit)}
			}
			data = append(data, 0)[:len(data)]
		}
		n, err := unix.Read(fd, data[len(data):cap(data)])
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return nil, &os.PathError{Op: "read", Path: path, Err: err}
		case n == 0:
			return data, nil
		}
		data = data[:len(data)+n]
	}
}

// openProven opens path with O_PATH (and follow: 0, or O_NOFOLLOW to
// open a final symbolic link itself), which opens nothing a device node,
// FIFO or terminal would notice, runs check on what that descriptor
// names (its errors are returned as they are), and only then opens that
// same inode with flags (O_RDONLY or O_WRONLY; O_NOCTTY and O_CLOEXEC are
// added) through /proc/self/fd: a file swapped under the name in between
// is not opened instead. It returns the fd, which the caller closes, and
// what check saw.
func openProven(path string, follow, flags int, check func(st *unix.Stat_t) error) (int, unix.Stat_t, error) {
	var st unix.Stat_t
	pfd, err := unix.Open(path, unix.O_PATH|follow|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, st, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(pfd)
	if err := unix.Fstat(pfd, &st); err != nil {
		return -1, st, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if err := check(&st); err != nil {
		return -1, st, err
	}
	fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(pfd), flags|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, st, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return fd, st, nil
}

// CreateMarker makes path an empty regular file if nothing is there, and
// leaves a regular file that is there as it is: a marker whose existence
// is all it says. Whatever is at path is input, not trusted, and never
// opened: the marker is made with O_EXCL (which follows no link), and
// what was there already is looked at through O_PATH only, so a symbolic
// link is refused (nothing is created or truncated where it points), and
// so is anything but a regular file, a FIFO without being waited on, a
// device node without being opened for writing (which would arm a
// watchdog). Errors are *os.PathError. The caller makes the directory.
func CreateMarker(path string) error {
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_NOCTTY|unix.O_CLOEXEC, 0o644)
	if errors.Is(err, unix.EEXIST) {
		pfd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return &os.PathError{Op: "open", Path: path, Err: err}
		}
		pfd, err = CheckFD(pfd, func(st *unix.Stat_t) error {
			switch st.Mode & unix.S_IFMT {
			case unix.S_IFREG:
				return nil
			case unix.S_IFLNK:
				return &os.PathError{Op: "create", Path: path, Err: errSymlink}
			}
			return &os.PathError{Op: "create", Path: path, Err: errNotRegular}
		})
		if err != nil {
			return err
		}
		unix.Close(pfd)
		return nil
	}
	if err != nil {
		return &os.PathError{Op: "create", Path: path, Err: err}
	}
	if err := unix.Close(fd); err != nil {
		return &os.PathError{Op: "close", Path: path, Err: err}
	}
	return nil
}

// ReadRegular's refusals of what is not a regular file.
var (
	errNotRegular = errors.New("not a regular file")
	// errNotSoleRegular: not a regular file, or one with more links than
	// the name it is written through.
	errNotSoleRegular = errors.New("not a regular file with one link")
	errSymlink        = errors.New("a symbolic link, not followed")
	// errNotOwn: a file someone else owns, may write, or reaches by
	// another name.
	errNotOwn = errors.New("not this user's file with one link, writable by no one else")
)

// Flock is flock(2) on fd with how (LOCK_EX, LOCK_SH, LOCK_NB ...),
// retried when a signal interrupts the wait.
func Flock(fd, how int) error {
	for {
		err := unix.Flock(fd, how)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// UnescapeOctal decodes the \NNN escapes the kernel's mount tables
// and fstab write for bytes that would break their fields (a space is
// \040), as libmount decodes them: three octal digits, their value
// modulo 256 (\457 is "/").
func UnescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 16); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// OpenDir opens the directory path for reading its entries, as os.Open
// does, through a plain fd: a directory needs no poller.
func OpenDir(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

// SyncDir fsyncs a directory, making renames and removals in it durable.
func SyncDir(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: dir, Err: err}
	}
	defer unix.Close(fd)
	return fsync(fd, dir)
}

// ReplaceSymlink points link at target, creating link's directory if
// needed. A link that does not exist yet is made directly (the common case:
// at boot, for every volume); an existing one is replaced atomically by a
// temporary link renamed over it, so readers never find it missing.
func ReplaceSymlink(target, link string) error {
	err := unix.Symlink(target, link)
	if err == nil {
		return nil
	}
	if cur, rerr := os.Readlink(link); rerr == nil && cur == target {
		return nil
	}
	tmp := link + ".tmp"
	err = unix.Symlink(target, tmp)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EEXIST) {
		if err = os.MkdirAll(filepath.Dir(link), 0o755); err == nil {
			os.Remove(tmp)
			err = unix.Symlink(target, tmp)
		}
	}
	if err == nil {
		if err = os.Rename(tmp, link); err != nil {
			os.Remove(tmp)
		}
	}
	if err != nil {
		return &os.LinkError{Op: "symlink", Old: target, New: link, Err: err}
	}
	return nil
}

// CheckFD runs check on what fd is open on (fstat) and returns fd if it
// passes. Otherwise it closes fd and returns the error: it takes fd over
// either way, and the caller closes it only after a nil error.
func CheckFD(fd int, check func(st *unix.Stat_t) error) (int, error) {
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	if err == nil {
		err = check(&st)
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}
