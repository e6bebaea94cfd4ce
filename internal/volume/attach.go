package volume

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/loop"
)

// tag is what attach writes into lo_file_name, so `losetup -l` and a
// look at any loop device tell which volume it serves.
func tag(uuid string) string { return "sparsevol:" + uuid }

// attachDevice returns the loop device bound to v's backing file, binding
// one if there is none. The caller holds v's lock, which is what makes
// concurrent attaches of the same volume end with one device.
func (s *Store) attachDevice(v *Volume) (*loop.Device, error) {
	id, err := loop.FileIDOf(v.BackingFile)
	if err != nil {
		return nil, fmt.Errorf("attach %s: backing file: %w", v.Name, err)
	}
	devs, err := loop.FindAll(id)
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", v.Name, err)
	}
	for _, d := range devs {
		if dev, err := s.keep(v, d, id); dev != nil || err != nil {
			return dev, err
		}
	}
	return s.bind(v)
}

// keep returns d if it stays bound to v's file, cancelling a detach the
// kernel deferred; nil, nil if d is being torn down.
func (s *Store) keep(v *Volume, d *loop.Device, id loop.FileID) (*loop.Device, error) {
	if !d.Autoclear() {
		return d, nil
	}
	kept, err := loop.KeepBound(d.Path, id)
	switch {
	case err == nil:
		s.log.Info("cancelled a deferred detach", "volume", v.Name, "device", d.Path)
		return kept, nil
	case errors.Is(err, loop.ErrNotAttached):
		return nil, nil
	}
	return nil, fmt.Errorf("attach %s: %w", v.Name, err)
}

func (s *Store) bind(v *Volume) (*loop.Device, error) {
	s.keepThick(v) // trim.go: undo discards that punched holes into a thick volume
	dev, err := loop.Attach(v.BackingFile, loop.AttachOptions{
		Tag:       tag(v.UUID),
		DirectIO:  v.DirectIO,
		BlockSize: v.BlockSize,
		Partscan:  v.Partitioned,
	})
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", v.Name, err)
	}
	if v.DirectIO && !dev.DirectIO() {
		s.log.Warn("direct I/O refused by the kernel, using buffered I/O", "volume", v.Name, "device", dev.Path)
	}
	s.log.Info("volume attached", "volume", v.Name, "uuid", v.UUID, "device", dev.Path, "directIO", dev.DirectIO())
	return dev, nil
}

// finishAttach publishes the /dev/sparsevol link, where udev runs waits
// for the stable /dev/disk link so that whatever is ordered after the unit
// (kubelet) finds it, and marks the volume attached.
func (s *Store) finishAttach(ctx context.Context, v *Volume, dev *loop.Device) error {
	if err := s.publish(v, dev); err != nil {
		return err
	}
	return s.awaitAndMark(ctx, v, dev, loop.UdevRunning())
}

// publish points the volume's /dev/sparsevol link at its data device.
func (s *Store) publish(v *Volume, dev *loop.Device) error {
	data, err := dataDevice(v, dev)
	if err != nil {
		return fmt.Errorf("attach %s: %w", v.Name, err)
	}
	if data != "" {
		if err := setLink(v.UUID, data); err != nil {
			return fmt.Errorf("attach %s: %w", v.Name, err)
		}
	}
	return nil
}

// awaitAndMark waits for udev's stable link (if udev runs) and leaves the
// attached marker.
func (s *Store) awaitAndMark(ctx context.Context, v *Volume, dev *loop.Device, udev bool) error {
	if udev && v.StablePath() != linkPath(v.UUID) {
		if _, ok := ctx.Deadline(); !ok {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, s.opts.UdevTimeout)
			defer cancel()
		}
		if err := waitForLink(ctx, v.StablePath(), dev.Path); err != nil {
			return fmt.Errorf("attach %s: %w", v.Name, err)
		}
	}
	if err := s.markAttached(v.UUID); err != nil {
		return fmt.Errorf("attach %s: %w", v.Name, err)
	}
	return nil
}

// dataDevice is the node consumers use: the partition of a partitioned
// volume ("" if the kernel shows no partitions), the loop device otherwise.
func dataDevice(v *Volume, dev *loop.Device) (string, error) {
	if !v.Partitioned {
		return dev.Path, nil
	}
	parts, err := loop.Partitions(dev.Path)
	if err != nil {
		return "", err
	}
	if len(parts) == 0 {
		return "", nil
	}
	return parts[0], nil
}

// Attach makes the volume's device exist (idempotent: an attached volume
// keeps its device) and returns its status.
func (s *Store) Attach(ctx context.Context, ref string) (*Status, error) {
	var st *Status
	err := s.withVolume(ref, func(v *Volume) error {
		dev, err := s.attachLocked(ctx, v)
		if err == nil {
			st = s.status(v, []*loop.Device{dev}, nil)
		}
		return err
	})
	return st, err
}

// attachLocked is Attach for a caller holding v's lock: the device, the
// backing file's identity recorded, the links published.
func (s *Store) attachLocked(ctx context.Context, v *Volume) (*loop.Device, error) {
	if v.State != StateReady {
		return nil, fmt.Errorf("attach %s: state %s: %w (rerun create, or delete it)", v.Name, v.State, ErrNotReady)
	}
	dev, err := s.attachDevice(v)
	if err != nil {
		return nil, err
	}
	if v.noteBackingID(dev.Backing) {
		if err := s.writeMeta(v); err != nil {
			return nil, err
		}
	}
	if err := s.finishAttach(ctx, v, dev); err != nil {
		return nil, err
	}
	return dev, nil
}

// AttachAll attaches every ready volume of the store; see AttachMany.
func (s *Store) AttachAll(ctx context.Context) ([]*Status, error) {
	return s.AttachMany(ctx, nil)
}

// AttachMany attaches the volumes named by refs (names or UUIDs; nil means
// every volume) in one pass: it takes their locks (in UUID order), scans
// the loop devices once, binds the missing ones in parallel and waits for
// udev once, so its cost does not grow with the square of the number of
// volumes. Errors of single volumes are collected; the others are still
// attached. Volumes not ready are skipped with nil refs and an error when
// named.
func (s *Store) AttachMany(ctx context.Context, refs []string) ([]*Status, error) {
	var errs []error
	var uuids []string
	if refs != nil {
		uuids = make([]string, 0, len(refs))
		for _, ref := range refs {
			if ValidUUID(ref) { // read once, under the lock, below
				uuids = append(uuids, ref)
				continue
			}
			v, err := s.Get(ref)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			uuids = append(uuids, v.UUID)
		}
		if len(uuids) == 0 {
			return nil, errors.Join(errs...)
		}
	}
	locked, err := s.lockAll(uuids)
	if err != nil {
		return nil, errors.Join(append(errs, err)...)
	}
	defer unlockAll(locked)
	devs, err := loop.Scan()
	if err != nil {
		return nil, err
	}
	// Add the devices the binds below will need while the metadata is
	// read, so udev handles their "add" while they are empty (see
	// loop.Reserve). Every bound device counts as one of ours: a foreign
	// one can only make this reserve too few; volumes that turn out not
	// ready, too many (spare empty devices, as losetup leaves).
	if need := len(locked) - len(devs); need > 0 {
		if _, err := loop.Reserve(need); err != nil {
			s.log.Warn("reserving loop devices", "err", err) // the binds add their own
		}
	}
	byFile := make(map[loop.FileID]*loop.Device, len(devs))
	for _, d := range devs {
		if _, seen := byFile[d.Backing]; !seen {
			byFile[d.Backing] = d
		}
	}
	attached := make(map[*Volume]*loop.Device)
	var unbound []*Volume
	// Re-read under the lock (another process may have changed it), and
	// stat the files, on every core: a thousand JSON documents at boot.
	type read struct {
		v     *Volume
		id    loop.FileID
		err   error
		idErr error
	}
	reads := make([]read, len(locked))
	parallel(len(locked), publishWorkers, func(i int) {
		r := &reads[i]
		if r.v, r.err = s.readMeta(locked[i].uuid); r.err == nil && r.v.State == StateReady {
			r.id, r.idErr = loop.FileIDOf(r.v.BackingFile)
		}
	})
	for _, r := range reads {
		v, err := r.v, r.err
		if errors.Is(err, ErrNotFound) && uuids == nil {
			continue // deleted since the listing
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if v.State != StateReady {
			if uuids != nil {
				errs = append(errs, fmt.Errorf("attach %s: state %s: %w (rerun create, or delete it)", v.Name, v.State, ErrNotReady))
			}
			continue
		}
		id := r.id
		if r.idErr != nil {
			errs = append(errs, fmt.Errorf("attach %s: %w", v.Name, r.idErr))
			continue
		}
		if v.noteBackingID(id) {
			if err := s.writeMeta(v); err != nil {
				errs = append(errs, err)
			}
		}
		var dev *loop.Device
		err = nil
		if found := byFile[id]; found != nil {
			dev, err = s.keep(v, found, id)
		}
		switch {
		case err != nil:
			errs = append(errs, err)
		case dev != nil:
			attached[v] = dev
		default:
			unbound = append(unbound, v)
		}
	}
	s.log.Info("attaching", "volumes", len(locked), "attached", len(attached), "toBind", len(unbound))
	bound, bindErrs := s.bindMany(unbound) // batch.go: parallel binds
	maps.Copy(attached, bound)
	errs = append(errs, bindErrs...)
	s.log.Info("bound; waiting for udev", "bound", len(bound), "failed", len(bindErrs))
	vols := slices.Collect(maps.Keys(attached))
	// Our /dev/sparsevol links first, all of them and in parallel (a
	// thousand symlinks at boot), then one wait for udev's.
	volErrs := make([]error, len(vols))
	parallel(len(vols), publishWorkers, func(i int) {
		volErrs[i] = s.publish(vols[i], attached[vols[i]])
	})
	// Wait for udev once for all, not volume by volume, with one deadline.
	ctx, cancel := context.WithTimeout(ctx, s.opts.UdevTimeout)
	defer cancel()
	udev := loop.UdevRunning()
	for i, v := range vols {
		if volErrs[i] == nil {
			volErrs[i] = s.awaitAndMark(ctx, v, attached[v], udev)
		}
	}
	mounts := loop.ReadMountTable() // once for all volumes
	out := make([]*Status, len(vols))
	parallel(len(vols), publishWorkers, func(i int) {
		out[i] = s.status(vols[i], []*loop.Device{attached[vols[i]]}, mounts)
	})
	errs = append(errs, volErrs...)
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	s.log.Info("volumes attached", "volumes", len(out))
	return out, errors.Join(errs...)
}

// Detach removes the volume's loop device(s) (idempotent). It refuses,
// changing nothing, while the volume is mounted; if a process merely holds
// the device open, the kernel detaches it at last close and the error says
// so (loop.ErrDeferred).
func (s *Store) Detach(ctx context.Context, ref string) error {
	return s.withVolume(ref, func(v *Volume) error {
		return s.detachDevices(v, nil)
	})
}

// DetachAll detaches every volume of the store with one scan of the loop
// devices, under every volume's lock; busy ones are reported and left
// attached.
func (s *Store) DetachAll(ctx context.Context) error {
	vols, err := s.lockAll(nil)
	if err != nil {
		return err
	}
	defer unlockAll(vols)
	devs, err := loop.Scan()
	if err != nil {
		return err
	}
	byFile := map[loop.FileID][]*loop.Device{}
	for _, d := range devs {
		byFile[d.Backing] = append(byFile[d.Backing], d)
	}
	var errs []error
	for _, lv := range vols {
		v, err := s.readMeta(lv.uuid)
		if err != nil {
			if !errors.Is(err, ErrNotFound) {
				errs = append(errs, err)
			}
			continue
		}
		if err := s.detachDevices(v, byFile); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

type lockedVolume struct {
	uuid   string
	unlock func()
}

// lockAll takes the locks of the volumes with the given UUIDs (nil: every
// volume of the store), in UUID order so that two callers cannot deadlock.
func (s *Store) lockAll(uuids []string) ([]lockedVolume, error) {
	if uuids == nil {
		var err error
		if uuids, err = s.uuids(); err != nil {
			return nil, err
		}
	}
	uuids = slices.Clone(uuids)
	slices.Sort(uuids)
	uuids = slices.Compact(uuids)
	out := make([]lockedVolume, 0, len(uuids))
	for _, uuid := range uuids {
		unlock, err := s.lock(uuid)
		if err != nil {
			unlockAll(out)
			return nil, err
		}
		out = append(out, lockedVolume{uuid, unlock})
	}
	return out, nil
}

func unlockAll(vols []lockedVolume) {
	for _, v := range vols {
		v.unlock()
	}
}

// detachDevices detaches every loop device bound to v's backing file. The
// identity check inside loop.Detach proves each is ours. scanned, if not
// nil, is one loop.Scan of the machine by backing file (detach --all).
//
// If the backing file was removed behind our back, a device may still hold
// its (now unnamed) inode: it is found by the identity recorded in the
// metadata, and detached only if it also carries the volume's tag.
func (s *Store) detachDevices(v *Volume, scanned map[loop.FileID][]*loop.Device) error {
	s.cleanupTempMount(v)
	id, err := loop.FileIDOf(v.BackingFile)
	present := err == nil
	switch {
	case isNotExist(err) && v.backingID() != (loop.FileID{}):
		id = v.backingID()
	case isNotExist(err):
		s.removeLink(v.UUID)
		return nil // never bound since identities were recorded
	case err != nil:
		return fmt.Errorf("detach %s: %w", v.Name, err)
	}
	var devs []*loop.Device
	if present && scanned != nil {
		devs = scanned[id]
	} else if devs, err = loop.FindAll(id); err != nil { // FindAll fills in tags; Scan does not
		return fmt.Errorf("detach %s: %w", v.Name, err)
	}
	if !present {
		devs = slices.DeleteFunc(devs, func(d *loop.Device) bool { return d.Tag != tag(v.UUID) })
	}
	return s.detachList(v, id, devs)
}

func (s *Store) detachList(v *Volume, id loop.FileID, devs []*loop.Device) error {
	var deferred error
	for _, dev := range devs {
		err := loop.Detach(dev.Path, id)
		switch {
		case err == nil, errors.Is(err, loop.ErrNotAttached):
			s.log.Info("volume detached", "volume", v.Name, "uuid", v.UUID, "device", dev.Path)
		case errors.Is(err, loop.ErrDeferred):
			// Going away at the opener's last close: no longer published.
			deferred = fmt.Errorf("detach %s: %w", v.Name, err)
		case errors.Is(err, loop.ErrBusy):
			return fmt.Errorf("detach %s: %w: %w", v.Name, ErrBusy, err)
		default:
			return fmt.Errorf("detach %s: %w", v.Name, err)
		}
	}
	s.removeLink(v.UUID)
	return deferred
}

func linkPath(uuid string) string { return filepath.Join(LinkDir, uuid) }

// setLink points /dev/sparsevol/<uuid> at target, atomically (symlink to a
// temporary name, then rename over).
func setLink(uuid, target string) error {
	if err := fsutil.ReplaceSymlink(target, linkPath(uuid)); err != nil {
		return fmt.Errorf("link %s: %w", linkPath(uuid), err)
	}
	return nil
}

// removeLink removes what attach published for the volume: its
// /dev/sparsevol link and its attached marker.
func (s *Store) removeLink(uuid string) {
	os.Remove(linkPath(uuid))
	if s.opts.AttachedDir != "" {
		os.Remove(filepath.Join(s.opts.AttachedDir, uuid))
	}
}

// markAttached leaves the file of Options.AttachedDir that says the volume
// came up completely. Plain open and close: at boot this runs for every
// volume, and os.File would register each with the poller.
func (s *Store) markAttached(uuid string) error {
	if s.opts.AttachedDir == "" {
		return nil
	}
	path := filepath.Join(s.opts.AttachedDir, uuid)
	fd, err := unix.Open(path, unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
	if errors.Is(err, unix.ENOENT) {
		if err = os.MkdirAll(s.opts.AttachedDir, 0o755); err == nil {
			fd, err = unix.Open(path, unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
		}
	}
	if err != nil {
		return fmt.Errorf("mark attached %s: %w", path, err)
	}
	return unix.Close(fd)
}

// waitForLink polls until link resolves to dev or one of its partitions,
// or ctx ends.
func waitForLink(ctx context.Context, link, dev string) error {
	// Poll with a backoff from 5 ms to 100 ms: at boot a hundred units wait
	// at once, and tight polling takes the CPU udev needs to make the links.
	// No extra change events either: they flood udev's queue (measured in
	// the VM test: 38 s to kubelet became 200 s).
	interval := 5 * time.Millisecond
	for {
		if target, err := filepath.EvalSymlinks(link); err == nil {
			if parent, err := loop.ParentOf(target); err == nil && parent == dev {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("udev did not create %s for %s in time (check `udevadm info %s` and `blkid %s`): %w",
				link, dev, dev, dev, ctx.Err())
		case <-time.After(interval):
		}
		interval = min(interval*3/2, 100*time.Millisecond)
	}
}

// ErrDeferred: a detach the kernel postponed until the last opener closes
// the device (re-exported so callers need not reach into the loop layer).
var ErrDeferred = loop.ErrDeferred

// WithDevice attaches the volume if needed and runs fn under the volume's
// lock with its device held open and proven to be the volume's: a device
// number cannot be detached and rebound to another file while fn formats
// or mounts it by path.
func (s *Store) WithDevice(ctx context.Context, ref string, fn func(st *Status) error) error {
	return s.withVolume(ref, func(v *Volume) error {
		dev, err := s.attachLocked(ctx, v)
		if err != nil {
			return err
		}
		release, err := loop.Hold(dev.Path, dev.Backing)
		if err != nil {
			return fmt.Errorf("attach %s: %w", v.Name, err)
		}
		defer release()
		return fn(s.status(v, []*loop.Device{dev}, nil))
	})
}
