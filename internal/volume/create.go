package volume

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/loop"
)

// CreateRequest describes a new volume.
type CreateRequest struct {
	Name        string
	UUID        string // empty: generate one
	SizeBytes   int64  // rounded up to a MiB
	Mode        Mode   // default filesystem
	FSType      string // default ext4 for filesystem mode
	NoPartition bool   // block mode: whole-device raw volume, no GPT
	MkfsOptions []string
	Preallocate bool
	DirectIO    *bool // nil: the store default
	// Labels carry caller-owned annotations (ValidateLabels).
	Labels map[string]string
	// IOLimits are enforced on the volume's device whenever it is
	// attached.
	IOLimits IOLimits
	// KeepAttached leaves the loop device attached after create (and
	// starts the unit, with a Lifecycle); otherwise create detaches it
	// again and attaching is left to the unit or caller.
	KeepAttached bool
	// FromSnapshot and CloneOf (a name or UUID; at most one) make the
	// volume a copy of a snapshot or of another volume instead of
	// formatting it: mode, filesystem and layout are the source's, the
	// size at least the source's (0: the same), and the copy gets the
	// new volume's identity (see clone.go).
	FromSnapshot string
	CloneOf      string
	// Progress, if set, is called as a copy from a source proceeds.
	Progress func(done, total int64)
	source   *source // resolved by Create
}

// Normalize fills defaults and checks the whole request (name, labels,
// UUID, layout, size) without touching anything: the one home of the
// rules a new volume must meet. Create calls it; callers may call it
// first to refuse a request early. Errors wrap ErrInvalid.
func (r *CreateRequest) Normalize() error {
	if err := ValidateName(r.Name); err != nil {
		return err
	}
	if err := ValidateLabels(r.Labels); err != nil {
		return err
	}
	if r.FromSnapshot != "" || r.CloneOf != "" {
		if err := r.normalizeSourced(); err != nil {
			return err
		}
	}
	if r.UUID != "" {
		r.UUID = strings.ToLower(r.UUID)
		if !ValidUUID(r.UUID) {
			return fmt.Errorf("uuid %s is not of the form xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx: %w", Quote(r.UUID), ErrInvalid)
		}
		if r.UUID == nilUUID {
			return fmt.Errorf("uuid %s is the nil UUID, which names no filesystem: %w", r.UUID, ErrInvalid)
		}
	}
	if r.FromSnapshot != "" || r.CloneOf != "" {
		return nil // the layout and size are checked against the source
	}
	if err := r.NormalizeLayout(); err != nil {
		return err
	}
	if err := r.IOLimits.Validate(); err != nil {
		return fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	return r.NormalizeSize()
}

// NormalizeSize rounds the size up to a whole MiB and checks it against
// the bounds of the layout (call NormalizeLayout first). Errors wrap
// ErrInvalid.
func (r *CreateRequest) NormalizeSize() error {
	if err := checkSize(r.SizeBytes); err != nil {
		return err
	}
	r.SizeBytes = RoundUpMiB(r.SizeBytes)
	if minimum := MinSize(r.FSType); r.SizeBytes < minimum {
		return fmt.Errorf("size %s is below the minimum of %s for %s: %w", FormatSize(r.SizeBytes), FormatSize(minimum), r.kind(), ErrInvalid)
	}
	return nil
}

// checkSize is the rule for a size a volume is asked to have, made or
// grown: positive, and at most maxSize, so that rounding and the store's
// space arithmetic cannot overflow. Errors wrap ErrInvalid.
func checkSize(n int64) error {
	if n <= 0 {
		return fmt.Errorf("size must be positive: %w", ErrInvalid)
	}
	if n > maxSize {
		return fmt.Errorf("size %d is too large (at most %s): %w", n, FormatSize(maxSize+1), ErrInvalid)
	}
	return nil
}

// NormalizeLayout fills defaults and checks what the volume will hold:
// mode, filesystem, partitioning and mkfs options (tokenised and checked
// against the allow-list). With NormalizeSize it is the part of Normalize
// for callers that choose the size after the filesystem (the CSI driver
// raises a capacity range to the filesystem's minimum) and know no name.
// Errors wrap ErrInvalid.
func (r *CreateRequest) NormalizeLayout() error {
	if r.Mode == "" {
		r.Mode = ModeFilesystem
	}
	switch r.Mode {
	case ModeFilesystem:
		if r.FSType == "" {
			r.FSType = "ext4"
		}
		if _, ok := mkfsAllowed[r.FSType]; !ok {
			return fmt.Errorf("filesystem %s is not supported (ext4, xfs): %w", Quote(r.FSType), ErrInvalid)
		}
		if r.NoPartition {
			return fmt.Errorf("no-partition applies to block mode only: %w", ErrInvalid)
		}
	case ModeBlock:
		if r.FSType != "" {
			return fmt.Errorf("a filesystem (%s) cannot be given for a block mode volume: %w", Quote(r.FSType), ErrInvalid)
		}
	default:
		return fmt.Errorf("mode %s is not supported (filesystem, block): %w", Quote(string(r.Mode)), ErrInvalid)
	}
	opts, err := NormalizeMkfsOptions(r.FSType, r.MkfsOptions)
	if err != nil {
		return err
	}
	r.MkfsOptions = opts
	return nil
}

func (r *CreateRequest) kind() string {
	if r.Mode == ModeBlock {
		return "block volumes"
	}
	return r.FSType
}

func (r *CreateRequest) compatible(v *Volume) bool {
	return v.SizeBytes == r.SizeBytes && v.Mode == r.Mode && v.FSType == r.FSType &&
		v.Partitioned == (r.Mode == ModeBlock && !r.NoPartition) &&
		v.Preallocate == r.Preallocate && v.IOLimits == r.IOLimits && slices.Equal(mkfsTokens(v.MkfsOptions), r.MkfsOptions) &&
		(r.UUID == "" || r.UUID == v.UUID) && r.source.matches(v) && maps.Equal(v.Labels, r.Labels)
}

// Create makes a volume: metadata (state creating), sparse file, loop
// device, filesystem or partition table, metadata (state ready). A crash
// at any step leaves a volume in state creating that a rerun of the same
// Create finishes and Delete removes; it is never reported ready.
//
// Creating a name that exists returns ErrExists, unless the existing volume
// is unfinished and the request is the same, in which case it is finished.
func (s *Store) Create(ctx context.Context, req CreateRequest) (*Volume, error) {
	if err := req.Normalize(); err != nil {
		return nil, fmt.Errorf("create %s: %w", Quote(req.Name), err)
	}
	if err := s.CheckLimits(req.IOLimits); err != nil {
		return nil, fmt.Errorf("create %s: %w", req.Name, err)
	}
	if err := s.resolveSource(&req); err != nil {
		return nil, fmt.Errorf("create %s: %w", req.Name, err)
	}
	v, err := s.reserve(req)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", req.Name, err)
	}
	locked, err := s.lockAll(req.source.locks(v.UUID))
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", req.Name, err)
	}
	defer unlockAll(locked)
	// Another create of the same name may have finished (or a delete
	// removed it) while we waited: decide on what is there now, so a
	// retried create never formats a volume that became ready.
	v, err = s.readMeta(v.UUID)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", req.Name, err)
	}
	if v.State != StateCreating {
		return nil, fmt.Errorf("create %s: name is taken by volume %s (%s): %w", req.Name, v.UUID, v.State, ErrExists)
	}
	if err := s.build(ctx, v, req); err != nil {
		return nil, fmt.Errorf("create %s: %w", req.Name, err)
	}
	if req.KeepAttached {
		// Not under the locks: the unit's attach takes v's.
		unlockAll(locked)
		if err := s.startUnit(ctx, v); err != nil {
			return nil, fmt.Errorf("create %s: %w", req.Name, err)
		}
	}
	return v, nil
}

// finishAdvice says how v, left unready by a crash, is finished or
// removed: a create's by the same create again, or delete; an import's
// only by delete (a create never finishes it, see source.matches), and a
// rerun of the import after; a delete's by delete again.
func (v *Volume) finishAdvice() string {
	switch {
	case v.State == StateDeleting:
		return fmt.Sprintf("a delete left unfinished: rerun `sparsevol delete %s`", v.Name)
	case v.Imported:
		return fmt.Sprintf("an import left unfinished: `sparsevol delete %s`, then import again", v.Name)
	}
	return "a create left unfinished: rerun the same create, or delete it"
}

// reserve checks uniqueness and space and records the volume in state
// creating, under the store lock so that two creates cannot both pass.
func (s *Store) reserve(req CreateRequest) (*Volume, error) {
	unlock, err := s.lock(storeLock)
	if err != nil {
		return nil, err
	}
	defer unlock()
	vols, err := s.List()
	if err != nil {
		return nil, err
	}
	for _, v := range vols {
		if v.Name == req.Name {
			if v.State == StateCreating && req.compatible(v) {
				return v, nil // finish what a crashed run started
			}
			if v.State == StateCreating {
				return nil, fmt.Errorf("name %q is taken by volume %s (%s), which %s: %w", req.Name, v.UUID, v.State, v.finishAdvice(), ErrExists)
			}
			return nil, fmt.Errorf("name %q is taken by volume %s (%s): %w", req.Name, v.UUID, v.State, ErrExists)
		}
		if v.UUID == req.UUID {
			return nil, fmt.Errorf("uuid %s is taken by volume %q: %w", req.UUID, v.Name, ErrExists)
		}
	}
	// A UUID the caller chose may be anything's: it meets the rule of
	// every UUID the store did not make (uuidFree).
	free := s.uuidFree
	if req.UUID == "" {
		req.UUID, free = NewUUID(), LinkedElsewhere
	}
	if _, err := os.Lstat(s.backingPath(req.UUID)); err == nil {
		return nil, fmt.Errorf("file %s exists but is no volume of this store: %w", s.backingPath(req.UUID), ErrExists)
	}
	if err := free(req.UUID); err != nil {
		return nil, err
	}
	if err := s.checkSpaceOf(vols, req.SizeBytes, req.source.held(), req.Preallocate); err != nil {
		return nil, err
	}
	directIO := *s.opts.DirectIO
	if req.DirectIO != nil {
		directIO = *req.DirectIO
	}
	v := &Volume{
		Name:        req.Name,
		UUID:        req.UUID,
		SizeBytes:   req.SizeBytes,
		Mode:        req.Mode,
		FSType:      req.FSType,
		Partitioned: req.Mode == ModeBlock && !req.NoPartition,
		BackingFile: s.backingPath(req.UUID),
		Preallocate: req.Preallocate,
		DirectIO:    directIO,
		BlockSize:   req.source.blockSize(s.root, req.Mode),
		MkfsOptions: req.MkfsOptions,
		State:       StateCreating,
		Created:     time.Now().UTC().Truncate(time.Second),
		Labels:      maps.Clone(req.Labels),
		IOLimits:    req.IOLimits,
	}
	req.source.record(v)
	// The lock file is made before the record that needs it, by taking
	// the lock without waiting (nobody knows the UUID yet), so that a
	// store with no inode left refuses here, with nothing written, not
	// after the record, which would stay creating. Released at once
	// (Create takes it again), it goes again if no record was written.
	unlockNew, err := s.tryLock(v.UUID)
	if err != nil {
		return nil, err
	}
	defer unlockNew()
	// No flush: until Create's last record, nobody was told of the
	// volume; a power cut before it may lose this one (see build).
	if err := s.putMeta(v, fsutil.FlushNone); err != nil {
		return nil, err
	}
	s.noteName(v.Name, v.UUID)
	return v, nil
}

// blockSizeFor returns the direct I/O alignment of dir's filesystem (512
// where it is unknown): a loop block size that needs no bounce buffers.
// blockSizeForMode chooses from it; the choice is fixed at create time,
// because partition tables and XFS record the sector size.
//
// Filesystems report the alignment for regular files only, so it is asked
// of an unnamed temporary file in dir (O_TMPFILE), which vanishes on close.
func blockSizeFor(dir string) uint32 {
	fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return 512
	}
	defer unix.Close(fd)
	var stx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &stx); err == nil &&
		stx.Mask&unix.STATX_DIOALIGN != 0 && stx.Dio_offset_align >= 512 && stx.Dio_offset_align <= 4096 {
		return stx.Dio_offset_align
	}
	return 512
}

// build runs the steps after reserve; each is safe to repeat.
func (s *Store) build(ctx context.Context, v *Volume, req CreateRequest) (err error) {
	// A step that fails before the unit is enabled is undone: a failed
	// create leaves nothing, so a rerun with other arguments starts afresh.
	// (A crash leaves the volume creating instead, for a rerun or Delete.)
	// What is not provably the volume's own (ErrUnsafe: a symlink or a
	// second link in place of the backing file, a foreign device on it) is
	// left as it is, and so is the volume, for Delete and its rules;
	// unless it is the source of a copy that is unsafe (sourceError).
	undo := true
	defer func() {
		var srcErr *sourceError
		if err != nil && undo && (!errors.Is(err, ErrUnsafe) || errors.As(err, &srcErr)) {
			err = s.rollback(v, err)
		}
	}()
	crashPoint("create:reserved")
	bare := false
	// The backing file and what is written onto it (a copy, mkfs, a new
	// identity) are all in the store: a failure for want of room there
	// is the store's.
	if req.source != nil {
		err = s.fillFromSource(ctx, v, req)
	} else {
		bare, err = s.makeBacking(ctx, v, !req.KeepAttached)
	}
	if err != nil {
		return s.inStore(err)
	}
	crashPoint("create:file")
	var dev *loop.Device
	if !bare {
		if dev, err = s.attachFormatted(ctx, v, req); err != nil {
			return s.inStore(err)
		}
	}
	crashPoint("create:formatted")
	if err := s.enableUnit(ctx, v); err != nil {
		return err
	}
	// From here the unit is enabled: a failure leaves the volume creating
	// for Delete, which disables the unit too.
	undo = false
	v.State = StateReady
	// The one flush of a create: on the store's journalling filesystem
	// it makes this record, the backing file and its size durable at
	// once (fsutil.FlushOnce). What mkfs wrote, it flushed itself.
	if err := s.putMeta(v, fsutil.FlushOnce); err != nil {
		return err
	}
	crashPoint("create:ready")
	s.log.Info("volume created", "volume", v.Name, "uuid", v.UUID, "size", v.SizeBytes, "mode", v.Mode, "fs", v.FSType)
	if req.KeepAttached {
		// The device is shown only with its limits (Create checked that
		// the host enforces them); if they fail, the ready volume is left
		// detached, for its unit or the next attach.
		if err := s.applyLimits(v, dev); err != nil {
			if derr := s.detachDevices(v, nil, DetachOptions{}); derr != nil {
				err = errors.Join(err, derr)
			}
			return fmt.Errorf("volume %s was created, but not attached: %w", v.Name, err)
		}
		return s.finishAttach(ctx, v, dev)
	}
	if bare {
		return nil // never attached
	}
	return s.detachDevices(v, nil, DetachOptions{})
}

// makeBacking makes v's backing file, a hole of its size (allocated for
// a thick volume). bare says the volume needs no device to be finished:
// where detached is allowed (the caller keeps it attached otherwise) and
// nothing holds its file (a crashed create's device or a foreign one,
// which attachDevice deals with), a whole-device raw volume, which holds
// nothing create writes, and a filesystem volume that formatFile
// formats on the file itself are finished on the open file: its
// identity is recorded and no device is bound.
func (s *Store) makeBacking(ctx context.Context, v *Volume, detached bool) (bare bool, err error) {
	fd, id, err := s.createBacking(v.UUID)
	if err != nil {
		return false, err
	}
	defer unix.Close(fd)
	if err := sizeBacking(fd, v.SizeBytes, v.Preallocate); err != nil {
		return false, fmt.Errorf("%s: %w", v.BackingFile, err)
	}
	if !detached || !s.unshared(v, fd) {
		return false, nil
	}
	if formatted(v) {
		if done, err := s.formatFile(ctx, v, fd); err != nil || !done {
			return false, err
		}
	}
	v.noteBackingID(id)
	return true, nil
}

// attachFormatted attaches v and writes what create writes onto its
// device (a filesystem or partition table, or gives a copy v's identity
// where req has a source), proven afterwards (CheckFilesystem).
func (s *Store) attachFormatted(ctx context.Context, v *Volume, req CreateRequest) (*loop.Device, error) {
	dev, _, err := s.attachDevice(v)
	if err != nil {
		return nil, err
	}
	v.noteBackingID(dev.Backing)
	crashPoint("create:attached")
	if req.source != nil {
		err = s.finishCopy(ctx, v, dev, req.source)
	} else {
		err = s.format(ctx, v, dev)
	}
	if err != nil {
		return nil, err
	}
	if err := s.CheckFilesystem(ctx, v, dev.Path); err != nil {
		return nil, fmt.Errorf("format %s: mkfs did not make the volume's own filesystem: %w", v.Name, err)
	}
	if s.udevRuns() {
		// Have udev probe the new filesystem or partition table now; the
		// stable link is waited for below (and by the unit).
		if err := loop.NotifyChange(dev.Path); err != nil {
			s.log.Warn("udev change event", "volume", v.Name, "error", err)
		}
	}
	return dev, nil
}

// formatted reports whether create writes anything onto v's device: a
// filesystem or a partition table (everything but a whole-device raw
// volume).
func formatted(v *Volume) bool {
	prog, _ := mkfsCommand(v, "")
	return prog != ""
}

// rollback undoes a create that failed before its unit was enabled: it
// detaches the volume's devices, removes its backing file and its
// metadata, in Delete's order, and returns cause. The volume was never
// ready, so nothing of value is lost. The caller holds v's lock. If a step
// fails (a device is busy), the volume stays in state creating for a
// rerun or Delete, and the error says so; its class stays cause's.
func (s *Store) rollback(v *Volume, cause error) error {
	err := s.detachDevices(v, nil, DetachOptions{Force: true})
	if errors.Is(err, loop.ErrDeferred) {
		err = nil // gone at its opener's last close; the file may go now
	}
	if err == nil {
		err = s.removeBacking(v.UUID)
	}
	if err == nil {
		err = s.removeMeta(v.UUID)
	}
	if err == nil {
		s.forgetName(v.Name, v.UUID)
	}
	if err != nil {
		s.log.Warn("create failed and was not rolled back", "volume", v.Name, "uuid", v.UUID, "error", err)
		return fmt.Errorf("%w (rolling back failed, the volume stays %s for a rerun or delete: %v)", cause, StateCreating, err)
	}
	s.log.Info("create failed and was rolled back", "volume", v.Name, "uuid", v.UUID, "error", cause)
	return cause
}

// format writes the filesystem or partition table whose UUID is the
// volume UUID. Only ever called on a volume in state creating, so any
// content is ours and half-made: formatting is forced.
func (s *Store) format(ctx context.Context, v *Volume, dev *loop.Device) error {
	if err := checkRecordedMkfs(v); err != nil {
		return err
	}
	prog, args := mkfsCommand(v, dev.Path)
	if prog == "" {
		// Whole-device raw volume: nothing on disk but zeroes.
		return nil
	}
	// Hold the device so its number cannot be rebound to another file
	// while mkfs works on it by path.
	held, err := loop.Hold(dev.Path, v.owner(dev.Backing))
	if err != nil {
		return fmt.Errorf("format %s: %w", v.Name, err)
	}
	defer held.Close()
	if _, err := s.run.run(ctx, prog, args...); err != nil {
		return fmt.Errorf("format %s: %w", v.Name, err)
	}
	return nil
}

// checkRecordedMkfs checks v's mkfs options again before they are run:
// they were checked when the volume was reserved, and a record read back
// is checked (Volume.check), but a v that came another way is not
// trusted either.
func checkRecordedMkfs(v *Volume) error {
	if _, err := NormalizeMkfsOptions(v.FSType, v.MkfsOptions); err != nil {
		return fmt.Errorf("format %s: recorded %w", v.Name, err)
	}
	return nil
}

// formatFile makes v's filesystem on its backing file itself, open as fd
// (created and sized by makeBacking, held by nothing else), and proves it
// (CheckFilesystem): the filesystem its device would get, without binding
// one. mkfs and blkid reach the open file through /proc/<pid>/fd, never
// by its name in the store. done is false, with nothing written, where
// the filesystem must be made on the device (mkfsFileCommand).
func (s *Store) formatFile(ctx context.Context, v *Volume, fd int) (done bool, err error) {
	if err := checkRecordedMkfs(v); err != nil {
		return false, err
	}
	path := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)
	prog, args, ok := mkfsFileCommand(v, path)
	if !ok {
		return false, nil
	}
	if _, err := s.run.run(ctx, prog, args...); err != nil {
		return false, fmt.Errorf("format %s: %w", v.Name, err)
	}
	if err := s.CheckFilesystem(ctx, v, path); err != nil {
		return false, fmt.Errorf("format %s: mkfs did not make the volume's own filesystem: %w", v.Name, err)
	}
	return true, nil
}

// partitionName is the GPT partition name of partitioned block volumes.
const partitionName = "sparsevol"

// isNotExist reports a missing file under any wrapping.
func isNotExist(err error) bool { return errors.Is(err, fs.ErrNotExist) }
