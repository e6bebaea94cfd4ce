package volume

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
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
)

// Snapshots are files of the store: <root>/.snapshots/<uuid> holds the
// copy of a volume's backing file (shared extents where the store's
// filesystem can, a sparse copy elsewhere), <root>/.snapshots/<uuid>.json
// its metadata, written atomically, in state creating until the copy is
// complete. They follow the backing file rules (backing.go), survive
// reboots, and never get a loop device or a unit. A snapshot is
// independent of its volume: deleting the volume leaves its snapshots.

// snapDir is the store's subdirectory of snapshots.
const snapDir = ".snapshots"

// ErrSnapshotNotFound: no snapshot of that name or UUID. It is an
// ErrNotFound.
var ErrSnapshotNotFound = fmt.Errorf("snapshot: %w", ErrNotFound)

// Consistency says what a snapshot's copy of the volume is.
type Consistency string

const (
	// ConsistencyFrozen: the volume's filesystem was mounted and frozen
	// (FIFREEZE) during the copy: clean, everything written before is in.
	ConsistencyFrozen Consistency = "frozen"
	// ConsistencyQuiet: nothing had the volume mounted or open, and
	// nothing wrote to it, from before the copy to after it.
	ConsistencyQuiet Consistency = "quiet"
	// ConsistencyCrash: a block volume (or an unmounted device) was in
	// use or written, and the copy was a clone (CopyReflink), taken at
	// one instant: it is what a power cut would have left.
	ConsistencyCrash Consistency = "crash-consistent"
	// ConsistencyTorn: the volume was in use or written, and the copy
	// was a sparse copy (CopySparse), which reads the file over time:
	// its parts may be from different moments, a state no power cut
	// leaves, which a filesystem or database on it may not recover from.
	ConsistencyTorn Consistency = "torn"
)

// Snapshot is a point-in-time copy of a volume.
type Snapshot struct {
	// Format is the record's format: RecordFormat when written, what the
	// record says when read.
	Format     int    `json:"format"`
	Name       string `json:"name"`
	UUID       string `json:"uuid"`
	SourceUUID string `json:"sourceUUID"`
	SourceName string `json:"sourceName"`
	// SizeBytes is the source volume's size when the snapshot was taken;
	// a volume made from it is at least that large.
	SizeBytes   int64       `json:"sizeBytes"`
	Mode        Mode        `json:"mode"`
	FSType      string      `json:"fsType,omitempty"`
	Partitioned bool        `json:"partitioned,omitempty"`
	BlockSize   uint32      `json:"blockSize,omitempty"`
	Consistency Consistency `json:"consistency,omitempty"`
	Method      CopyMethod  `json:"method,omitempty"`
	// Group names the group snapshot this one was taken with, if any.
	Group     string            `json:"group,omitempty"`
	State     State             `json:"state"`
	CreatedAt time.Time         `json:"createdAt"`
	Labels    map[string]string `json:"labels,omitempty"`

	// Found anew by every reader, never stored (the sizes by ListSnapshots
	// and GetSnapshot only; CreateSnapshot does not measure):

	// ReadyToUse: state ready, the file complete.
	ReadyToUse bool `json:"readyToUse"`
	// AllocatedBytes is what the snapshot's file occupies, OwnBytes the
	// part of it no other file shares: what deleting it gives back.
	AllocatedBytes int64  `json:"allocatedBytes"`
	OwnBytes       int64  `json:"ownBytes"`
	Problem        string `json:"problem,omitempty"`
	// refusal is the error a stand-in's record was refused with (see
	// Refusal).
	refusal error
}

// Refusal is the error sn's record was refused with where sn is a
// listing's stand-in for it (state broken or newer, see ListSnapshots),
// what every operation on sn returns; nil for a snapshot read from its
// record.
func (sn *Snapshot) Refusal() error { return sn.refusal }

// SnapshotOptions tune CreateSnapshot.
type SnapshotOptions struct {
	// Progress, if set, is called as the copy proceeds (the copy path; a
	// reflink is instant).
	Progress func(done, total int64)
	// Labels carry caller-owned annotations (ValidateLabels).
	Labels map[string]string
	group  string
}

func (s *Store) snapMetaPath(uuid string) string { return filepath.Join(s.root, snapDir, uuid+metaExt) }
func (s *Store) snapPath(uuid string) string     { return filepath.Join(s.root, snapDir, uuid) }
func snapLock(uuid string) string                { return "snapshot-" + uuid }

// snapDirFD opens <root>/.snapshots (storeSubdirFD). The caller closes
// the fd.
func (s *Store) snapDirFD() (int, error) { return s.storeSubdirFD(snapDir, "snapshot directory") }

// writeSnapMeta replaces sn's metadata atomically, flushing as flush says
// (fsutil.Flush): nothing for the creating record (nobody is told of the
// snapshot before its ready record), once for the ready record (with it
// what the copy wrote, see flushCopy), fully otherwise.
func (s *Store) writeSnapMeta(sn *Snapshot, flush fsutil.Flush) error {
	stored := *sn
	stored.Format = RecordFormat
	stored.ReadyToUse, stored.AllocatedBytes, stored.OwnBytes, stored.Problem = false, 0, 0, ""
	data, err := json.MarshalIndent(&stored, "", "  ")
	if err != nil {
		return fmt.Errorf("write metadata of snapshot %s: %w", sn.Name, err)
	}
	data = append(data, '\n')
	if err := s.putRecord(s.snapMetaPath(sn.UUID), data, flush, sn.State == StateDeleting); err != nil {
		return fmt.Errorf("write metadata of snapshot %s: %w", sn.Name, err)
	}
	return nil
}

// readSnapMeta reads snapshot uuid's metadata: missing is
// ErrSnapshotNotFound; of a newer format (decodeRecord) ErrNewer;
// unreadable, naming another snapshot or holding a field check refuses,
// ErrBroken.
func (s *Store) readSnapMeta(uuid string) (*Snapshot, error) {
	path := s.snapMetaPath(uuid)
	data, err := fsutil.ReadRegular(path, maxRecordSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("snapshot %s: %w", uuid, ErrSnapshotNotFound)
	}
	var sn Snapshot
	if err == nil {
		err = decodeRecord(data, &sn)
		if err == nil && sn.UUID != uuid {
			err = fmt.Errorf("the file names snapshot %q", sn.UUID)
		}
		if err == nil {
			err = sn.check()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w: %w", uuid, &os.PathError{Op: "read metadata", Path: path, Err: err}, recordClass(err))
	}
	sn.ReadyToUse = sn.State == StateReady
	return &sn, nil
}

// check applies the rules a snapshot's record must meet before the store
// acts on it (a restore makes a volume of its layout and size):
// checkLayout's, with the sizes a record may hold (sizeKept), a state a
// record holds (checkStoredState), the source volume's UUID (ValidUUID, as
// every volume's) and name (ValidateName, as every volume's), a group
// named as CreateSnapshotGroup names one (or none), labels as
// ValidateLabels admits them, a consistency and a copy method the store
// gives (or none, as records before them), and a valid name. The error
// carries no error class; readSnapMeta makes it ErrBroken.
func (sn *Snapshot) check() error {
	if err := checkLayout(sn.Mode, sn.FSType, sn.Partitioned, sn.SizeBytes, sn.BlockSize, sizeKept); err != nil {
		return err
	}
	if err := checkStoredState(sn.State); err != nil {
		return err
	}
	if !ValidUUID(sn.SourceUUID) {
		return fmt.Errorf("source uuid %q is not a canonical UUID", sn.SourceUUID)
	}
	if err := ValidateName(sn.SourceName); err != nil {
		return fmt.Errorf("source: %w", unclassified(err))
	}
	if sn.Group != "" {
		if err := ValidateName(sn.Group); err != nil {
			return fmt.Errorf("group: %w", unclassified(err))
		}
	}
	if err := ValidateLabels(sn.Labels); err != nil {
		return unclassified(err)
	}
	switch sn.Consistency {
	case "", ConsistencyFrozen, ConsistencyQuiet, ConsistencyCrash, ConsistencyTorn:
	default:
		return fmt.Errorf("consistency %s is none a snapshot is taken with", Quote(string(sn.Consistency)))
	}
	switch sn.Method {
	case "", CopyReflink, CopySparse:
	default:
		return fmt.Errorf("copy method %s is none a snapshot is copied with", Quote(string(sn.Method)))
	}
	return unclassified(ValidateName(sn.Name))
}

func (s *Store) removeSnapMeta(uuid string) error {
	if err := os.Remove(s.snapMetaPath(uuid)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove metadata of snapshot %s: %w", uuid, err)
	}
	return fsutil.SyncDir(filepath.Join(s.root, snapDir))
}

// readSnapDir lists the snapshot directory (none yet: nothing). One that
// is not a directory of its own (a symbolic link to one elsewhere) is
// ErrUnsafe: nothing in it is read.
func (s *Store) readSnapDir() ([]os.DirEntry, error) {
	dir := filepath.Join(s.root, snapDir)
	fi, err := os.Lstat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("list snapshots of %s: %w", s.root, err)
	case !fi.IsDir():
		return nil, fmt.Errorf("snapshot directory %s is not a directory (a symbolic link?); inspect it with `ls -ld %s`: %w", dir, dir, ErrUnsafe)
	}
	f, err := fsutil.OpenDir(dir)
	if err != nil {
		return nil, fmt.Errorf("list snapshots of %s: %w", s.root, err)
	}
	entries, err := f.ReadDir(-1)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("list snapshots of %s: %w", s.root, err)
	}
	slices.SortFunc(entries, func(a, b os.DirEntry) int { return strings.Compare(a.Name(), b.Name()) })
	return entries, nil
}

// snapshotUUIDs lists the UUIDs of the snapshot metadata files.
func (s *Store) snapshotUUIDs() ([]string, error) {
	entries, err := s.readSnapDir()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		if uuid, ok := strings.CutSuffix(e.Name(), metaExt); ok && ValidUUID(uuid) {
			out = append(out, uuid)
		}
	}
	return out, nil
}

// ListSnapshots returns every snapshot of the store, in every state,
// sorted by name; one whose metadata cannot be read is listed in state
// broken, named by its UUID, one whose record a newer sparsevol wrote in
// state newer, named as standInHead says.
func (s *Store) ListSnapshots(ctx context.Context) ([]*Snapshot, error) {
	sns, err := s.listSnapshots()
	if err != nil {
		return nil, err
	}
	s.measureSnapshots(sns)
	return sns, nil
}

// listSnapshots is ListSnapshots without measuring the files.
func (s *Store) listSnapshots() ([]*Snapshot, error) {
	uuids, err := s.snapshotUUIDs()
	if err != nil {
		return nil, err
	}
	var out []*Snapshot
	for _, uuid := range uuids {
		sn, err := s.readSnapMeta(uuid)
		switch {
		case errors.Is(err, ErrNotFound):
			continue // deleted while we listed
		case errors.Is(err, ErrBroken), errors.Is(err, ErrNewer):
			state, h := standInHead(uuid, err)
			sn = &Snapshot{Format: h.Format, Name: h.Name, UUID: uuid, State: state, Labels: h.Labels, Problem: err.Error(), refusal: err}
		case err != nil:
			return nil, err
		}
		out = append(out, sn)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// GetSnapshot resolves a snapshot by UUID or name.
func (s *Store) GetSnapshot(ctx context.Context, ref string) (*Snapshot, error) {
	sn, err := s.findSnapshot(ref)
	if err != nil {
		return nil, err
	}
	s.measureSnapshots([]*Snapshot{sn})
	return sn, nil
}

func (s *Store) findSnapshot(ref string) (*Snapshot, error) {
	if ref == "" {
		return nil, fmt.Errorf("empty snapshot reference: %w", ErrInvalid)
	}
	sns, err := s.listSnapshots()
	if err != nil {
		return nil, err
	}
	for _, sn := range sns {
		if sn.UUID == strings.ToLower(ref) {
			return sn, nil
		}
	}
	for _, sn := range sns {
		if sn.Name == ref {
			return sn, nil
		}
	}
	return nil, fmt.Errorf("snapshot %s: %w", Quote(ref), ErrSnapshotNotFound)
}

// CreateSnapshot takes a snapshot named name of the volume ref (see
// createSnapshot). It is idempotent: a ready snapshot of that name and
// source is returned as it is, one a crash left unfinished is made anew;
// the name taken by a snapshot of another volume is ErrExists.
func (s *Store) CreateSnapshot(ctx context.Context, volumeRef, name string, opts SnapshotOptions) (*Snapshot, error) {
	if err := ValidateName(name); err != nil {
		return nil, fmt.Errorf("snapshot of %s: %w", Quote(volumeRef), err)
	}
	if err := ValidateLabels(opts.Labels); err != nil {
		return nil, fmt.Errorf("snapshot %s of %s: %w", name, Quote(volumeRef), err)
	}
	var out *Snapshot
	err := s.withVolume(volumeRef, func(v *Volume) error {
		sns, err := s.snapshotVolumes(ctx, []*Volume{v}, []string{name}, opts)
		if err == nil {
			out = sns[0]
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot %s of %s: %w", name, Quote(volumeRef), err)
	}
	return out, nil
}

// groupPhrase names group g in a message.
func groupPhrase(g string) string {
	if g == "" {
		return "of no group"
	}
	return fmt.Sprintf("of group %q", g)
}

// CreateSnapshotGroup snapshots the volumes refs at one point in time:
// every mounted member is frozen, all are copied, all are thawed. The
// member snapshots are named <name>-<volume name> and carry the group's
// name, in the order of refs. Idempotent as CreateSnapshot.
func (s *Store) CreateSnapshotGroup(ctx context.Context, volumeRefs []string, name string, opts SnapshotOptions) ([]*Snapshot, error) {
	if err := ValidateName(name); err != nil {
		return nil, fmt.Errorf("group snapshot: %w", err)
	}
	if err := ValidateLabels(opts.Labels); err != nil {
		return nil, fmt.Errorf("group snapshot %s: %w", name, err)
	}
	if len(volumeRefs) == 0 {
		return nil, fmt.Errorf("group snapshot %s: no volumes: %w", name, ErrInvalid)
	}
	var uuids []string
	for _, ref := range volumeRefs {
		v, err := s.Get(ref)
		if err != nil {
			return nil, fmt.Errorf("group snapshot %s: %w", name, err)
		}
		// Refused before any lock: a volume still being created (a create
		// holds its lock through the copy or mkfs) is never waited for.
		if v.State != StateReady {
			return nil, fmt.Errorf("group snapshot %s: volume %s: state %s: %w", name, v.Name, v.State, ErrNotReady)
		}
		uuids = append(uuids, v.UUID)
	}
	locked, err := s.lockAll(uuids)
	if err != nil {
		return nil, fmt.Errorf("group snapshot %s: %w", name, err)
	}
	defer unlockAll(locked)
	if len(locked) != len(uuids) {
		return nil, fmt.Errorf("group snapshot %s: a volume is named twice: %w", name, ErrInvalid)
	}
	// In the order of refs: the members come back in it.
	vols := make([]*Volume, len(uuids))
	names := make([]string, len(uuids))
	for i, uuid := range uuids {
		v, err := s.readMeta(uuid)
		if err != nil {
			return nil, fmt.Errorf("group snapshot %s: %w", name, err)
		}
		vols[i], names[i] = v, name+"-"+v.Name
		if err := ValidateName(names[i]); err != nil {
			return nil, fmt.Errorf("group snapshot %s: member of %s: %w", name, v.Name, err)
		}
	}
	opts.group = name
	sns, err := s.snapshotVolumes(ctx, vols, names, opts)
	if err != nil {
		return nil, fmt.Errorf("group snapshot %s: %w", name, err)
	}
	return sns, nil
}

// snapshotVolumes snapshots vols (whose locks the caller holds) as
// names[i]: reserve each (state creating), lock each one it makes
// (claimCreating) until it is ready or undone, quiesce all, copy each,
// release all, flush each copy, mark each ready. A failure removes what
// this call made and leaves the snapshots that were ready before.
func (s *Store) snapshotVolumes(ctx context.Context, vols []*Volume, names []string, opts SnapshotOptions) (out []*Snapshot, err error) {
	sns := make([]*Snapshot, len(vols))
	var todo []int
	for i, v := range vols {
		if v.State != StateReady || v.ExpandingTo != 0 {
			return nil, fmt.Errorf("volume %s: state %s: %w", v.Name, stateOf(v), ErrNotReady)
		}
		sn, err := s.reserveSnapshot(v, names[i], opts)
		if err != nil {
			s.undoSnapshots(sns)
			return nil, err
		}
		if sn.State == StateReady {
			sns[i] = sn
			continue
		}
		sns[i] = sn
		todo = append(todo, i)
	}
	if len(todo) == 0 {
		return sns, nil
	}
	made := make([]*Snapshot, 0, len(todo))
	for _, i := range todo {
		made = append(made, sns[i])
	}
	// Released after the undo below (defers run last first).
	var held []func()
	defer func() {
		for _, unlock := range held {
			unlock()
		}
	}()
	defer func() {
		if err != nil {
			s.undoSnapshots(made)
		}
	}()
	if snapshotRace != nil {
		snapshotRace("reserved", made)
	}
	for _, sn := range made {
		unlock, err := s.claimCreating(sn)
		if err != nil {
			return nil, err
		}
		held = append(held, unlock)
	}
	crashPoint("snapshot:reserved")
	srcs := make([]int, len(vols))
	for i := range srcs {
		srcs[i] = -1
	}
	defer func() {
		for _, fd := range srcs {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
	}()
	var quiet []*quiesced
	defer func() {
		for _, q := range quiet {
			q.release()
		}
	}()
	for _, i := range todo {
		fd, _, ours, err := s.openOwned(vols[i], "snapshot")
		if err != nil {
			return nil, err
		}
		srcs[i] = fd
		q, err := s.quiesce(vols[i], ours)
		if err != nil {
			return nil, err
		}
		quiet = append(quiet, q)
	}
	crashPoint("snapshot:frozen")
	dsts := make([]int, 0, len(todo))
	defer func() {
		for _, fd := range dsts {
			unix.Close(fd)
		}
	}()
	// How long each copy and each flush took, for the log.
	copied, flushed := make([]time.Duration, len(todo)), make([]time.Duration, len(todo))
	for k, i := range todo {
		start := time.Now()
		method, dst, err := s.copyIntoSnapshot(ctx, sns[i], srcs[i], opts.Progress)
		if err != nil {
			return nil, err
		}
		copied[k] = time.Since(start)
		dsts = append(dsts, dst)
		sns[i].Method = method
		sns[i].Consistency = quiet[k].settle(method)
	}
	crashPoint("snapshot:copied")
	if snapshotRace != nil {
		snapshotRace("copied", made)
	}
	for _, q := range quiet {
		if err := q.release(); err != nil {
			return nil, err
		}
		if q.frozen != nil {
			s.log.Info("filesystem frozen for snapshot", "mount", q.frozen.path, "held", q.frozen.heldFor())
		}
	}
	// The copies are complete; flushing them needs no frozen source.
	for k, i := range todo {
		start := time.Now()
		if err := flushCopy(dsts[k], sns[i].Method); err != nil {
			return nil, fmt.Errorf("copy into %s: %w", s.snapPath(sns[i].UUID), err)
		}
		flushed[k] = time.Since(start)
	}
	for k, i := range todo {
		sns[i].State = StateReady
		sns[i].ReadyToUse = true
		start := time.Now()
		if err := s.writeSnapMeta(sns[i], fsutil.FlushOnce); err != nil {
			return nil, err
		}
		s.log.Info("snapshot created", "snapshot", sns[i].Name, "uuid", sns[i].UUID, "volume", vols[i].Name,
			"method", sns[i].Method, "consistency", sns[i].Consistency,
			"copy", copied[k], "flush", flushed[k], "record", time.Since(start))
	}
	crashPoint("snapshot:ready")
	return sns, nil
}

func stateOf(v *Volume) State {
	if v.State == StateReady && v.ExpandingTo != 0 {
		return StateExpanding
	}
	return v.State
}

// reserveSnapshot records snapshot name of v in state creating, under the
// store lock (after v's, as expand takes them), after checking the name
// and the space the copy may take. A snapshot of that name, source and
// group (opts.group, "" for none) that exists is returned as it is
// (ready, or creating: made anew by the caller); one of another source or
// group is ErrExists: a plain snapshot is never taken for a group's
// member, nor a member for a plain snapshot.
func (s *Store) reserveSnapshot(v *Volume, name string, opts SnapshotOptions) (*Snapshot, error) {
	unlock, err := s.lock(storeLock)
	if err != nil {
		return nil, err
	}
	defer unlock()
	sns, err := s.listSnapshots()
	if err != nil {
		return nil, err
	}
	for _, sn := range sns {
		if sn.Name != name {
			continue
		}
		if sn.Refusal() != nil {
			// A stand-in: its source is not known, its record says why.
			return nil, fmt.Errorf("snapshot name %q is taken: %s: %w", name, sn.Problem, ErrExists)
		}
		if sn.SourceUUID != v.UUID {
			return nil, fmt.Errorf("snapshot name %q is taken by a snapshot of volume %s: %w", name, sn.SourceName, ErrExists)
		}
		if sn.Group != opts.group {
			return nil, fmt.Errorf("snapshot name %q is taken by a snapshot %s: %w", name, groupPhrase(sn.Group), ErrExists)
		}
		if sn.State == StateReady || sn.State == StateCreating {
			return sn, nil
		}
		return nil, fmt.Errorf("snapshot %q is %s; delete it first: %w", name, sn.State, ErrNotReady)
	}
	// A copy may cost as much as the volume holds: the policy counts a
	// snapshot's allocation as promised (it never grows beyond it). The
	// snapshots listed above are the ones the policy counts.
	vols, err := s.List()
	if err != nil {
		return nil, err
	}
	if err := s.checkSpaceIn(vols, sns, s.allocated(v.UUID), 0, false); err != nil {
		return nil, err
	}
	dir, err := s.snapDirFD() // made here, the first time
	if err != nil {
		return nil, err
	}
	unix.Close(dir)
	sn := &Snapshot{
		Name: name, UUID: NewUUID(), SourceUUID: v.UUID, SourceName: v.Name,
		SizeBytes: v.SizeBytes, Mode: v.Mode, FSType: v.FSType, Partitioned: v.Partitioned,
		BlockSize: v.BlockSize, Group: opts.group, State: StateCreating,
		CreatedAt: time.Now().UTC().Truncate(time.Second), Labels: maps.Clone(opts.Labels),
	}
	if err := s.writeSnapMeta(sn, fsutil.FlushNone); err != nil {
		return nil, err
	}
	return sn, nil
}

// snapshotRace, if set (tests only), runs in snapshotVolumes after the
// snapshots are reserved ("reserved") and after they are copied
// ("copied"), with the snapshots this call makes.
var snapshotRace func(step string, made []*Snapshot)

// claimCreating takes the lock of sn, a snapshot this call reserved, and
// proves under it that sn is still recorded as creating: a delete that
// ran between the reservation and the lock removed it, and the create
// stops with ErrNotReady instead of writing the file and a ready record
// anew. The caller holds sn's lock (the returned function releases it)
// until sn is ready or undone, so a delete waits for the outcome.
func (s *Store) claimCreating(sn *Snapshot) (func(), error) {
	unlock, err := s.lock(snapLock(sn.UUID))
	if err != nil {
		return nil, err
	}
	cur, err := s.readSnapMeta(sn.UUID)
	if err == nil && cur.State != StateCreating {
		err = fmt.Errorf("state %s", cur.State)
	}
	if err != nil {
		unlock()
		return nil, fmt.Errorf("snapshot %q is no longer being created (%v: deleted meanwhile?); create it again: %w", sn.Name, err, ErrNotReady)
	}
	return unlock, nil
}

// copyIntoSnapshot copies the open backing file src into the snapshot's
// file, made anew (a crashed run's is truncated first), and returns it
// open, not flushed: the caller flushes it (flushCopy) once the source is
// released, and closes it. The file's name (and a clone on XFS) become
// durable with the ready record's flush (FlushOnce), which follows. The
// caller holds the snapshot's lock (claimCreating).
func (s *Store) copyIntoSnapshot(ctx context.Context, sn *Snapshot, src int, progress func(done, total int64)) (CopyMethod, int, error) {
	dir, err := s.snapDirFD()
	if err != nil {
		return "", -1, err
	}
	defer unix.Close(dir)
	dst, err := s.createIn(dir, sn.UUID, "snapshot file", s.snapPath(sn.UUID))
	if err != nil {
		return "", -1, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(src, &st); err != nil {
		unix.Close(dst)
		return "", -1, fmt.Errorf("stat source of snapshot %s: %w", sn.Name, err)
	}
	method, err := s.copyFile(ctx, dst, src, st.Size, progress)
	if err != nil {
		unix.Close(dst)
		return "", -1, fmt.Errorf("copy into %s: %w", s.snapPath(sn.UUID), s.inStore(err))
	}
	return method, dst, nil
}

// createIn makes the file name in dir empty and open for writing: a new
// file (O_EXCL), or one a crashed run left, proven by the backing file
// rules and truncated. The caller closes the fd.
func (s *Store) createIn(dir int, name, kind, path string) (int, error) {
	fd, err := unix.Openat(dir, name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if errors.Is(err, unix.EEXIST) {
		fd, _, err = s.openIn(dir, name, kind, path, unix.O_RDWR)
		if err != nil {
			return -1, err
		}
		if err := unix.Ftruncate(fd, 0); err != nil {
			unix.Close(fd)
			return -1, &os.PathError{Op: "truncate", Path: path, Err: err}
		}
		return fd, nil
	}
	if err != nil {
		return -1, s.inStore(&os.PathError{Op: "create", Path: path, Err: err})
	}
	return fd, nil
}

// undoSnapshots removes snapshots a failed create made (file, then
// metadata); a failure is logged and leaves the snapshot creating, for a
// rerun or DeleteSnapshot.
func (s *Store) undoSnapshots(sns []*Snapshot) {
	for _, sn := range sns {
		if sn == nil || sn.State == StateReady {
			continue
		}
		if err := s.removeSnapshot(sn); err != nil {
			s.log.Warn("failed snapshot left in state creating", "snapshot", sn.Name, "uuid", sn.UUID, "error", err)
		}
	}
}

// DeleteSnapshot removes a snapshot: marked deleting, its file, its
// metadata. A crash midway leaves it deleting, for the next delete. A
// snapshot's file that breaks the backing file rules is refused and left,
// and so is a snapshot whose record a newer sparsevol wrote (ErrNewer).
func (s *Store) DeleteSnapshot(ctx context.Context, ref string) error {
	sn, err := s.findSnapshot(ref)
	if err != nil {
		return err
	}
	unlock, err := s.lock(snapLock(sn.UUID))
	if err != nil {
		return err
	}
	defer unlock()
	if sn.State != StateBroken {
		if sn, err = s.readSnapMeta(sn.UUID); err != nil {
			return fmt.Errorf("delete snapshot %s: %w", Quote(ref), err)
		}
		if sn.State != StateDeleting {
			sn.State = StateDeleting
			if err := s.writeSnapMeta(sn, fsutil.FlushAll); err != nil {
				return err
			}
		}
	}
	crashPoint("snapshot-delete:marked")
	if err := s.removeSnapshot(sn); err != nil {
		return fmt.Errorf("delete snapshot %s: %w", sn.Name, err)
	}
	s.log.Info("snapshot deleted", "snapshot", sn.Name, "uuid", sn.UUID)
	return nil
}

// removeSnapshot removes sn's file (if it follows the rules) and then its
// metadata.
func (s *Store) removeSnapshot(sn *Snapshot) error {
	dir, err := s.snapDirFD()
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	switch _, err := s.statIn(dir, sn.UUID, "snapshot file", s.snapPath(sn.UUID)); {
	case isNotExist(err):
	case err != nil:
		return fmt.Errorf("%w (remove it yourself once you know what it is, then delete again)", err)
	default:
		if err := unix.Unlinkat(dir, sn.UUID, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return &os.PathError{Op: "remove", Path: s.snapPath(sn.UUID), Err: err}
		}
	}
	crashPoint("snapshot-delete:file")
	return s.removeSnapMeta(sn.UUID)
}

// openSnapshot opens a ready snapshot's file read-only (the backing file
// rules apply). The caller closes the fd.
func (s *Store) openSnapshot(sn *Snapshot) (int, error) {
	if sn.State != StateReady {
		return -1, fmt.Errorf("snapshot %s: state %s: %w", sn.Name, sn.State, ErrNotReady)
	}
	dir, err := s.snapDirFD()
	if err != nil {
		return -1, err
	}
	defer unix.Close(dir)
	fd, _, err := s.openIn(dir, sn.UUID, "snapshot file", s.snapPath(sn.UUID), unix.O_RDONLY)
	if err != nil {
		return -1, fmt.Errorf("snapshot %s: %w", sn.Name, err)
	}
	return fd, nil
}

// quiesced is a volume made ready for a copy of its backing file.
type quiesced struct {
	// consistency is what quiesce found: frozen, quiet (nothing used
	// the devices), or crash-consistent (something did).
	consistency Consistency
	// idle are the devices of a volume not frozen with their write
	// counters, read after their flush, for settle; unproven if a
	// device's could not be read or had a write in flight.
	idle     []idleDevice
	unproven bool
	frozen   *frozen
	store    *Store
	uuid     string // the volume's, whose freeze note a thaw clears
}

type idleDevice struct {
	dev    *loop.Device
	writes loop.Writes
}

// settle says what a copy of the volume's file made by method since
// quiesce is; it is called once the copy is complete, before release.
// This is the one home of the rule that a label promising one point in
// time is earned: frozen, as quiesce froze it; quiet only if every device
// quiesce found unused is unused still and the kernel counted no write
// to it in between (a writer that opened, wrote and closed between the
// two Busy checks moves the counters); otherwise crash-consistent for a
// clone, taken at one instant, and for a sparse copy of devices the
// kernel counted no write to in between (one state, read over time);
// torn for a sparse copy of devices that may have been written.
func (q *quiesced) settle(method CopyMethod) Consistency {
	c := q.consistency
	if c == ConsistencyFrozen {
		return c
	}
	unwritten := !q.unproven && !slices.ContainsFunc(q.idle, func(d idleDevice) bool {
		w, err := loop.WritesOf(d.dev)
		return err != nil || w != d.writes || !w.Idle()
	})
	if c == ConsistencyQuiet && (!unwritten || slices.ContainsFunc(q.idle, func(d idleDevice) bool { return loop.Busy(d.dev.Path) != nil })) {
		c = ConsistencyCrash
	}
	if c == ConsistencyCrash && method != CopyReflink && !unwritten {
		return ConsistencyTorn
	}
	return c
}

// release thaws what quiesce froze (safe to call more than once) and,
// once the thaw is done, removes the volume's freeze note.
func (q *quiesced) release() error {
	if q.frozen == nil {
		return nil
	}
	err := q.frozen.thaw()
	if q.frozen.thawed() {
		q.store.clearFreezeNote(q.uuid)
	}
	return err
}

// quiesce makes what the volume's devices (ours, proven by the caller)
// hold reach the backing file: a mounted filesystem is frozen (which
// flushes it), and every device's buffers are flushed; of a volume not
// frozen, the devices' write counters are read then, for settle.
// The caller holds v's lock, settles the result after its copy where it
// labels the copy or refuses a torn one, and releases it.
func (s *Store) quiesce(v *Volume, ours []*loop.Device) (*quiesced, error) {
	q := &quiesced{consistency: ConsistencyQuiet}
	if len(ours) == 0 {
		return q, nil
	}
	dev := ours[0]
	data, _ := dataDevice(v, dev)
	if v.Mode == ModeFilesystem && data != "" {
		mounts, err := loop.ReadMountTable().Of(data)
		if err != nil {
			return nil, fmt.Errorf("volume %s: %w", v.Name, err)
		}
		if len(mounts) > 0 {
			var st unix.Stat_t
			if err := unix.Stat(data, &st); err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			// The note outlives this process where the guard cannot
			// (ThawLeftovers): written before the freeze, cleared after
			// the thaw, or after a freeze that froze nothing.
			if err := s.noteFreeze(v.UUID); err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			f, err := freeze(mounts, st.Rdev, s.opts.FreezeTimeout, s.freezeNotePath(v.UUID))
			if err != nil {
				if !errors.Is(err, ErrBusy) { // else FIFREEZE may still freeze
					s.clearFreezeNote(v.UUID)
				}
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			q.frozen, q.consistency, q.store, q.uuid = f, ConsistencyFrozen, s, v.UUID
		}
	}
	for _, d := range ours {
		if q.frozen == nil && loop.Busy(d.Path) != nil {
			q.consistency = ConsistencyCrash
		}
		if err := flushDevice(d, v.owner(d.Backing)); err != nil {
			q.release()
			return nil, fmt.Errorf("volume %s: %w", v.Name, err)
		}
	}
	for _, d := range ours {
		if q.frozen != nil {
			break
		}
		w, err := loop.WritesOf(d)
		if err != nil || !w.Idle() {
			// Unproven: nothing shows a writer did not come and go.
			q.consistency, q.idle, q.unproven = ConsistencyCrash, nil, true
			break
		}
		q.idle = append(q.idle, idleDevice{d, w})
	}
	return q, nil
}

// flushDevice writes what the kernel buffers for the device d to its
// backing file (fsync of the block device), after proving it owner's.
func flushDevice(d *loop.Device, owner loop.Owner) error {
	held, err := loop.Hold(d.Path, owner)
	if err != nil {
		return err
	}
	defer held.Close()
	return held.Sync()
}

// StrayFiles lists what lies in the snapshot directory without being a
// snapshot's file or metadata: a file whose metadata is gone, a temporary
// file a killed writer left. Nothing reads or removes them; doctor shows
// them for the operator.
func (s *Store) StrayFiles() ([]string, error) {
	entries, err := s.readSnapDir()
	if err != nil {
		return nil, err
	}
	known := map[string]bool{}
	for _, e := range entries {
		if uuid, ok := strings.CutSuffix(e.Name(), metaExt); ok && ValidUUID(uuid) {
			known[uuid], known[e.Name()] = true, true
		}
	}
	var out []string
	for _, e := range entries {
		if !known[e.Name()] {
			out = append(out, filepath.Join(s.root, snapDir, e.Name()))
		}
	}
	return out, nil
}
