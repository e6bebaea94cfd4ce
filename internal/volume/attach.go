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
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/parallel"
)

// TagPrefix starts what attach writes into lo_file_name: the tag of a
// volume's device is TagPrefix + UUID, so `losetup -l` and a look at any
// loop device tell which volume it serves.
const TagPrefix = "sparsevol:"

func tag(uuid string) string { return TagPrefix + uuid }

// TagUUID returns the volume UUID a device tag names, if it is a volume's.
func TagUUID(t string) (string, bool) {
	uuid, ok := strings.CutPrefix(t, TagPrefix)
	return uuid, ok && ValidUUID(uuid)
}

// devicesOf sorts what is bound to v's backing file into v's own devices
// (proven by ownedHere) and foreign ones, which nothing of ours may touch.
// ids and present are backingIDs(v); bound is loop.Bound of ids.
func (s *Store) devicesOf(v *Volume, ids []loop.FileID, present loop.FileID, bound map[loop.FileID][]*loop.Device) (ours, foreign []*loop.Device) {
	seen := map[string]bool{}
	for _, id := range ids {
		for _, d := range bound[id] {
			if seen[d.Path] {
				continue
			}
			seen[d.Path] = true
			if s.ownedHere(v, d, present) == nil {
				ours = append(ours, d)
			} else {
				foreign = append(foreign, d)
			}
		}
	}
	return ours, foreign
}

// ownedHere returns nil if d is provably v's device in this store, else an
// error wrapping loop.ErrNotOwned that says why. v.owner proves d by its
// backing file's identity and v's tag. Where that identity is not the
// file at <root>/<uuid> now (present, zero when there is none), the file
// was removed or replaced while d held it, and only the identity
// recorded at attach names it: then the kernel must also name d's file
// as this store's <root>/<uuid>. A record copied into another store
// carries the identity and the tag of this store's live device, and must
// not make that device the other store's to copy, detach or delete.
func (s *Store) ownedHere(v *Volume, d *loop.Device, present loop.FileID) error {
	if err := v.owner(d.Backing).Check(d); err != nil {
		return err
	}
	if present != (loop.FileID{}) && d.Backing == present {
		return nil
	}
	file, err := loop.BackingFile(d.Number)
	if err != nil {
		return fmt.Errorf("%s: %w: %w", d.Path, err, loop.ErrNotOwned)
	}
	name := strings.TrimSuffix(file, loop.DeletedSuffix)
	if name == s.backingPath(v.UUID) {
		return nil
	}
	if root, err := filepath.EvalSymlinks(s.root); err == nil && name == filepath.Join(root, v.UUID) {
		return nil
	}
	return fmt.Errorf("%s holds %s, not this store's %s: %w", d.Path, Quote(file), s.backingPath(v.UUID), loop.ErrNotOwned)
}

// backingIDs are the identities v's devices may be bound to: the backing
// file's now (present, if it is there and safe; else zero) and the one
// recorded at attach (the file may be gone, or replaced while a device
// held the old one).
func (s *Store) backingIDs(v *Volume) (ids []loop.FileID, present loop.FileID) {
	if st, err := s.statBacking(v.UUID); err == nil {
		present = loop.FileID{Dev: st.Dev, Inode: st.Ino}
		ids = append(ids, present)
	}
	if rec := v.backingID(); rec != (loop.FileID{}) && rec != present {
		ids = append(ids, rec)
	}
	return ids, present
}

// boundTo is loop.Bound(ids...) for v (ids is backingIDs(v)), without the
// look at every bound device where the answer is known: the file has the
// one identity recorded and is open nowhere else (unboundFile), so no
// device holds it. The caller holds v's lock.
func (s *Store) boundTo(v *Volume, ids []loop.FileID) (map[loop.FileID][]*loop.Device, error) {
	if s.unboundFile(v, ids) {
		return map[loop.FileID][]*loop.Device{}, nil
	}
	return loop.Bound(ids...)
}

// unboundFile reports whether no loop device can hold v's backing file:
// ids (backingIDs) is the one identity of the file there now, and it is
// open nowhere else (loop.Unshared). false where that is not proven.
func (s *Store) unboundFile(v *Volume, ids []loop.FileID) bool {
	if len(ids) != 1 {
		return false // gone, or replaced under a device of the old file
	}
	fd, id, err := s.openBacking(v.UUID, unix.O_RDONLY)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	return id == ids[0] && s.unshared(v, fd)
}

// foreignError refuses an operation on v because of devices someone else
// bound to its backing file; present is backingIDs'.
func (s *Store) foreignError(op string, v *Volume, present loop.FileID, foreign []*loop.Device) error {
	var paths, whys []string
	for _, d := range foreign {
		paths = append(paths, d.Path)
		whys = append(whys, s.ownedHere(v, d, present).Error())
	}
	return fmt.Errorf("%s %s: %s also hold(s) its backing file and %s not ours (%s); find who uses it with `losetup -l %s` and detach it with `losetup -d` if nobody does: %w",
		op, v.Name, strings.Join(paths, ", "), plural(len(paths), "is", "are"), strings.Join(whys, "; "), strings.Join(paths, " "), ErrUnsafe)
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// openOwned opens v's backing file read-write (openBacking's rules) and
// finds v's own devices on it, refusing with ErrUnsafe while a device
// someone else bound holds it: what every operation that binds, resizes
// or grows a volume proves first. op names the operation in errors. The
// caller holds v's lock and closes fd. A file open nowhere else
// (loop.Unshared) has no device: the scan of every bound device is left
// out then.
func (s *Store) openOwned(v *Volume, op string) (fd int, id loop.FileID, ours []*loop.Device, err error) {
	fd, id, err = s.openBacking(v.UUID, unix.O_RDWR)
	if err != nil {
		return -1, id, nil, fmt.Errorf("%s %s: %w", op, v.Name, err)
	}
	if s.unshared(v, fd) {
		return fd, id, nil, nil
	}
	if ours, err = s.scanOwned(v, id, op); err != nil {
		unix.Close(fd)
		return -1, id, nil, err
	}
	return fd, id, ours, nil
}

// scanOwned finds v's own devices on its backing file (identity id) by a
// look at every bound device, refusing with ErrUnsafe while a device
// someone else bound holds the file. op names the operation in errors.
func (s *Store) scanOwned(v *Volume, id loop.FileID, op string) ([]*loop.Device, error) {
	bound, err := loop.Bound(id)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", op, v.Name, err)
	}
	ours, foreign := s.devicesOf(v, []loop.FileID{id}, id, bound)
	if len(foreign) > 0 {
		return nil, s.foreignError(op, v, id, foreign)
	}
	return ours, nil
}

// attachDevice returns v's loop device, binding one if there is none;
// fresh says it bound it. The caller holds v's lock, which is what makes
// concurrent attaches of the same volume end with one device. A backing
// file that breaks the rules, or that someone else bound, is refused with
// ErrUnsafe.
//
// It costs the same with ten devices bound or a thousand: the device
// v's link names (what attach last published for v) is looked at first,
// then whether anything holds the file at all (loop.Unshared); only a
// file held by something else is scanned for (scanOwned). A device proven
// v's (v.owner) is the answer; devices someone else bound beside it were
// refused when it was bound, and are not looked for again. A file that
// is held is scanned, so a device someone else bound to it is refused
// before one of ours is bound next to it.
func (s *Store) attachDevice(v *Volume) (dev *loop.Device, fresh bool, err error) {
	fd, id, err := s.openBacking(v.UUID, unix.O_RDWR)
	if err != nil {
		return nil, false, fmt.Errorf("attach %s: %w", v.Name, err)
	}
	defer unix.Close(fd)
	linked := linkedDevice(v.UUID)
	var ours []*loop.Device
	switch {
	case linked != nil && v.owner(id).Check(linked) == nil:
		ours = []*loop.Device{linked}
	case s.unshared(v, fd):
		// No device holds the file: none to keep, none to refuse.
	default:
		if ours, err = s.scanOwned(v, id, "attach"); err != nil {
			return nil, false, err
		}
	}
	for _, d := range ours {
		if dev, err := s.keep(v, d); dev != nil || err != nil {
			return dev, false, err
		}
	}
	if err := linkTakenBy(v, id, linked); err != nil {
		return nil, false, err
	}
	if dev, err = s.bind(v, fd); err != nil {
		return nil, false, err
	}
	return dev, true, nil
}

// unshared reports whether v's backing file, open as fd, is open nowhere
// else, so that no loop device holds it (loop.Unshared); false where the
// kernel cannot tell.
func (s *Store) unshared(v *Volume, fd int) bool {
	free, err := loop.Unshared(fd)
	if err != nil {
		s.log.Debug("no lease on the backing file; scanning the loop devices", "volume", v.Name, "err", err)
	}
	return free
}

// linkTaken refuses to attach v (backing file id) while its node-wide
// /dev/sparsevol/<uuid> link serves a device that is not v's: another
// store's volume with the same UUID. Checked before binding, so a refused
// attach leaves no device behind.
func linkTaken(v *Volume, id loop.FileID) error { return linkTakenBy(v, id, linkedDevice(v.UUID)) }

// linkTakenBy is linkTaken for a caller that read the link (linkedDevice)
// itself: other is the device it serves, or nil.
func linkTakenBy(v *Volume, id loop.FileID, other *loop.Device) error {
	if other == nil || v.owner(id).Check(other) == nil {
		return nil
	}
	return fmt.Errorf("attach %s: %s serves %s, a device of another file (another store's volume with this UUID?); detach that volume first: %w",
		v.Name, linkPath(v.UUID), other.Path, ErrUnsafe)
}

// keep returns d if it stays bound to v's file, cancelling a detach the
// kernel deferred; nil, nil if d is being torn down.
func (s *Store) keep(v *Volume, d *loop.Device) (*loop.Device, error) {
	if !d.Autoclear() {
		s.writeIdentity(v, d)
		return d, nil
	}
	kept, err := loop.KeepBound(d.Path, v.owner(d.Backing))
	switch {
	case err == nil:
		s.log.Info("cancelled a deferred detach", "volume", v.Name, "device", d.Path)
		s.writeIdentity(v, kept)
		return kept, nil
	case errors.Is(err, loop.ErrNotAttached):
		return nil, nil
	}
	return nil, fmt.Errorf("attach %s: %w", v.Name, err)
}

// bind binds the open backing file fd (from openBacking) to a new device,
// trying first the one v's last detach freed (lastDevice). The caller
// holds v's lock.
func (s *Store) bind(v *Volume, fd int) (*loop.Device, error) {
	s.keepThick(v, fd) // trim.go: undo discards that punched holes into a thick volume
	opts := s.attachOptions(v)
	opts.Prefer = s.lastDevice(v.UUID)
	dev, err := loop.Attach(fd, opts)
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", v.Name, err)
	}
	if v.DirectIO && !dev.DirectIO() {
		s.log.Warn("direct I/O refused by the kernel, using buffered I/O", "volume", v.Name, "device", dev.Path)
	}
	s.writeIdentity(v, dev)
	s.log.Info("volume attached", "volume", v.Name, "uuid", v.UUID, "device", dev.Path, "directIO", dev.DirectIO())
	return dev, nil
}

// attachOptions are how every device of v is bound.
func (s *Store) attachOptions(v *Volume) loop.AttachOptions {
	return loop.AttachOptions{
		Tag:       tag(v.UUID),
		DirectIO:  v.DirectIO,
		BlockSize: v.BlockSize,
		Partscan:  v.Partitioned,
		QuietUdev: s.udevRuns(),
	}
}

// finishAttach publishes the /dev/sparsevol link, where udev runs waits
// for the stable /dev/disk link so that whatever is ordered after the unit
// (kubelet) finds it, and marks the volume attached.
func (s *Store) finishAttach(ctx context.Context, v *Volume, dev *loop.Device) error {
	if err := s.publish(v, dev); err != nil {
		return err
	}
	return s.awaitAndMark(ctx, v, dev, s.udevRuns())
}

// publish points the volume's /dev/sparsevol link at its data device.
// /dev/sparsevol is node-wide: a link that serves a device of another
// volume with the same UUID (another store's) is refused, not taken over.
func (s *Store) publish(v *Volume, dev *loop.Device) error {
	data, err := dataDevice(v, dev)
	if err != nil {
		return fmt.Errorf("attach %s: %w", v.Name, err)
	}
	if data == "" {
		return nil
	}
	if err := linkTaken(v, dev.Backing); err != nil {
		return err
	}
	if err := setLink(v.UUID, data); err != nil {
		return fmt.Errorf("attach %s: %w", v.Name, err)
	}
	return nil
}

// linkedDevice returns the loop device /dev/sparsevol/<uuid> serves if it
// is bound and tagged for uuid: a volume with that UUID, ours or another
// store's. nil if there is no link, or it is stale (the device is gone, or
// its number now serves something else).
func linkedDevice(uuid string) *loop.Device {
	target, err := os.Readlink(linkPath(uuid))
	if err != nil {
		return nil
	}
	parent, err := loop.ParentOf(target)
	if err != nil {
		return nil
	}
	d, err := loop.Get(parent)
	if err != nil || d.Tag != tag(uuid) {
		return nil
	}
	return d
}

// LinkedElsewhere returns ErrExists if /dev/sparsevol/<uuid> serves a
// bound device: the UUID is in use on this node, whatever the store.
func LinkedElsewhere(uuid string) error {
	if d := linkedDevice(uuid); d != nil {
		return fmt.Errorf("uuid %s is in use on this node: %s serves %s (tagged %q): %w", uuid, linkPath(uuid), d.Path, d.Tag, ErrExists)
	}
	return nil
}

// awaitAndMark proves udev took the identity bind or keep left for a raw
// volume's dev (settleIdentity), waits for udev's stable
// link (if udev runs) and leaves the attached marker. The caller holds
// v's lock; ctx's deadline, or else Options.UdevTimeout, bounds the waits.
func (s *Store) awaitAndMark(ctx context.Context, v *Volume, dev *loop.Device, udevRuns bool) error {
	ctx, cancel := s.udevDeadline(ctx)
	defer cancel()
	if err := s.settleIdentity(ctx, v, dev); err != nil {
		return fmt.Errorf("attach %s: %w", v.Name, err)
	}
	if udevRuns && v.StablePath() != linkPath(v.UUID) {
		if err := waitForLink(ctx, v.StablePath(), dev.Path); err != nil {
			return fmt.Errorf("attach %s: %w", v.Name, err)
		}
	}
	if err := s.markAttached(v.UUID); err != nil {
		return fmt.Errorf("attach %s: %w", v.Name, err)
	}
	return nil
}

// udevDeadline bounds ctx by Options.UdevTimeout for the waits for udev,
// unless ctx has a deadline already: a caller's for more than one pass
// (a whole boot, see AttachEnabled) is not stretched by each.
func (s *Store) udevDeadline(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.opts.UdevTimeout)
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
		dev, _, err := s.attachLocked(ctx, v)
		if err == nil {
			st = s.status(v, []*loop.Device{dev}, nil)
		}
		return err
	})
	return st, err
}

// AttachDevice is Attach for a caller that needs only the volume and the
// path of its loop device: what `sparsevol attach VOLUME` prints and a
// unit's start needs. The same attach, proofs and links; no status
// (backing file, mount points, stable path) is gathered after it.
func (s *Store) AttachDevice(ctx context.Context, ref string) (v *Volume, device string, err error) {
	err = s.withVolume(ref, func(locked *Volume) error {
		dev, _, err := s.attachLocked(ctx, locked)
		if err == nil {
			v, device = locked, dev.Path
		}
		return err
	})
	return v, device, err
}

// attachLocked is Attach for a caller holding v's lock: the device, the
// backing file's identity recorded, the links published.
// fresh says this call bound the device.
func (s *Store) attachLocked(ctx context.Context, v *Volume) (dev *loop.Device, fresh bool, err error) {
	if v.State != StateReady {
		return nil, false, fmt.Errorf("attach %s: state %s: %w (%s)", v.Name, v.State, ErrNotReady, v.finishAdvice())
	}
	dev, fresh, err = s.attachDevice(v)
	if err != nil {
		return nil, false, err
	}
	// Device numbers change across reboots and re-attaches: the limits
	// follow the device every time, before anyone is shown it.
	if err := s.applyLimits(v, dev); err != nil {
		if fresh {
			s.undoAttach(v)
		}
		return nil, false, fmt.Errorf("attach %s: %w", v.Name, err)
	}
	if v.noteBackingID(dev.Backing) {
		if err := s.writeMeta(v); err != nil {
			return nil, fresh, err
		}
	}
	if err := s.finishAttach(ctx, v, dev); err != nil {
		if fresh && errors.Is(err, errProbed) {
			s.undoAttach(v)
		}
		return nil, fresh, err
	}
	return dev, fresh, nil
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
// attached: a volume whose lock cannot be taken is left out with its
// error, and one whose lock another process holds is waited for (bounded
// by ctx) after the others are attached. Volumes not ready are skipped
// with nil refs and an error when named. ctx's deadline, or else
// Options.UdevTimeout, bounds each pass's udev wait (udevDeadline).
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
	// First the volumes nobody else holds, then, with none held, the busy
	// ones: one held by another process does not keep the rest waiting.
	locked, failed, err := s.lockEach(uuids, s.tryLock)
	if err != nil {
		return nil, errors.Join(append(errs, err)...)
	}
	var busy []string
	for _, f := range failed {
		if errors.Is(f.err, unix.EWOULDBLOCK) {
			busy = append(busy, f.uuid)
		} else {
			errs = append(errs, fmt.Errorf("attach: %w", f.err))
		}
	}
	out, attachErrs := s.attachBatch(ctx, locked, uuids != nil)
	unlockAll(locked)
	errs = append(errs, attachErrs...)
	if len(busy) > 0 {
		s.log.Info("waiting for volumes another process holds", "volumes", len(busy))
		locked, failed, _ := s.lockEach(busy, s.lockUntil(ctx))
		for _, f := range failed {
			errs = append(errs, fmt.Errorf("attach: %w", f.err))
		}
		more, attachErrs := s.attachBatch(ctx, locked, uuids != nil)
		unlockAll(locked)
		out = append(out, more...)
		errs = append(errs, attachErrs...)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	s.log.Info("volumes attached", "volumes", len(out))
	return out, errors.Join(errs...)
}

// attachBatch is AttachMany's pass over the volumes whose locks the
// caller holds (locked) and keeps; named says the volumes were named,
// so that one deleted or not ready is an error, not skipped.
func (s *Store) attachBatch(ctx context.Context, locked []lockedVolume, named bool) ([]*Status, []error) {
	var errs []error
	// Add the devices the binds below will need while the metadata is
	// read, so udev handles their "add" while they are empty (see
	// loop.Reserve). Every bound device counts as one of ours: a foreign
	// one can only make this reserve too few; volumes that turn out not
	// ready, too many (spare empty devices, as losetup leaves).
	if bound, err := loop.BoundCount(); err == nil && len(locked) > bound {
		if _, err := loop.Reserve(len(locked) - bound); err != nil {
			s.log.Warn("reserving loop devices", "err", err) // the binds add their own
		}
	}
	attached := make(map[*Volume]*loop.Device)
	var unbound []*Volume
	// Re-read under the lock (another process may have changed it), and
	// open the files, on every core: a thousand JSON documents at boot.
	// The fds are closed once the binds hold their own references.
	type read struct {
		v     *Volume
		fd    int
		id    loop.FileID
		err   error
		idErr error
	}
	reads := make([]read, len(locked))
	parallel.For(len(locked), publishWorkers, func(i int) {
		r := &reads[i]
		r.fd = -1
		if r.v, r.err = s.readMeta(locked[i].uuid); r.err == nil && r.v.State == StateReady {
			r.fd, r.id, r.idErr = s.openBacking(r.v.UUID, unix.O_RDWR)
		}
	})
	defer func() {
		for _, r := range reads {
			if r.fd >= 0 {
				unix.Close(r.fd)
			}
		}
	}()
	ids := make([]loop.FileID, 0, len(reads))
	for _, r := range reads {
		if r.err == nil && r.idErr == nil && r.fd >= 0 {
			ids = append(ids, r.id)
		}
	}
	bound, err := loop.Bound(ids...)
	if err != nil {
		return nil, []error{err}
	}
	fds := map[*Volume]int{}
	for _, r := range reads {
		v, err := r.v, r.err
		if errors.Is(err, ErrNotFound) && !named {
			continue // deleted since the listing
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if v.State != StateReady {
			if named {
				errs = append(errs, fmt.Errorf("attach %s: state %s: %w (%s)", v.Name, v.State, ErrNotReady, v.finishAdvice()))
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
		ours, foreign := s.devicesOf(v, []loop.FileID{id}, id, bound)
		if len(foreign) > 0 {
			errs = append(errs, s.foreignError("attach", v, id, foreign))
			continue
		}
		if err := linkTaken(v, id); err != nil {
			errs = append(errs, err)
			continue
		}
		var dev *loop.Device
		err = nil
		for _, d := range ours {
			if dev, err = s.keep(v, d); dev != nil || err != nil {
				break
			}
		}
		switch {
		case err != nil:
			errs = append(errs, err)
		case dev != nil:
			attached[v] = dev
		default:
			unbound = append(unbound, v)
			fds[v] = r.fd
		}
	}
	s.log.Info("attaching", "volumes", len(locked), "attached", len(attached), "toBind", len(unbound))
	newly, bindErrs := s.bindMany(unbound, fds) // batch.go: parallel binds
	maps.Copy(attached, newly)
	errs = append(errs, bindErrs...)
	s.log.Info("bound; waiting for udev", "bound", len(bound), "failed", len(bindErrs))
	entries, err := s.opts.IOLimits.Entries() // one read for all
	if err != nil {
		s.log.Warn("reading I/O limits", "error", err)
		entries = nil
	}
	for v, dev := range attached {
		if err := s.applyLimitsOver(v, dev, entries); err != nil {
			errs = append(errs, fmt.Errorf("attach %s: %w", v.Name, err))
			delete(attached, v)
			if _, fresh := newly[v]; fresh {
				s.undoAttach(v)
			}
		}
	}
	vols := slices.Collect(maps.Keys(attached))
	// Our /dev/sparsevol links first, all of them and in parallel (a
	// thousand symlinks at boot), then one wait for udev's.
	volErrs := make([]error, len(vols))
	parallel.For(len(vols), publishWorkers, func(i int) {
		volErrs[i] = s.publish(vols[i], attached[vols[i]])
	})
	// Wait for udev once for all, not volume by volume, with one deadline.
	ctx, cancel := s.udevDeadline(ctx)
	defer cancel()
	udev := s.udevRuns()
	for i, v := range vols {
		if volErrs[i] == nil {
			volErrs[i] = s.awaitAndMark(ctx, v, attached[v], udev)
		}
		if _, fresh := newly[v]; fresh && errors.Is(volErrs[i], errProbed) {
			s.undoAttach(v)
		}
	}
	mounts := loop.ReadMountTable() // once for all volumes
	out := make([]*Status, len(vols))
	parallel.For(len(vols), publishWorkers, func(i int) {
		out[i] = s.status(vols[i], []*loop.Device{attached[vols[i]]}, mounts)
	})
	return out, append(errs, volErrs...)
}

// DetachOptions tune Detach and Delete.
type DetachOptions struct {
	// Force detaches the device of an orphaned volume (backing file gone),
	// which loses the data only that device still holds.
	Force bool
}

// Detach removes the volume's loop device(s) (idempotent). It refuses,
// changing nothing, while the volume is mounted, and without opts.Force
// while it is orphaned; if a process merely holds the device open, the
// kernel detaches it at last close and the error says so
// (loop.ErrDeferred). Devices someone else bound to the volume's file are
// never detached: they are named in a warning.
func (s *Store) Detach(ref string, opts DetachOptions) error {
	return s.withVolume(ref, func(v *Volume) error {
		return s.detachDevices(v, nil, opts)
	})
}

// DetachAll detaches every volume of the store with one lookup of the loop
// devices, under every volume's lock; busy ones, and ones whose lock
// cannot be taken, are reported and left attached.
func (s *Store) DetachAll(opts DetachOptions) error {
	vols, failed, err := s.lockEach(nil, s.lock)
	if err != nil {
		return err
	}
	defer unlockAll(vols)
	var errs []error
	for _, f := range failed {
		errs = append(errs, fmt.Errorf("detach: %w", f.err))
	}
	var read []*Volume
	var ids []loop.FileID
	for _, lv := range vols {
		v, err := s.readMeta(lv.uuid)
		if err != nil {
			if !errors.Is(err, ErrNotFound) {
				errs = append(errs, err)
			}
			continue
		}
		read = append(read, v)
		vids, _ := s.backingIDs(v)
		ids = append(ids, vids...)
	}
	bound, err := loop.Bound(ids...)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, v := range read {
		if err := s.detachDevices(v, bound, opts); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// detachDevices detaches v's own devices (see devicesOf); bound, if not
// nil, is one loop.Bound of the machine for many volumes (detach --all).
// The caller holds v's lock. A volume whose backing file is gone while a
// device of ours still holds it is orphaned: refused unless opts.Force.
func (s *Store) detachDevices(v *Volume, bound map[loop.FileID][]*loop.Device, opts DetachOptions) error {
	s.cleanupTempMount(v)
	ids, present := s.backingIDs(v)
	if bound == nil {
		done, err := s.detachRecorded(v, ids, present, opts)
		if done || err != nil {
			return err
		}
		if bound, err = loop.Bound(ids...); err != nil {
			return fmt.Errorf("detach %s: %w", v.Name, err)
		}
	}
	ours, foreign := s.devicesOf(v, ids, present, bound)
	for _, d := range foreign {
		s.log.Warn("left alone: a loop device someone else bound to the volume's file", "volume", v.Name, "device", d.Path,
			"why", s.ownedHere(v, d, present).Error())
	}
	if len(ours) > 0 && !opts.Force {
		if err := s.orphaned(v, ours); err != nil {
			return fmt.Errorf("detach %s: %w", v.Name, err)
		}
	}
	var deferred error
	for _, dev := range ours {
		if err := s.detachOwn(v, dev); errors.Is(err, loop.ErrDeferred) {
			deferred = err
		} else if err != nil {
			return err
		}
	}
	s.unpublish(v, ours)
	return deferred
}

// detachRecorded is detachDevices for one volume without a look at every
// bound device, where that settles it (done): it detaches the device v's
// link names if it is provably v's (what attach last published for v),
// and is done once v's backing file is open nowhere else (loop.Unshared),
// which proves no other device holds it. Where it cannot prove that (the
// file is still held, is gone, or a device may hold an older file of v's
// recorded identity), done is false and the caller scans. It keeps
// detachDevices' rules: an orphaned volume is refused without opts.Force,
// a busy device is refused, a deferred detach is reported.
func (s *Store) detachRecorded(v *Volume, ids []loop.FileID, present loop.FileID, opts DetachOptions) (done bool, err error) {
	if len(ids) != 1 || ids[0] != present {
		return false, nil // nothing known, or the file was replaced under a device
	}
	var ours []*loop.Device
	if d := linkedDevice(v.UUID); d != nil && d.Backing == ids[0] && v.owner(d.Backing).Check(d) == nil {
		ours = []*loop.Device{d}
		if !opts.Force {
			if err := s.orphaned(v, ours); err != nil {
				return true, fmt.Errorf("detach %s: %w", v.Name, err)
			}
		}
		switch err := s.detachOwn(v, d); {
		case errors.Is(err, loop.ErrDeferred):
			// d holds the file until its last opener closes it.
			s.unpublish(v, ours)
			return true, err
		case err != nil:
			return true, err
		}
	}
	fd, id, err := s.openBacking(v.UUID, unix.O_RDONLY)
	if err != nil {
		return false, nil // gone or unsafe: the scan finds what holds the recorded file
	}
	defer unix.Close(fd)
	if id != ids[0] || !s.unshared(v, fd) {
		return false, nil
	}
	s.unpublish(v, ours)
	return true, nil
}

// detachOwn detaches d, a device proven v's; ErrDeferred (wrapped) if the
// kernel only marked it for detach at its last close. The caller holds v's
// lock.
//
// The device's I/O limits go before the detach, while its number is
// provably v's: once unbound, the number is free for anyone's bind, and
// the attach of another volume that takes it sets its own limits there,
// which a removal after the detach would drop. A detach that leaves the
// device bound (busy, deferred, failed) puts v's limits back.
func (s *Store) detachOwn(v *Volume, d *loop.Device) error {
	s.removeLimits(v, d)
	err := loop.Detach(d.Path, v.owner(d.Backing))
	if err == nil && detachedRace != nil {
		detachedRace(d)
	}
	switch {
	case err == nil, errors.Is(err, loop.ErrNotAttached):
		s.log.Info("volume detached", "volume", v.Name, "uuid", v.UUID, "device", d.Path)
		s.noteDetached(v.UUID, d)
		s.removeIdentity(d)
		return nil
	case errors.Is(err, loop.ErrDeferred):
		// Going away at the opener's last close, which still does I/O
		// through it: limited until then, no longer published. Its
		// identity stays while it is bound, so that an event of it meanwhile
		// does not probe the content; the number names no later binding.
		s.restoreLimits(v, d)
		return fmt.Errorf("detach %s: %w", v.Name, err)
	case errors.Is(err, loop.ErrBusy):
		s.restoreLimits(v, d)
		return fmt.Errorf("detach %s: %w: %w", v.Name, ErrBusy, err)
	}
	s.restoreLimits(v, d)
	return fmt.Errorf("detach %s: %w", v.Name, err)
}

// detachedRace, when a test sets it, runs in detachOwn right after the
// kernel unbound the device: where another bind may take its number.
var detachedRace func(d *loop.Device)

// orphaned returns ErrOrphaned if v's backing file is gone while ours (v's
// devices) still hold its data.
func (s *Store) orphaned(v *Volume, ours []*loop.Device) error {
	if _, err := s.statBacking(v.UUID); !isNotExist(err) || len(ours) == 0 {
		return nil
	}
	return fmt.Errorf("its backing file %s is gone and %s still holds the data; copy it back with `sparsevol recover %s` (or detach with --force to lose it): %w",
		v.BackingFile, ours[0].Path, v.UUID, ErrOrphaned)
}

// lastDevice is the device the last detach of the volume uuid freed, as
// noteDetached recorded it in the volume's lock file, read through the
// fd the caller's lock holds (heldLock); "" if none. What the file says
// is a hint for loop.Attach (AttachOptions.Prefer), which proves it free
// and verifies the binding: it is never trusted.
func (s *Store) lastDevice(uuid string) string {
	fd, ok := s.heldLock(uuid)
	if !ok {
		return ""
	}
	var buf [deviceNoteSize]byte
	n, err := unix.Pread(fd, buf[:], 0)
	if err != nil || n <= 0 {
		return ""
	}
	return strings.TrimSpace(string(buf[:n]))
}

// noteDetached records in the volume's lock file, through the fd the
// caller's lock holds it with (heldLock), the device d its detach just
// freed: the volume's next bind tries it first, sparing the kernel's walk
// for a free device (see lastDevice). Best effort, no flush: a lost note costs
// that walk. The record has a fixed width and overwrites the last one in
// place: truncating a file and writing it again makes ext4 flush it at
// close (auto_da_alloc), which would cost every detach a disk write.
func (s *Store) noteDetached(uuid string, d *loop.Device) {
	var rec [deviceNoteSize]byte
	if len(d.Path) >= len(rec) {
		return
	}
	fd, ok := s.heldLock(uuid)
	if !ok {
		return
	}
	n := copy(rec[:], d.Path)
	copy(rec[n:], strings.Repeat(" ", len(rec)-n-1)+"\n")
	unix.Pwrite(fd, rec[:], 0)
}

// deviceNoteSize is the width of noteDetached's record.
const deviceNoteSize = 32

func linkPath(uuid string) string { return filepath.Join(LinkDir, uuid) }

// setLink points /dev/sparsevol/<uuid> at target, atomically (symlink to a
// temporary name, then rename over).
func setLink(uuid, target string) error {
	if err := fsutil.ReplaceSymlink(target, linkPath(uuid)); err != nil {
		return fmt.Errorf("link %s: %w", linkPath(uuid), err)
	}
	return nil
}

// unpublish removes what attach published for v once its devices (ours,
// just detached) are gone: the attached marker, and the /dev/sparsevol
// link unless it serves a bound device that is not one of ours (another
// store's volume with the same UUID).
func (s *Store) unpublish(v *Volume, ours []*loop.Device) {
	if s.opts.AttachedDir != "" {
		os.Remove(filepath.Join(s.opts.AttachedDir, v.UUID))
	}
	if d := linkedDevice(v.UUID); d != nil && !slices.ContainsFunc(ours, func(o *loop.Device) bool { return o.Path == d.Path }) {
		return
	}
	os.Remove(linkPath(v.UUID))
}

// markAttached leaves the file of Options.AttachedDir that says the volume
// came up completely (fsutil.CreateMarker: never through a link, which
// would make the boot-mode assertion of the unit follow it too). Plain
// open and close: at boot this runs for every volume, and os.File would
// register each with the poller.
func (s *Store) markAttached(uuid string) error {
	if s.opts.AttachedDir == "" {
		return nil
	}
	path := filepath.Join(s.opts.AttachedDir, uuid)
	err := fsutil.CreateMarker(path)
	if errors.Is(err, unix.ENOENT) {
		if err = os.MkdirAll(s.opts.AttachedDir, 0o755); err == nil {
			err = fsutil.CreateMarker(path)
		}
	}
	if err != nil {
		return fmt.Errorf("mark attached: %w; remove what is there, and attach again", err)
	}
	return nil
}

// waitForLink polls until link resolves to dev or one of its partitions,
// or ctx ends.
func waitForLink(ctx context.Context, link, dev string) error {
	// Poll with a backoff: at boot many units wait at once, and tight
	// polling takes the CPU udev needs to make the links. No extra change
	// events either: they flood udev's queue (docs/design.md).
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
// or mounts it by path; fresh tells fn that this call bound the device.
// If fn fails on a device this call attached, the device is detached
// again: a refused operation leaves nothing behind. It costs the same
// whatever the number of devices bound (attachDevice), and the same
// whatever the number of mounts: the Status fn gets has no MountPoints
// (fn reads the mount table it needs itself).
func (s *Store) WithDevice(ctx context.Context, ref string, fn func(st *Status, fresh bool) error) error {
	return s.withVolume(ref, func(v *Volume) error {
		dev, fresh, err := s.attachLocked(ctx, v)
		if err != nil {
			if fresh {
				s.undoAttach(v)
			}
			return err
		}
		held, err := loop.Hold(dev.Path, v.owner(dev.Backing))
		if err != nil {
			return fmt.Errorf("attach %s: %w", v.Name, err)
		}
		err = fn(s.status(v, []*loop.Device{dev}, loop.MountTable{}), fresh)
		held.Close()
		if err != nil && fresh {
			s.undoAttach(v)
		}
		return err
	})
}

// undoAttach detaches the device a failed operation attached (the caller
// holds v's lock); a failure is logged, the operation's error is what
// the caller reports.
func (s *Store) undoAttach(v *Volume) {
	if err := s.detachDevices(v, nil, DetachOptions{}); err != nil {
		s.log.Warn("detach after a failed operation", "volume", v.Name, "error", err)
	}
}
