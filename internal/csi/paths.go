package csi

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// DefaultKubeletDir is the kubelet's root directory when none is
// configured; every path a node RPC names must lie below it.
const DefaultKubeletDir = "/var/lib/kubelet"

// checkNodePath is the one rule for the paths node RPCs are given (staging
// and target paths, volume paths): absolute, clean, strictly below the
// kubelet directory, and no existing component a symbolic link, so that
// what is mounted, unmounted or removed there is where it is named and
// mountinfo spells it the same way. A violation is ErrInvalid.
//
// Components that do not exist yet are not checked here: openNodePath
// makes them, and it walks the whole path again, without following a
// link, to the fd that is mounted on or bound from: parts of the kubelet
// directory are writable by pods (emptyDir volumes), so what this check
// saw may be swapped before the mount.
func checkNodePath(kubeletDir, field, p string) error {
	switch {
	case !filepath.IsAbs(p):
		return fmt.Errorf("%s %q is not an absolute path: %w", field, p, volume.ErrInvalid)
	case filepath.Clean(p) != p:
		return fmt.Errorf("%s %q is not a clean path (want %q): %w", field, p, filepath.Clean(p), volume.ErrInvalid)
	case !strings.HasPrefix(p, strings.TrimSuffix(kubeletDir, "/")+"/"):
		return fmt.Errorf("%s %q is not below the kubelet directory %s: %w", field, p, kubeletDir, volume.ErrInvalid)
	}
	if err := noSymlinks(p); err != nil {
		return fmt.Errorf("%s %q: %w", field, p, err)
	}
	return nil
}

// noSymlinks checks each existing component of the absolute, clean path p
// with lstat and fails (ErrInvalid) at the first symbolic link or at a
// component below a non-directory.
func noSymlinks(p string) error {
	cur := ""
	for _, c := range strings.Split(strings.TrimPrefix(p, "/"), "/") {
		if c == "" {
			continue
		}
		cur += "/" + c
		fi, err := os.Lstat(cur)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return nil
		case errors.Is(err, unix.ENOTDIR):
			return fmt.Errorf("%s is below a file that is not a directory: %w", cur, volume.ErrInvalid)
		case err != nil:
			return fmt.Errorf("lstat %s: %w", cur, err)
		case fi.Mode()&fs.ModeSymlink != 0:
			return fmt.Errorf("%s is a symbolic link: %w", cur, volume.ErrInvalid)
		}
	}
	return nil
}
