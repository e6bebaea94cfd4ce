// Package unixsock makes the plugin's unix sockets (CSI endpoint, kubelet
// registration).
package unixsock

import (
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
)

// Listen removes a stale socket left by a previous run (only a socket,
// never another kind of file), creates the directory, and listens on path.
func Listen(path string) (*net.UnixListener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&fs.ModeSocket == 0 {
			return nil, fmt.Errorf("listen %s: exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("listen %s: remove stale socket: %w", path, err)
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	return l, nil
}
