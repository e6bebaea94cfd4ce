package csi

import (
	"errors"
	"fmt"
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
// kubelet directory, shorter than PATH_MAX, and no existing component a
// symbolic link, so that what is mounted, unmounted or removed there is
// where it is named and mountinfo spells it the same way. A violation is
// ErrInvalid.
//
// Components that do not exist yet are not checked here: openNodePath
// makes them, and it walks the whole path again, without following a
// link, to the fd that is mounted on or bound from: parts of the kubelet
// directory are writable by pods (emptyDir volumes), so what this check
// saw may be swapped before the mount.
func checkNodePath(kubeletDir, field, p string) error {
	switch {
	case len(p) >= unix.PathMax:
		return fmt.Errorf("%s %s is %d bytes long, longer than a path can be: %w", field, volume.Quote(p), len(p), volume.ErrInvalid)
	case !filepath.IsAbs(p):
		return fmt.Errorf("%s %s is not an absolute path: %w", field, volume.Quote(p), volume.ErrInvalid)
	case filepath.Clean(p) != p:
		return fmt.Errorf("%s %s is not a clean path (want %s): %w", field, volume.Quote(p), volume.Quote(filepath.Clean(p)), volume.ErrInvalid)
	case !strings.HasPrefix(p, strings.TrimSuffix(kubeletDir, "/")+"/"):
		return fmt.Errorf("%s %s is not below the kubelet directory %s: %w", field, volume.Quote(p), kubeletDir, volume.ErrInvalid)
	}
	if err := noSymlinks(p); err != nil {
		return fmt.Errorf("%s %s: %w", field, volume.Quote(p), err)
	}
	return nil
}

// CheckDir is the rule for a directory the plugin is given at start (the
// kubelet directory, udev's directories): an absolute, clean path, no
// existing component of it a symbolic link and none but the last one not
// a directory, so that what the plugin reads and writes below it is where
// it was named. Components that do not exist yet are not checked. A
// violation is ErrInvalid.
func CheckDir(p string) error {
	if !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return fmt.Errorf("%s is not an absolute, clean path: %w", volume.Quote(p), volume.ErrInvalid)
	}
	return noSymlinks(p)
}

// noSymlinks checks the existing part of the absolute, clean path p and
// fails (ErrInvalid) where a component of it is a symbolic link or one
// that is not the last is not a directory. The kernel checks each
// component in one lookup that follows no link (openNoLinks); where p
// does not exist, its deepest existing directory is checked so
// (openAncestor).
func noSymlinks(p string) error {
	fd, err := openNoLinks(p, 0)
	if err == nil {
		unix.Close(fd)
		return nil
	}
	if !errors.Is(err, unix.ENOENT) {
		return noLinkError(p, err)
	}
	fd, _, err = openAncestor(components(filepath.Dir(p)))
	if err != nil {
		return err
	}
	unix.Close(fd)
	return nil
}
