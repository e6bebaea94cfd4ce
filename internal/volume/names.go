package volume

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// nameDir, in the store's lock directory, holds one symbolic link per
// volume name, <name> -> <uuid>: a hint that lets Get find a volume by
// name from one metadata file instead of all of them. A hint is never
// trusted: the link is read, never followed; its target must be a UUID;
// and the metadata of that UUID (readMeta's rules) must carry the name.
// A missing, stale or hostile hint costs a scan, which writes the hint
// anew; it never gives a wrong answer. Hints are written without a
// flush: one lost to a power cut costs one scan.
const nameDir = "names"

func (s *Store) nameHint(name string) string { return filepath.Join(s.root, lockDir, nameDir, name) }

// byName returns the volume name's hint proves, or nil.
func (s *Store) byName(name string) *Volume {
	if ValidateName(name) != nil {
		return nil // no volume of ours has it; a scan says so
	}
	uuid, err := os.Readlink(s.nameHint(name))
	if err != nil || !ValidUUID(uuid) {
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
	link := s.nameHint(name)
	err := unix.Symlink(uuid, link)
	if errors.Is(err, unix.ENOENT) {
		if err = os.Mkdir(filepath.Dir(link), 0o700); err == nil || errors.Is(err, os.ErrExist) {
			err = unix.Symlink(uuid, link)
		}
	}
	if !errors.Is(err, unix.EEXIST) {
		return err
	}
	if cur, err := os.Readlink(link); err == nil && cur == uuid {
		return nil
	}
	// Replace atomically: a temporary name no volume name can have
	// (names never start with '.'), renamed over the hint.
	tmp := filepath.Join(filepath.Dir(link), fmt.Sprintf(".tmp-%d-%d", os.Getpid(), rand.Uint64()))
	if err := unix.Symlink(uuid, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, link); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// forgetName removes name's hint if it points at uuid: the volume is gone.
func (s *Store) forgetName(name, uuid string) {
	if ValidateName(name) != nil {
		return
	}
	if cur, err := os.Readlink(s.nameHint(name)); err == nil && cur == uuid {
		os.Remove(s.nameHint(name))
	}
}
