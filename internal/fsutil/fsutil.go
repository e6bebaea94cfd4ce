// Package fsutil holds the two ways sparsevol replaces files that others
// read at any moment (metadata, units, /dev links): never half-written,
// never missing.
package fsutil

import (
	"errors"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// WriteFileAtomic replaces path with data: a temporary file in the same
// directory, fsynced, renamed over path, then the directory fsynced, so a
// crash leaves either the old or the new content, never a torn file.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // no-op after a successful rename
	if _, err = tmp.Write(data); err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp.Name(), perm)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err == nil {
		err = SyncDir(dir)
	}
	return err
}

// SyncDir fsyncs a directory, making renames and removals in it durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
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
