package csi

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// pathEnd says what openNodePath makes of a node path's last component.
type pathEnd int

const (
	existing pathEnd = iota // what is there: a directory or a file, made by nobody
	makeDir                 // a directory, made if missing
	makeFile                // a regular file, made empty if missing
)

// openNodePath opens the node path p (checkNodePath's rules hold for it)
// with O_PATH, without following any link: its deepest existing
// directory in one lookup that follows none (openAncestor), then each
// name below it in the directory opened before. What is mounted on the
// fd, or bound from it, is what the lookup saw, whatever is renamed or
// swapped for a link meanwhile. Missing directories above the end are
// made (mode 0750) unless end is existing. The caller closes the fd.
//
// A link or a non-directory on the way, or at the end anything but what
// end asks (a file where a directory is made, a FIFO or device node
// where a regular file is), is ErrInvalid and left as it is: nothing
// found there is opened for I/O.
func openNodePath(p string, end pathEnd) (int, error) {
	parts := components(p)
	dir, i, err := openAncestor(parts[:len(parts)-1])
	if err != nil {
		return -1, err
	}
	if i < len(parts)-1 && end == existing {
		unix.Close(dir)
		return -1, fmt.Errorf("%s: %w", "/"+strings.Join(parts[:i+1], "/"), unix.ENOENT)
	}
	for ; i < len(parts); i++ {
		c := parts[i]
		var fd int
		switch {
		case i < len(parts)-1 || end == makeDir:
			fd, err = openDirAt(dir, c, true)
		case end == makeFile:
			fd, err = openFileAt(dir, c)
		default:
			fd, err = unix.Openat(dir, c, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err == nil {
				fd, err = fsutil.CheckFD(fd, notLink)
			}
		}
		unix.Close(dir)
		if err != nil {
			return -1, noLinkError("/"+strings.Join(parts[:i+1], "/"), err)
		}
		dir = fd
	}
	if nodePathRace != nil {
		nodePathRace(p)
	}
	return dir, nil
}

// components splits the absolute, clean path p into its names ("/" has
// none).
func components(p string) []string {
	if p == "/" {
		return nil
	}
	return strings.Split(strings.TrimPrefix(p, "/"), "/")
}

// openNoLinks opens the absolute path p with O_PATH (and flags) in one
// lookup in which the kernel follows no link, at any component, the last
// included (openat2, RESOLVE_NO_SYMLINKS): a link on the way is ELOOP.
// The caller closes the fd.
func openNoLinks(p string, flags int) (int, error) {
	return unix.Openat2(unix.AT_FDCWD, p, &unix.OpenHow{
		Flags:   uint64(unix.O_PATH | unix.O_CLOEXEC | flags),
		Resolve: unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
}

// openAncestor opens, as openNoLinks does, the deepest directory that
// exists among "/" and the paths /parts[0]/…/parts[n-1], trying the
// longest first, and returns it with n: the names below it, parts[n:],
// did not exist when it looked. A link or a non-directory on the way is
// ErrInvalid. The caller closes the fd.
func openAncestor(parts []string) (fd, n int, err error) {
	for n = len(parts); n >= 0; n-- {
		p := "/" + strings.Join(parts[:n], "/")
		fd, err = openNoLinks(p, unix.O_DIRECTORY)
		if err == nil {
			return fd, n, nil
		}
		if !errors.Is(err, unix.ENOENT) {
			return -1, 0, noLinkError(p, err)
		}
	}
	return -1, 0, fmt.Errorf("open /: %w", err)
}

// noLinkError is the error of a no-follow lookup of p that failed with
// err: ErrInvalid where a link or a non-directory was in the way.
func noLinkError(p string, err error) error {
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
		return fmt.Errorf("%s: a component is a symbolic link, or not a directory: %w", p, volume.ErrInvalid)
	}
	return fmt.Errorf("%s: %w", p, err)
}

// openNodeParent opens the directory of the node path p as openNodePath
// does (nothing made, no link followed) and returns it with p's last
// component, which the caller names in it. The caller closes the fd.
func openNodeParent(p string) (parent int, base string, err error) {
	parent, err = openNodePath(filepath.Dir(p), existing)
	if err != nil {
		return -1, "", err
	}
	return parent, filepath.Base(p), nil
}

// nodePathRace, when a test sets it, runs once a node path was walked,
// before anything is done on its fd, and before each unmount: where
// whoever can write below the kubelet directory (a pod, in its emptyDir)
// would swap a component.
var nodePathRace func(path string)

// openDirAt opens the directory name in dir, making it first if mk.
func openDirAt(dir int, name string, mk bool) (int, error) {
	if mk {
		if err := unix.Mkdirat(dir, name, 0o750); err != nil && !errors.Is(err, unix.EEXIST) {
			return -1, fmt.Errorf("mkdir: %w", err)
		}
	}
	return unix.Openat(dir, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
}

// openFileAt opens the regular file name in dir, made empty (0600) if it
// is missing; the existing file of a retried publish is used.
func openFileAt(dir int, name string) (int, error) {
	if fd, err := unix.Openat(dir, name, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_RDONLY|unix.O_CLOEXEC, 0o600); err == nil {
		unix.Close(fd)
	} else if !errors.Is(err, unix.EEXIST) {
		return -1, fmt.Errorf("create: %w", err)
	}
	fd, err := unix.Openat(dir, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	return fsutil.CheckFD(fd, func(st *unix.Stat_t) error {
		if st.Mode&unix.S_IFMT != unix.S_IFREG {
			return fmt.Errorf("not a regular file (mode %#o; remove it): %w", st.Mode, volume.ErrInvalid)
		}
		return nil
	})
}

// notLink fails (ELOOP) for a symbolic link: what an O_PATH|O_NOFOLLOW
// open of one opens. It is a CheckFD check.
func notLink(st *unix.Stat_t) error {
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return unix.ELOOP
	}
	return nil
}

// procFD is the path through which the kernel reaches what fd is open on,
// without looking a name up again.
func procFD(fd int) string { return "/proc/self/fd/" + strconv.Itoa(fd) }
