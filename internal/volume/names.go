package volume

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// nameDir, in the store's lock directory, holds one symbolic link per
// volume name, <name> -> <uuid>: a hint that lets Get find a volume by
// name from one metadata file instead of all of them. A hint is never
// trusted: the link is read, never followed; its target must be a UUID;
// and the metadata of that UUID (readMeta's rules) must carry the name.
// The directory is reached through subdirFD, so a link or anything else
// planted in its place or in the lock directory's is never followed, and
// every hint is read, written and removed relative to that fd. A missing,
// stale or hostile hint costs a scan, which writes the hint anew; it never
// gives a wrong answer. Hints are written without a flush: one lost to a
// power cut costs one scan.
const nameDir = "names"

// nameDirFD opens <root>/.locks/names as subdirFD does. The caller closes
// the fd.
func (s *Store) nameDirFD() (int, error) {
	dir, err := s.lockDirFD()
	if err != nil {
		return -1, err
	}
	defer unix.Close(dir)
	return s.subdirFD(dir, nameDir, "name hint directory", filepath.Join(s.root, lockDir, nameDir))
}

// readHint returns the target of name's hint, "" if there is none.
func (s *Store) readHint(name string) string {
	dir, err := s.nameDirFD()
	if err != nil {
		return ""
	}
	defer unix.Close(dir)
	return readlinkat(dir, name)
}

// readlinkat returns the target of the link name in dir, "" if it is none.
func readlinkat(dir int, name string) string {
	var buf [64]byte
	n, err := unix.Readlinkat(dir, name, buf[:])
	if err != nil || n >= len(buf) {
		return ""
	}
	return string(buf[:n])
}

// byName returns the volume name's hint proves, or nil.
func (s *Store) byName(name string) *Volume {
	if ValidateName(name) != nil {
		return nil // no volume of ours has it; a scan says so
	}
	uuid := s.readHint(name)
	if !ValidUUID(uuid) {
		return nil
	}
	v, err := s.readMeta(uuid)
	if err != nil || v.Name != name {
		return nil
	}
	return v
}

// noteName makes name's hint point at uuid, best effort (failures are
// logged: a missing hint costs a scan). Races with other writers of the
// same hint are harmless: each writes what it read from the metadata.
func (s *Store) noteName(name, uuid string) {
	if ValidateName(name) != nil || !ValidUUID(uuid) {
		return
	}
	if err := s.linkName(name, uuid); err != nil {
		s.log.Debug("name hint not written", "volume", name, "uuid", uuid, "error", err)
	}
}

func (s *Store) linkName(name, uuid string) error {
	dir, err := s.nameDirFD()
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	err = unix.Symlinkat(uuid, dir, name)
	if !errors.Is(err, unix.EEXIST) {
		return err
	}
	if readlinkat(dir, name) == uuid {
		return nil
	}
	// Replace atomically: a temporary name no volume name can have
	// (names never start with '.'), renamed over the hint. renameat
	// replaces the name, never what a link there points at.
	tmp := fmt.Sprintf(".tmp-%d-%d", unix.Getpid(), rand.Uint64())
	if err := unix.Symlinkat(uuid, dir, tmp); err != nil {
		return err
	}
	if err := unix.Renameat(dir, tmp, dir, name); err != nil {
		unix.Unlinkat(dir, tmp, 0)
		return err
	}
	return nil
}

// forgetName removes name's hint if it points at uuid: the volume is gone.
func (s *Store) forgetName(name, uuid string) {
	if ValidateName(name) != nil {
		return
	}
	dir, err := s.nameDirFD()
	if err != nil {
		return
	}
	defer unix.Close(dir)
	if readlinkat(dir, name) == uuid {
		unix.Unlinkat(dir, name, 0)
	}
}
