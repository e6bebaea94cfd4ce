// Package unixsock makes the plugin's unix sockets (CSI endpoint, kubelet
// registration). It is the one home of their access rule: a socket is
// 0600, or 0660 owned by a chosen group, whatever the process umask, and
// is never reachable by anyone else, not even for a moment.
package unixsock

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
)

// NoGroup, as Listen's gid, keeps the socket to its owner (0600).
const NoGroup = -1

// LookupGroup resolves a --socket-group value, a group name or a numeric
// gid, to a gid.
func LookupGroup(group string) (int, error) {
	if gid, err := strconv.Atoi(group); err == nil {
		if gid < 0 {
			return 0, fmt.Errorf("socket group %q: a gid is not negative", group)
		}
		return gid, nil
	}
	g, err := user.LookupGroup(group)
	if err != nil {
		return 0, fmt.Errorf("socket group %q: %w", group, err)
	}
	gid, err := strconv.Atoi(g.Gid)
	if err != nil {
		return 0, fmt.Errorf("socket group %q: gid %q: %w", group, g.Gid, err)
	}
	return gid, nil
}

// Listener is a socket made by Listen. Addr is its final path; Close
// removes the socket file if it is still the one Listen made.
type Listener struct {
	*net.UnixListener
	path string
	made os.FileInfo
}

// Addr returns the socket's path.
func (l *Listener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

// Close stops listening and removes the socket file, unless another
// process has replaced it meanwhile.
func (l *Listener) Close() error {
	err := l.UnixListener.Close()
	if now, statErr := os.Lstat(l.path); statErr == nil && os.SameFile(l.made, now) {
		if rmErr := os.Remove(l.path); rmErr != nil && !errors.Is(rmErr, fs.ErrNotExist) && err == nil {
			err = fmt.Errorf("remove socket %s: %w", l.path, rmErr)
		}
	}
	return err
}

// ErrInUse is the error of a socket path another process listens on.
var ErrInUse = errors.New("another plugin is listening on the socket")

// Vacant checks that path may take a new socket: nothing is there, or a
// stale socket, one that nobody listens on (a connection to it is
// refused). A socket someone listens on is ErrInUse; any other kind of
// file, a symbolic link included, or a socket whose state cannot be told
// is refused too. Nothing is changed. The socket is opened without
// following a link (O_PATH|O_NOFOLLOW) and proven a socket on that
// descriptor, and the connection goes to that descriptor (through
// /proc/self/fd), so a link swapped in after the check leads nowhere
// else.
func Vacant(path string) error {
	_, err := stale(path)
	return err
}

// stale is Vacant; it also returns the stale socket it found, nil when
// nothing is at path.
func stale(path string) (os.FileInfo, error) {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("socket %s: %w", path, err)
	case fi.Mode()&fs.ModeSocket == 0:
		return nil, fmt.Errorf("socket %s: exists and is not a socket (%s); move it away or choose another path", path, fi.Mode().Type())
	}
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err == nil {
		fd, err = fsutil.CheckFD(fd, func(st *unix.Stat_t) error {
			if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
				return errors.New("was replaced by a file that is not a socket")
			}
			if got, ok := fi.Sys().(*syscall.Stat_t); !ok || got.Dev != st.Dev || got.Ino != st.Ino {
				return errors.New("was replaced while it was checked")
			}
			return nil
		})
	}
	if err != nil {
		return nil, fmt.Errorf("socket %s: %w", path, err)
	}
	defer unix.Close(fd)
	err = connectFD(fd)
	switch {
	case errors.Is(err, unix.ECONNREFUSED):
		return fi, nil
	case err == nil, errors.Is(err, unix.EAGAIN):
		// EAGAIN: a listener with a full backlog.
		return nil, fmt.Errorf("%w %s; stop it first, or choose another path", ErrInUse, path)
	}
	return nil, fmt.Errorf("socket %s: cannot tell whether anyone listens on it: %w", path, err)
}

// connectFD connects a stream socket to the socket fd is open on (an
// O_PATH descriptor) and closes the connection at once.
func connectFD(fd int) error {
	s, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(s)
	return unix.Connect(s, &unix.SockaddrUnix{Name: "/proc/self/fd/" + strconv.Itoa(fd)})
}

// Listen makes a listening socket at path: mode 0600, or 0660 with group
// gid when gid is not NoGroup. A stale socket left by a previous run is
// removed (Vacant: only a socket nobody listens on, never a live one or
// another kind of file); the directory is created (0750) if missing.
//
// The socket is bound inside a fresh 0700 directory next to path, given
// its mode and group there, and only then renamed into place (without
// replacing anything), so it never exists at a reachable path with the
// permissions bind gave it under the process umask.
func Listen(path string, gid int) (*Listener, error) {
	old, err := stale(path)
	if err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	if old != nil {
		// Removed only while the name still leads to the socket checked.
		if now, err := os.Lstat(path); err == nil && os.SameFile(old, now) {
			if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("listen %s: remove stale socket: %w", path, err)
			}
		}
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	private, err := os.MkdirTemp(dir, ".sock-") // 0700
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	defer os.RemoveAll(private)
	tmp := filepath.Join(private, "s")
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	// The file is renamed away from tmp: Listener.Close removes it.
	ul.SetUnlinkOnClose(false)
	fail := func(err error) (*Listener, error) {
		ul.Close()
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	mode := os.FileMode(0o600)
	if gid != NoGroup {
		mode = 0o660
		if err := os.Lchown(tmp, -1, gid); err != nil {
			return fail(err)
		}
	}
	if err := os.Chmod(tmp, mode); err != nil {
		return fail(err)
	}
	made, err := os.Lstat(tmp)
	if err != nil {
		return fail(err)
	}
	if err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_NOREPLACE); err != nil {
		return fail(fmt.Errorf("move socket into place: %w", err))
	}
	return &Listener{UnixListener: ul, path: path, made: made}, nil
}
