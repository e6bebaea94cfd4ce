package volume

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// RecoverCopy is the copy a killed Recover left (recoverTempName).
type RecoverCopy struct {
	Path string // <root>/.recover-<uuid>
	UUID string // the volume it is a copy of
}

// RecoverCopies lists the copies killed recovers left in the store: each
// .recover-<uuid> whose volume's lock is free (Recover holds it while its
// copy exists, so a copy being made is not listed). It changes nothing;
// the next Recover of the volume replaces its copy and Delete removes it.
func (s *Store) RecoverCopies() ([]RecoverCopy, error) {
	names, err := s.storeNames()
	if err != nil {
		return nil, err
	}
	var out []RecoverCopy
	for _, name := range names {
		uuid, ok := strings.CutPrefix(name, recoverTempPrefix)
		if !ok || !ValidUUID(uuid) {
			continue
		}
		unlock, err := s.tryLock(uuid)
		if errors.Is(err, unix.EWOULDBLOCK) {
			continue // a recover, or another operation, holds the volume
		}
		if err != nil {
			return nil, err
		}
		unlock()
		out = append(out, RecoverCopy{Path: filepath.Join(s.root, name), UUID: uuid})
	}
	return out, nil
}

// ProbeTag is the tag of the loop device doctor binds to its probe file
// (ProbeFile).
const ProbeTag = TagPrefix + "doctor"

// probePrefix starts the name of a probe file in the store's directory;
// probeLock is the lock its maker holds while it exists.
const (
	probePrefix = ".doctor-"
	probeLock   = "doctor"
)

// processStart is when this process started, near enough: a probe file
// last changed before it is no probe of this process.
var processStart = time.Now()

// Probe is a file in the store's directory that doctor tries the kernel
// with (a loop device tagged ProbeTag bound to it), made by ProbeFile.
type Probe struct {
	File *os.File
	// Left is what the probes of killed doctors had left, found by
	// ProbeFile: removed where Err is nil.
	Left   []ProbeLeftover
	unlock func()
}

// ProbeLeftover is a probe file a killed doctor left, and the devices
// tagged ProbeTag that were bound to it.
type ProbeLeftover struct {
	Path    string
	Devices []string
	// Err says why it is still there; nil: ProbeFile removed it and
	// detached its devices.
	Err error
}

// ProbeFile creates an empty probe file in the store's directory and
// holds the store's probe lock until Close. Holding it, and before it
// creates the file, it removes what the probes of killed doctors left:
// each probe file last changed before this process started, after it
// detached the devices bound to that file (proved by the file's identity
// and ProbeTag); a device it cannot detach keeps its file, and the
// leftover says why (Probe.Left). The caller unbinds what it bound to the
// file before it calls Close.
func (s *Store) ProbeFile() (*Probe, error) {
	unlock, err := s.lock(probeLock)
	if err != nil {
		return nil, err
	}
	p := &Probe{unlock: unlock}
	if p.Left, err = s.removeProbes(); err != nil {
		unlock()
		return nil, err
	}
	if p.File, err = os.CreateTemp(s.root, probePrefix+"*"); err != nil {
		unlock()
		return nil, err
	}
	return p, nil
}

// Close removes the probe file, closes it and lets the probe lock go.
func (p *Probe) Close() error {
	err := os.Remove(p.File.Name())
	p.File.Close()
	p.unlock()
	return err
}

// removeProbes removes what the probes of killed doctors left, as
// ProbeFile says; the caller holds the probe lock.
func (s *Store) removeProbes() ([]ProbeLeftover, error) {
	names, err := s.storeNames()
	if err != nil {
		return nil, err
	}
	dir, err := s.dirFD()
	if err != nil {
		return nil, err
	}
	defer unix.Close(dir)
	var out []ProbeLeftover
	for _, name := range names {
		if !strings.HasPrefix(name, probePrefix) {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			continue // gone since the read
		}
		if time.Unix(st.Mtim.Unix()).After(processStart) {
			continue // made since this process started: not left by a killed doctor
		}
		left := ProbeLeftover{Path: filepath.Join(s.root, name)}
		left.Err = s.removeProbe(dir, name, &st, &left)
		out = append(out, left)
	}
	return out, nil
}

// removeProbe detaches the devices tagged ProbeTag bound to the probe
// file name (st) and removes the file, noting the devices in left.
func (s *Store) removeProbe(dir int, name string, st *unix.Stat_t, left *ProbeLeftover) error {
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("%s is no regular file: %w", left.Path, ErrUnsafe)
	}
	id := loop.FileID{Dev: st.Dev, Inode: st.Ino}
	bound, err := loop.Bound(id)
	if err != nil {
		return err
	}
	for _, d := range bound[id] {
		left.Devices = append(left.Devices, d.Path)
		if err := loop.Detach(d.Path, loop.Owner{ID: id, Tag: ProbeTag}); err != nil && !errors.Is(err, loop.ErrDeferred) {
			return fmt.Errorf("detach %s: %w", d.Path, err)
		}
	}
	if err := unix.Unlinkat(dir, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "remove", Path: left.Path, Err: err}
	}
	s.log.Info("removed what a killed doctor left", "file", left.Path, "devices", left.Devices)
	return nil
}
