package volume

import (
	"bufio"
	"bytes"
	"context"

	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// Adopt registers existing sparse files without rewriting any data: a file
// holding ext4 or XFS becomes a filesystem volume whose UUID is the
// filesystem UUID, a file holding a GPT with one partition becomes a
// partitioned block volume whose UUID is the partition GUID. Each file is
// moved to <root>/<uuid> by rename(2) (the same inode: nothing is copied),
// so it must lie on the store's filesystem; a file already at <root>/<uuid>
// stays where it is. If dir is not empty, every path must lie inside it;
// with no paths, every regular file in dir is a candidate.
//
// The files are an operator's pointing, so they are checked as hostile: a
// symlink, a file with more than one link, a file some loop device is
// bound to, a file in another store's directory, or a path no file can
// have (checkPathLength) is refused with ErrInvalid. A UUID the node has already (a volume or snapshot of the
// store, another store's link, a filesystem or partition of the node:
// uuidFree), or that two files of one call share, is refused with
// ErrExists. All candidates are checked before any is registered: one bad
// file rejects the whole call and nothing changes. Files already
// registered are returned as they are (adopt is idempotent), but for one
// whose record a newer sparsevol wrote: ErrNewer.
func (s *Store) Adopt(ctx context.Context, paths []string, dir string) ([]*Volume, error) {
	if dir != "" {
		abs, err := filepath.Abs(dir)
		if err != nil {
			return nil, fmt.Errorf("adopt: directory %s: %w: %w", Quote(dir), err, ErrInvalid)
		}
		if err := checkPathLength(abs); err != nil {
			return nil, fmt.Errorf("adopt: directory: %w", err)
		}
		dir = abs
		if len(paths) == 0 {
			entries, err := os.ReadDir(dir)
			if err != nil {
				return nil, fmt.Errorf("adopt: %w: %w", err, ErrInvalid)
			}
			for _, e := range entries {
				if e.Type().IsRegular() {
					paths = append(paths, filepath.Join(dir, e.Name()))
				}
			}
		}
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("adopt: no files to adopt: %w", ErrInvalid)
	}
	unlock, err := s.lock(storeLock)
	if err != nil {
		return nil, err
	}
	defer unlock()
	existing, err := s.List()
	if err != nil {
		return nil, err
	}
	byUUID := map[string]*Volume{}
	names := map[string]bool{}
	for _, v := range existing {
		byUUID[v.UUID] = v
		names[v.Name] = true
	}

	var out []*Volume
	var fresh []*candidate
	defer func() {
		for _, c := range fresh {
			c.close()
		}
	}()
	for _, p := range paths {
		if v := s.registered(p, byUUID); v != nil {
			if v.State == StateNewer {
				// A listing's stand-in: its record says why (ErrNewer).
				return nil, fmt.Errorf("adopt %s: %w", Quote(p), v.Refusal())
			}
			out = append(out, v)
			continue
		}
		c, err := s.probeForAdoption(ctx, p, dir)
		if err != nil {
			return nil, fmt.Errorf("adopt %s: %w", Quote(p), err)
		}
		fresh = append(fresh, c)
		v := c.v
		if err := s.uuidFree(v.UUID); err != nil {
			return nil, fmt.Errorf("adopt %s: %w", Quote(p), err)
		}
		if byUUID[v.UUID] != nil {
			return nil, fmt.Errorf("adopt %s: uuid %s is also another file's of this adoption: %w", Quote(p), v.UUID, ErrExists)
		}
		if names[v.Name] {
			v.Name = adoptedName(v.UUID)
		}
		if names[v.Name] {
			return nil, fmt.Errorf("adopt %s: name %s is taken: %w", Quote(p), v.Name, ErrExists)
		}
		names[v.Name], byUUID[v.UUID] = true, v
	}
	for _, c := range fresh {
		if err := s.moveIn(c); err != nil {
			return nil, err
		}
		if err := s.writeMeta(c.v); err != nil {
			return nil, err
		}
		s.log.Info("volume adopted", "volume", c.v.Name, "uuid", c.v.UUID, "from", c.path, "file", c.v.BackingFile)
		out = append(out, c.v)
	}
	return out, nil
}

// candidate is a file that passed the adoption checks, held open (O_PATH)
// so that what is moved in can be proven to be what was checked. Its
// directory is held open too: the checks and the rename both name the
// file as base in parent, never by its path again.
type candidate struct {
	v       *Volume
	path    string // absolute, as given; for messages only
	parent  int    // O_PATH fd of the file's directory, resolved once
	base    string // the file's name in parent
	fd      int    // O_PATH|O_NOFOLLOW fd of the file
	id      loop.FileID
	inStore bool // parent is the store directory and base the UUID
}

func (c *candidate) close() {
	unix.Close(c.fd)
	unix.Close(c.parent)
}

// registered returns the volume p already is: <root>/<uuid> of a volume.
func (s *Store) registered(p string, byUUID map[string]*Volume) *Volume {
	abs, err := filepath.Abs(p)
	if err != nil || filepath.Dir(abs) != s.root {
		return nil
	}
	return byUUID[filepath.Base(abs)]
}

// adoptedName names an adopted volume whose file name is no valid name,
// or a taken one.
func adoptedName(uuid string) string { return "adopted-" + uuid }

func (s *Store) probeForAdoption(ctx context.Context, path, dir string) (*candidate, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	if err := checkPathLength(abs); err != nil {
		return nil, err
	}
	if dir != "" {
		rel, err := filepath.Rel(dir, abs)
		if err != nil || rel == ".." || strings.HasPrefix(rel, "../") || filepath.IsAbs(rel) {
			return nil, fmt.Errorf("lies outside %s: %w", Shown(dir), ErrInvalid)
		}
	}
	// The directory is resolved once, following the links in the path the
	// operator gave (/var may be one), to an fd; from then on the file is
	// base in that fd: the checks, the rename and a put-back all name it
	// there, so a directory swapped for a link afterwards redirects
	// nothing.
	parentPath, base := filepath.Dir(abs), filepath.Base(abs)
	parent, err := unix.Open(parentPath, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w: %w", Shown(parentPath), err, ErrInvalid)
	}
	var pst unix.Stat_t
	if err := unix.Fstat(parent, &pst); err != nil {
		unix.Close(parent)
		return nil, fmt.Errorf("stat %s: %w", Shown(parentPath), err)
	}
	ours := pst.Dev == s.dir.dev && pst.Ino == s.dir.ino
	if !ours {
		if err := foreignStore(parent, parentPath, base); err != nil {
			unix.Close(parent)
			return nil, err
		}
	}
	// O_PATH|O_NOFOLLOW opens the name itself, whatever it is, with no
	// side effect; what it is gets checked on that descriptor.
	fd, err := unix.Openat(parent, base, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(parent)
		return nil, fmt.Errorf("open: %w: %w", err, ErrInvalid)
	}
	c := &candidate{path: abs, parent: parent, base: base, fd: fd}
	v, err := s.checkCandidate(ctx, c)
	if err != nil {
		c.close()
		return nil, err
	}
	c.v = v
	c.inStore = ours && base == v.UUID
	return c, nil
}

func (s *Store) checkCandidate(ctx context.Context, c *candidate) (*Volume, error) {
	var st unix.Stat_t
	if err := unix.Fstat(c.fd, &st); err != nil {
		return nil, fmt.Errorf("stat: %w", err)
	}
	c.id = loop.FileID{Dev: st.Dev, Inode: st.Ino}
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFLNK:
		return nil, fmt.Errorf("a symbolic link; adopt the file itself: %w", ErrInvalid)
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return nil, fmt.Errorf("not a regular file: %w", ErrInvalid)
	case st.Nlink != 1:
		return nil, fmt.Errorf("%d links; a volume's file has one (find the others with `find / -xdev -samefile %s`): %w", st.Nlink, Shown(c.path), ErrInvalid)
	case st.Dev != s.dir.dev:
		return nil, fmt.Errorf("not on the store's filesystem, and adopt moves files by rename, never copying; adopt it into a store on its own filesystem (`sparsevol --root %s adopt ...`): %w",
			Shown(filepath.Dir(c.path)), ErrInvalid)
	case st.Size < MiB || st.Size%512 != 0:
		return nil, fmt.Errorf("%d bytes, not a sparse volume: size not a multiple of 512 or below 1 MiB: %w", st.Size, ErrInvalid)
	}
	bound, err := loop.Bound(c.id)
	if err != nil {
		return nil, err
	}
	if devs := bound[c.id]; len(devs) > 0 {
		return nil, fmt.Errorf("bound to %s (tag %q); stop what uses it and detach it first (`losetup -d %s`): %w",
			devs[0].Path, devs[0].Tag, devs[0].Path, ErrInvalid)
	}
	v := &Volume{
		Name:      filepath.Base(c.path),
		SizeBytes: st.Size,
		DirectIO:  *s.opts.DirectIO,
		BlockSize: 512, // what losetup used when these files were made
		Adopted:   true,
		State:     StateReady,
		Created:   time.Unix(st.Mtim.Unix()).UTC().Truncate(time.Second),
	}
	// blkid and sfdisk read the very inode checked, through this process's
	// descriptor, not a path that could be swapped meanwhile.
	probePath := "/proc/" + strconv.Itoa(os.Getpid()) + "/fd/" + strconv.Itoa(c.fd)
	found, err := s.probe(ctx, probePath)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	switch {
	case found.Type == "ext4" || found.Type == "xfs":
		v.Mode, v.FSType, v.UUID = ModeFilesystem, found.Type, found.UUID
	case found.PTType == "gpt":
		guid, err := s.singlePartitionGUID(ctx, probePath)
		if err != nil {
			return nil, err
		}
		v.Mode, v.Partitioned, v.UUID = ModeBlock, true, guid
	default:
		return nil, fmt.Errorf("not a sparse volume: %s found, not ext4, xfs or GPT: %w", found, ErrInvalid)
	}
	if !ValidUUID(v.UUID) {
		return nil, fmt.Errorf("on-disk UUID %s is not a UUID: %w", Quote(v.UUID), ErrInvalid)
	}
	if ValidateName(v.Name) != nil {
		v.Name = adoptedName(v.UUID)
	}
	v.BackingFile = s.backingPath(v.UUID)
	return v, nil
}

// foreignStore refuses a file that belongs to another sparsevol store:
// its directory parent (an fd of dirPath, not this store's) holds the
// store's lock directory or the file's metadata.
func foreignStore(parent int, dirPath, base string) error {
	var st unix.Stat_t
	for _, mark := range []string{lockDir, base + metaExt} {
		if err := unix.Fstatat(parent, mark, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
			return fmt.Errorf("belongs to the sparsevol store %s (it has %s); manage it there with --root %s: %w",
				Shown(dirPath), mark, Shown(dirPath), ErrInvalid)
		}
	}
	return nil
}

// adoptRace, when a test sets it, runs between the adoption checks and
// the rename: where a hostile owner of the file's directory would swap
// the directory for a link. path is the file's path as given.
var adoptRace func(path string)

// moveIn renames a checked candidate from its directory's fd to
// <root>/<uuid> (unless it is there already) and proves the name now holds
// the inode that was checked, with one link, on the store's filesystem
// (fstatat on the store directory's fd, not following a link). What is
// not is put back through the same fds and refused: ErrInvalid if another
// file arrived, ErrUnsafe if the file breaks the backing file rules.
func (s *Store) moveIn(c *candidate) error {
	uuid := c.v.UUID
	dir, err := s.dirFD()
	if err != nil {
		return fmt.Errorf("adopt %s: %w", Shown(c.path), err)
	}
	defer unix.Close(dir)
	if adoptRace != nil {
		adoptRace(c.path)
	}
	if !c.inStore {
		if err := unix.Renameat2(c.parent, c.base, dir, uuid, unix.RENAME_NOREPLACE); err != nil {
			return fmt.Errorf("adopt %s: move to %s: %w", Shown(c.path), s.backingPath(uuid), err)
		}
	}
	st, err := s.statIn(dir, uuid, "backing file", s.backingPath(uuid))
	if err == nil && (loop.FileID{Dev: st.Dev, Inode: st.Ino}) != c.id {
		err = fmt.Errorf("%s was replaced while it was adopted: %w", Shown(c.path), ErrInvalid)
	}
	if err != nil {
		if !c.inStore {
			if perr := unix.Renameat2(dir, uuid, c.parent, c.base, unix.RENAME_NOREPLACE); perr != nil {
				err = fmt.Errorf("%w; putting it back failed, it is %s now: %w", err, s.backingPath(uuid), perr)
			}
		}
		return fmt.Errorf("adopt %s: %w", Shown(c.path), err)
	}
	return nil
}

func (s *Store) singlePartitionGUID(ctx context.Context, path string) (string, error) {
	table, err := s.readPartitionTable(ctx, path)
	if err != nil {
		return "", fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	if n := len(table.Partitions); n != 1 {
		return "", fmt.Errorf("%d partitions, a sparse block volume has exactly one: %w", n, ErrInvalid)
	}
	return strings.ToLower(table.Partitions[0].UUID), nil
}

// parseExport reads blkid's KEY=value lines.
func parseExport(b []byte) map[string]string {
	tags := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			tags[k] = v
		}
	}
	return tags
}
