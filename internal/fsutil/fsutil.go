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
// same directory renamed over path, flushing as flush says.
func ReplaceFile(path string, data []byte, perm os.FileMode, flush Flush) error {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // no-op after a successful rename
	if _, err = tmp.Write(data); err == nil && flush == FlushAll {
		err = tmp.Sync()
	}
	if err == nil {
		err = tmp.Chmod(perm)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	switch {
	case err != nil:
	case flush == FlushAll:
		err = SyncDir(dir)
	case flush == FlushOnce:
		err = tmp.Sync() // the same inode, now named path
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
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
