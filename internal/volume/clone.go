package volume

import (
	"context"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// A volume made from a snapshot (restore) or from another volume (clone)
// is a copy of the source's file (copyFile: shared extents where the store
// can) with an identity of its own (identity.go), then grown to the size
// asked for. It goes through Create's states: a crash leaves it creating,
// for a rerun (which copies afresh) or Delete.
//
// Locks: a clone takes the source volume's lock and the new volume's
// together, by lockAll (in UUID order, see lock), once the new volume is
// reserved, and holds both through the copy (freezing the source's
// filesystem if it is mounted); the source, resolved before, is read
// again under its lock (copyFromVolume). A restore takes the snapshot's
// lock inside the new volume's. Nothing that holds a snapshot's lock
// takes a volume's.

// source is what a volume is copied from, resolved by Create.
type source struct {
	snapshot *Snapshot // restore
	volume   *Volume   // clone
	imported bool      // import: importFD is the checked stream's file
	importFD int
	uuid     string
	// keepIdentity: the copy keeps the identity it has (an import with
	// its UUID kept).
	keepIdentity bool
	sizeBytes    int64
	blockSz      uint32
}

// normalizeSourced checks what a request with a source may say: a size
// (at least the source's, checked by resolveSource), no mkfs options and
// no layout of its own beyond the source's.
func (r *CreateRequest) normalizeSourced() error {
	switch {
	case r.FromSnapshot != "" && r.CloneOf != "":
		return fmt.Errorf("a volume is made from a snapshot or cloned from a volume, not both: %w", ErrInvalid)
	case len(mkfsTokens(r.MkfsOptions)) > 0:
		return fmt.Errorf("mkfs options cannot be given for a copy of a snapshot or volume (nothing is formatted): %w", ErrInvalid)
	case r.NoPartition:
		return fmt.Errorf("no-partition cannot be given for a copy: the layout is the source's: %w", ErrInvalid)
	case r.SizeBytes < 0 || r.SizeBytes > maxSize:
		return fmt.Errorf("size %d is out of range: %w", r.SizeBytes, ErrInvalid)
	}
	if r.SizeBytes > 0 {
		r.SizeBytes = RoundUpMiB(r.SizeBytes)
	}
	return nil
}

// resolveSource finds the request's source (ready) and fills the layout
// and size from it; a mode, filesystem or size that does not fit it is
// ErrInvalid, a source whose record is broken or newer ErrBroken or
// ErrNewer. Requests without
// a source are left alone.
func (s *Store) resolveSource(r *CreateRequest) error {
	var src source
	var mode Mode
	var fsType string
	var partitioned bool
	switch {
	case r.FromSnapshot != "":
		sn, err := s.findSnapshot(r.FromSnapshot)
		if err != nil {
			return err
		}
		if sn.Refusal() != nil {
			// A listing's stand-in: its record says why.
			if sn, err = s.readSnapMeta(sn.UUID); err != nil {
				return err
			}
		}
		if sn.State != StateReady {
			return fmt.Errorf("snapshot %s: state %s: %w", sn.Name, sn.State, ErrNotReady)
		}
		src = source{snapshot: sn, uuid: sn.UUID, sizeBytes: sn.SizeBytes, blockSz: sn.BlockSize}
		mode, fsType, partitioned = sn.Mode, sn.FSType, sn.Partitioned
	case r.CloneOf != "":
		v, err := s.Get(r.CloneOf)
		if err != nil {
			return err
		}
		if v.Refusal() != nil {
			// Get's stand-in: its record says why.
			if v, err = s.readMeta(v.UUID); err != nil {
				return err
			}
		}
		if v.State != StateReady || v.ExpandingTo != 0 {
			return fmt.Errorf("volume %s: state %s: %w", v.Name, stateOf(v), ErrNotReady)
		}
		src = source{volume: v, uuid: v.UUID, sizeBytes: v.SizeBytes, blockSz: v.BlockSize}
		mode, fsType, partitioned = v.Mode, v.FSType, v.Partitioned
	default:
		return nil
	}
	if r.Mode != "" && r.Mode != mode || r.FSType != "" && r.FSType != fsType {
		return fmt.Errorf("the source is a %s volume%s; a copy keeps its mode and filesystem: %w", mode, withFS(fsType), ErrInvalid)
	}
	if r.SizeBytes == 0 {
		r.SizeBytes = src.sizeBytes
	}
	if r.SizeBytes < src.sizeBytes {
		return fmt.Errorf("size %s is below the source's %s: %w", FormatSize(r.SizeBytes), FormatSize(src.sizeBytes), ErrInvalid)
	}
	r.Mode, r.FSType, r.NoPartition = mode, fsType, mode == ModeBlock && !partitioned
	r.source = &src
	return nil
}

func withFS(fsType string) string {
	if fsType == "" {
		return ""
	}
	return " with " + fsType
}

// matches reports whether v (a volume a crashed create left) was made from
// this source: its record notes the source as record would. No source
// matches a volume made from none, and nothing matches an import's, whose
// stream is gone: a create finishing it would hand out the stream's data
// as a new volume's.
func (src *source) matches(v *Volume) bool {
	var want Volume
	src.record(&want)
	return !v.Imported && !want.Imported && v.FromSnapshot == want.FromSnapshot && v.ClonedFrom == want.ClonedFrom
}

// held is what the source's data occupies in the store already, in a
// file of no volume that becomes the new volume's backing file: an
// import's unnamed file (st_blocks); 0 for any other source, whose copy
// is not made yet.
func (src *source) held() int64 {
	if src == nil || !src.imported {
		return 0
	}
	var st unix.Stat_t
	if err := unix.Fstat(src.importFD, &st); err != nil {
		return 0
	}
	return st.Blocks * 512
}

// locks is the volumes whose locks a create of volume uuid from this
// source holds, for lockAll: uuid's, and a clone's source's.
func (src *source) locks(uuid string) []string {
	if src != nil && src.volume != nil {
		return []string{uuid, src.uuid}
	}
	return []string{uuid}
}

// blockSize is the loop block size of a new volume: the source's, since
// its partition table or XFS records it; for a new volume the store's
// choice.
func (src *source) blockSize(root string, mode Mode) uint32 {
	if src == nil {
		return blockSizeForMode(root, mode)
	}
	return src.blockSz
}

// record notes the source in v's metadata.
func (src *source) record(v *Volume) {
	switch {
	case src == nil:
	case src.snapshot != nil:
		v.FromSnapshot = src.uuid
	case src.volume != nil:
		v.ClonedFrom = src.uuid
	case src.imported:
		v.Imported = true
	}
}

// anyCopied reports whether a volume of vols was copied from a snapshot or
// volume, and so may share extents.
func anyCopied(vols []*Volume) bool {
	for _, v := range vols {
		if v.FromSnapshot != "" || v.ClonedFrom != "" {
			return true
		}
	}
	return false
}

// fillFromSource makes v's backing file a copy of the source, at the
// source's size (finishCopy does the rest once a device is bound). The
// caller holds v's lock and, for a clone, the source's.
func (s *Store) fillFromSource(ctx context.Context, v *Volume, req CreateRequest) error {
	if req.source.imported {
		return s.linkImported(v, req.source.importFD)
	}
	dir, err := s.dirFD()
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	fd, err := s.createIn(dir, v.UUID, "backing file", v.BackingFile)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if req.source.snapshot != nil {
		err = s.copyFromSnapshot(ctx, fd, req.source.snapshot, req.Progress)
	} else {
		err = s.copyFromVolume(ctx, fd, req.source, req.Progress)
	}
	if err == nil {
		// The copy is data no mkfs flushes: durable before the record
		// that names it (Create's last, which flushes only metadata).
		err = unix.Fsync(fd)
	}
	if err != nil {
		return &sourceError{err}
	}
	crashPoint("restore:copied")
	return nil
}

// copyFromSnapshot copies the snapshot's file into dst, under the
// snapshot's lock (a delete waits for the copy).
func (s *Store) copyFromSnapshot(ctx context.Context, dst int, sn *Snapshot, progress func(done, total int64)) error {
	unlock, err := s.lock(snapLock(sn.UUID))
	if err != nil {
		return err
	}
	defer unlock()
	sn, err = s.readSnapMeta(sn.UUID)
	if err != nil {
		return err
	}
	src, err := s.openSnapshot(sn)
	if err != nil {
		return err
	}
	defer unix.Close(src)
	if _, err := s.copyFile(ctx, dst, src, sn.SizeBytes, progress); err != nil {
		return fmt.Errorf("copy snapshot %s: %w", sn.Name, err)
	}
	return nil
}

// copyFromVolume copies the backing file of src's volume into dst,
// quiescing it (a mounted filesystem is frozen) for the copy. A copy that
// may be torn (quiesced.settle: a volume in use and written, copied
// over time) is refused with ErrBusy: a clone carries no label saying
// so. The caller holds the volume's lock; the volume is read again
// under it, and one that is no longer ready or no longer of the size src
// was resolved at (expanded since) is ErrNotReady.
func (s *Store) copyFromVolume(ctx context.Context, dst int, src *source, progress func(done, total int64)) error {
	v, err := s.readMeta(src.uuid)
	if err != nil {
		return err
	}
	if v.State != StateReady || v.ExpandingTo != 0 {
		return fmt.Errorf("volume %s: state %s: %w", v.Name, stateOf(v), ErrNotReady)
	}
	if v.SizeBytes != src.sizeBytes {
		return fmt.Errorf("volume %s was resized from %s to %s while the clone waited for its lock; create the clone again: %w",
			v.Name, FormatSize(src.sizeBytes), FormatSize(v.SizeBytes), ErrNotReady)
	}
	fd, _, ours, err := s.openOwned(v, "clone")
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	q, err := s.quiesce(v, ours)
	if err != nil {
		return err
	}
	defer q.release()
	method, err := s.copyFile(ctx, dst, fd, v.SizeBytes, progress)
	if err != nil {
		return fmt.Errorf("copy volume %s: %w", v.Name, err)
	}
	if q.settle(method) == ConsistencyTorn {
		return fmt.Errorf("volume %s was in use and written while it was copied, and this store copies a file over time (its filesystem has no reflink), so the clone may be torn: "+
			"stop what writes to it and clone again, or keep clones of volumes in use on a store on XFS: %w", v.Name, ErrBusy)
	}
	return q.release()
}

// finishCopy proves what the copy on dev (v's device, bound by the
// caller, who holds v's lock) holds (checkCopy), gives it v's identity,
// then grows file, device, partition and filesystem to v's size where it
// is larger than the source's, or where the copy's partition table or
// filesystem ends short of it (copyEndsShort).
func (s *Store) finishCopy(ctx context.Context, v *Volume, dev *loop.Device, src *source) error {
	held, err := loop.Hold(dev.Path, v.owner(dev.Backing))
	if err != nil {
		return fmt.Errorf("copy %s: %w", v.Name, err)
	}
	// What the copy holds is proven before any tool sees it.
	err = s.checkCopy(ctx, v, dev.Path, src.sizeBytes)
	switch {
	case err != nil:
	case !src.keepIdentity:
		err = s.newIdentity(ctx, v, held.Device)
	case v.Mode == ModeFilesystem || v.Partitioned:
		// The copy keeps its identity: it must be the one v's UUID (the
		// header's, which uuidFree found unused here) names. A stream's
		// content is not its header's: a partition GUID of another
		// volume or of the host would share its by-partuuid link.
		err = s.checkIdentity(ctx, v, dev.Path)
	}
	held.Close()
	if err != nil {
		return err
	}
	crashPoint("restore:identity")
	if v.SizeBytes == src.sizeBytes && !s.copyEndsShort(v) {
		return nil
	}
	fd, _, _, err := s.openOwned(v, "copy")
	if err != nil {
		return err
	}
	err = sizeBacking(fd, v.SizeBytes, v.Preallocate)
	unix.Close(fd)
	if err != nil {
		return fmt.Errorf("%s: %w", v.BackingFile, err)
	}
	return s.growDevice(ctx, v, false)
}

// copyEndsShort reports whether the partition table or filesystem of the
// copy v (contentEnd) ends before v's size, or cannot be told to: a
// volume copied between the halves of a CSI expansion
// (ControllerExpandVolume grew its file, NodeExpandVolume has not yet
// grown its filesystem) holds the filesystem of its old size, which
// nothing else would grow. The caller holds v's lock.
func (s *Store) copyEndsShort(v *Volume) bool {
	fd, _, err := s.openBacking(v.UUID, unix.O_RDONLY)
	if err != nil {
		return true // growDevice proves the file, and says what is wrong
	}
	defer unix.Close(fd)
	what, end, err := contentEnd(v, fd)
	return what != "" && (err != nil || end < v.SizeBytes)
}

// sourceError is a failure of the source of a copy (a snapshot's file
// that breaks the backing file rules, a busy source): the new volume's
// own files are not in question, so create rolls it back, whatever the
// class (ErrUnsafe included).
type sourceError struct{ err error }

func (e *sourceError) Error() string { return e.err.Error() }
func (e *sourceError) Unwrap() error { return e.err }
