package volume

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// storeSubdirFD opens <root>/<name> as subdirFD does; kind names it in
// errors. The caller closes the fd.
func (s *Store) storeSubdirFD(name, kind string) (int, error) {
	dir, err := s.dirFD()
	if err != nil {
		return -1, err
	}
	defer unix.Close(dir)
	return s.subdirFD(dir, name, kind, filepath.Join(s.root, name))
}

// subdirFD opens the directory name in parent (an fd of the store
// directory or of one of its directories), making it if missing, and
// proves it the store's: a directory, not a link, on the store's
// filesystem, owned by root or us, private. kind and path name it in
// errors ("lock directory", "/var/lib/sparsevol/.locks"). Whatever else is
// found there is ErrUnsafe and is neither followed nor changed. The
// returned fd is O_PATH; the caller closes it.
func (s *Store) subdirFD(parent int, name, kind, path string) (int, error) {
	const flags = unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	fd, err := unix.Openat(parent, name, flags, 0)
	if errors.Is(err, unix.ENOENT) {
		if err := unix.Mkdirat(parent, name, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
			return -1, &os.PathError{Op: "mkdir", Path: path, Err: err}
		}
		fd, err = unix.Openat(parent, name, flags, 0)
	}
	if err != nil {
		// With O_DIRECTORY a symbolic link fails as ENOTDIR, not ELOOP.
		return -1, fmt.Errorf("%s %s is not a directory (a symbolic link?); inspect it with `ls -ld %s`: %w: %w", kind, path, path, err, ErrUnsafe)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Dev != s.dir.dev || (st.Uid != 0 && int(st.Uid) != os.Geteuid()) || st.Mode&0o077 != 0 {
		unix.Close(fd)
		return -1, fmt.Errorf("%s %s is not the store's own (another filesystem, owner or mode; inspect it with `ls -ld %s`): %w",
			kind, path, path, ErrUnsafe)
	}
	return fd, nil
}
