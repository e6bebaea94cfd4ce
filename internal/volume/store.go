package volume

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/iolimit"
	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/udev"
)

// DefaultRoot is the store directory when neither --root nor
// SPARSEVOL_ROOT says otherwise.
const DefaultRoot = "/var/lib/sparsevol"

// defaultUdevTimeout is Options.UdevTimeout's default.
const defaultUdevTimeout = 30 * time.Second

// udevTimeout is o.UdevTimeout, or its default where it is not set.
func (o Options) udevTimeout() time.Duration {
	if o.UdevTimeout == 0 {
		return defaultUdevTimeout
	}
	return o.UdevTimeout
}

// RootEnv names the environment variable that selects the store.
const RootEnv = "SPARSEVOL_ROOT"

// Options tune a Store. The zero value is the documented default.
type Options struct {
	// OvercommitRatio bounds the logical sizes of all volumes against what
	// the store's filesystem can give them (free space plus what the volumes
	// already hold). 1 (the default) means every volume can be filled
	// completely; 2 allows promising twice that.
	OvercommitRatio float64
	// UdevTimeout bounds how long attach waits for the stable link where
	// udev runs. Default 30 s. AttachEnabled (attach --boot) takes it as
	// the deadline of the whole boot, every store together.
	UdevTimeout time.Duration
	// AttachedDir, if set, holds one empty file per volume that attach
	// brought up completely (device bound, stable link present); detach
	// removes it. Under systemd the CLI sets /run/sparsevol/attached, so
	// that a boot starts with none: units started without a process of
	// their own at boot assert their file (see the systemd package).
	AttachedDir string
	// UdevIdentityDir, if set, is where attach leaves the identity of
	// the devices it binds for udev to import instead of probing
	// (udevid.go); the CLI sets /run/sparsevol/udev where udev runs, the
	// directory deploy/udev's rule reads.
	UdevIdentityDir string
	// Udev, if set, is udevd's runtime directory as this process sees it
	// (udev.Host on the node). Where udev runs there, attach proves that
	// udev's record of a raw volume's binding was made from the identity
	// in UdevIdentityDir, not by probing content the volume's user wrote
	// (udevid.go). It is looked at where it is used (udevRuns), so a
	// udevd that starts or restarts after Open is found, and it is the
	// only place the store looks for udev: whether attach binds quietly
	// and waits for udev's stable link, and whether create asks udev to
	// probe, are decided here too, never at udev.Host.
	Udev udev.Dir
	// UdevRuleName and UdevRule, if set, are a rule the store installs in
	// Udev's runtime rules directory (udev.Dir.InstallRule) at Open where
	// udev runs, and again whenever it finds udev running where it last
	// found it not (udevRuns): for a node where no package installed it.
	// A failure is logged and costs only udev's probe of the volumes.
	UdevRuleName string
	UdevRule     []byte
	// FreezeTimeout bounds how long a snapshot keeps a mounted
	// filesystem frozen (and how long it waits for the freeze): beyond it
	// the filesystem is thawed and the snapshot fails. Default 60 s.
	FreezeTimeout time.Duration
	// DirectIO is the default for new volumes.
	DirectIO *bool
	// Lifecycle, if set, is the service manager that brings the volumes
	// back at boot (see Lifecycle); nil: none, volumes are attached
	// directly.
	Lifecycle Lifecycle
	// IOLimits says where volumes' I/O limits are enforced (the zero
	// value: the pods' cgroup under /sys/fs/cgroup).
	IOLimits iolimit.Config
	Logger   *slog.Logger
}

// Store is one root directory of volumes. It is safe for concurrent use by
// goroutines and processes: every mutation of a volume holds its flock.
type Store struct {
	root string
	// dir is the store directory as Open found it (see dirFD).
	dir  dirID
	opts Options
	log  *slog.Logger
	run  runner
	// held maps the name of each lock this Store's callers hold to the
	// fd holding it (flock adds, release removes), so that what is noted
	// in a held lock file (lastDevice, noteDetached) is read and written
	// through that fd, not a second open. flock excludes every other open
	// file description, this process's own included: a name has one fd.
	held sync.Map
	// udevSeen is whether udevRuns last found udev running in
	// Options.Udev.
	udevSeen atomic.Bool
}

// CheckRoot returns the absolute path of the store root root, or the
// error (ErrInvalid) Open refuses it with: what a caller that makes a
// missing store first (the plugin) checks before it makes anything.
func CheckRoot(root string) (string, error) {
	if root == "" {
		return "", fmt.Errorf("open store: empty root: %w", ErrInvalid)
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return "", fmt.Errorf("open store %s: %w", root, err)
	}
	// The units name the store (Environment=, RequiresMountsFor=); a
	// store they cannot name is refused for every caller alike.
	if err := CheckUnitPath(abs); err != nil {
		return "", fmt.Errorf("open store: %w", err)
	}
	return abs, nil
}

// Open opens the store at root, which must exist, be a directory (not a
// symbolic link to one), be owned by root or by the caller, and be
// writable; its absolute path must pass CheckUnitPath, so that the units
// of its volumes can name it. It creates nothing: a missing store is an
// input error, not something to paper over with a fresh empty directory.
//
// A store that lets group or world in is made private (group and world
// access removed) and the change is logged as a warning, provided it holds
// nothing but the store's own entries; a directory holding anything else
// may be shared and is refused instead of changed. Open costs the same
// whatever the number of volumes: it reads the directory only to vet a
// store it must make private. Temporary metadata files that killed
// writers left behind are removed by the calls that read the whole
// directory anyway (see uuids), never by a call about one volume.
func Open(root string, opts Options) (*Store, error) {
	abs, err := CheckRoot(root)
	if err != nil {
		return nil, err
	}
	if opts.OvercommitRatio == 0 {
		opts.OvercommitRatio = 1
	}
	if err := checkOvercommitRatio(opts.OvercommitRatio); err != nil {
		return nil, fmt.Errorf("open store %s: %w", abs, err)
	}
	if err := opts.IOLimits.Validate(); err != nil {
		return nil, fmt.Errorf("open store %s: %w: %w", abs, err, ErrInvalid)
	}
	opts.UdevTimeout = opts.udevTimeout()
	if opts.FreezeTimeout == 0 {
		opts.FreezeTimeout = 60 * time.Second
	}
	if opts.DirectIO == nil {
		on := true
		opts.DirectIO = &on
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dir, err := openPrivate(abs, log)
	if err != nil {
		return nil, err
	}
	s := &Store{root: abs, dir: dir, opts: opts, log: log, run: execRunner{}}
	if opts.Udev != "" && opts.UdevRule != nil && !s.udevRuns() {
		log.Info("udev does not run (no control socket): sparsevol's udev rule is installed once it does", "dir", string(opts.Udev))
	}
	return s, nil
}

// openPrivate checks the store directory dir and makes it private as Open
// says. Refusals change nothing. The directory is opened without following
// a final symbolic link, and what is checked and changed is that open
// directory, so it cannot be swapped between the check and the chmod. Its
// names are read only when it is not private already.
func openPrivate(dir string, log *slog.Logger) (dirID, error) {
	f, err := os.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		// With O_DIRECTORY a symbolic link fails as ENOTDIR, not ELOOP.
		if target, lerr := os.Readlink(dir); lerr == nil {
			return dirID{}, fmt.Errorf("open store %s: a symbolic link (to %q); give the directory itself: %w", dir, target, ErrInvalid)
		}
	}
	switch {
	case errors.Is(err, unix.ENOTDIR):
		return dirID{}, fmt.Errorf("open store %s: not a directory: %w", dir, ErrInvalid)
	case errors.Is(err, fs.ErrNotExist):
		return dirID{}, fmt.Errorf("open store %s: %w (create it with install -d -m 0700 %s): %w", dir, err, dir, ErrInvalid)
	case err != nil:
		return dirID{}, fmt.Errorf("open store %s: %w: %w", dir, err, ErrInvalid)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return dirID{}, fmt.Errorf("open store %s: %w", dir, err)
	}
	if st.Uid != 0 && int(st.Uid) != os.Geteuid() {
		return dirID{}, fmt.Errorf("open store %s: owned by uid %d, not by root or uid %d: its owner could replace volume files: %w",
			dir, st.Uid, os.Geteuid(), ErrInvalid)
	}
	if err := unix.Access(dir, unix.W_OK|unix.X_OK); err != nil {
		return dirID{}, fmt.Errorf("open store %s: not writable: %w", dir, ErrInvalid)
	}
	id := dirID{dev: st.Dev, ino: st.Ino}
	mode := st.Mode & 0o7777
	if mode&0o077 == 0 {
		return id, nil
	}
	storeDirReads.Add(1)
	names, err := f.Readdirnames(-1)
	if err != nil {
		return dirID{}, fmt.Errorf("open store %s: %w", dir, err)
	}
	for _, name := range names {
		if !storeEntry(name) {
			return dirID{}, fmt.Errorf("open store %s: mode %04o lets other users in, and %q in it is not the store's, so it may be a shared directory: not changing it (chmod go= it, or give a directory of its own): %w",
				dir, mode, name, ErrInvalid)
		}
	}
	private := mode &^ 0o077
	if err := unix.Fchmod(int(f.Fd()), private); err != nil {
		return dirID{}, fmt.Errorf("open store %s: make it private: %w", dir, err)
	}
	log.Warn("store directory was open to other users; made it private", "store", dir, "mode", fmt.Sprintf("%04o", mode), "now", fmt.Sprintf("%04o", private))
	return id, nil
}

// storeEntry reports whether name is one the store itself makes: a
// volume's file or metadata, the lock directory, a temporary file of ours
// (metadata, recover's copy, doctor's probe), or the lost+found of a
// filesystem made for the store.
func storeEntry(name string) bool {
	_, temp := staleTempUUID(name)
	return temp || name == lockDir || name == snapDir || name == "lost+found" ||
		strings.HasPrefix(name, probePrefix) || ValidUUID(strings.TrimPrefix(name, recoverTempPrefix)) ||
		ValidUUID(name) || ValidUUID(strings.TrimSuffix(name, metaExt))
}

// staleTempUUID parses the name fsutil.WriteFileAtomic gives the
// temporary file of <uuid>.json: .tmp-<uuid>.json-<digits>.
func staleTempUUID(name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, ".tmp-")
	if !ok {
		return "", false
	}
	uuid, suffix, ok := strings.Cut(rest, metaExt+"-")
	if !ok || !ValidUUID(uuid) || suffix == "" || strings.Trim(suffix, "0123456789") != "" {
		return "", false
	}
	return uuid, true
}

// removeStaleTemps removes the temporary metadata files among names that a
// writer killed between creating and renaming them left behind.
//
// It cannot race a live writer: every writeMeta caller holds the volume's
// lock or the store lock, and a file is removed only while this holds
// both, taken without waiting. A file seen before the locks were taken
// either belonged to a writer that has finished (it was renamed away, and
// the remove finds nothing) or to one that died; while the locks are held
// no writer of that volume can run. Busy locks (the caller's own
// included) leave the files to a later listing. Failures only cost disk
// space and are logged.
func (s *Store) removeStaleTemps(names []string) {
	var stale []string
	for _, name := range names {
		if _, ok := staleTempUUID(name); ok {
			stale = append(stale, name)
		}
	}
	if len(stale) == 0 {
		return
	}
	unlockStore, err := s.tryLock(storeLock)
	if err != nil {
		s.log.Info("stale temporary metadata kept for now", "store", s.root, "error", err)
		return
	}
	defer unlockStore()
	for _, name := range stale {
		uuid, _ := staleTempUUID(name)
		unlock, err := s.tryLock(uuid)
		if err != nil {
			s.log.Info("stale temporary metadata kept for now", "file", name, "error", err)
			continue
		}
		err = os.Remove(filepath.Join(s.root, name))
		unlock()
		switch {
		case err == nil:
			s.log.Info("removed stale temporary metadata", "file", filepath.Join(s.root, name))
		case !errors.Is(err, fs.ErrNotExist):
			s.log.Warn("remove stale temporary metadata", "error", err)
		}
	}
}

// Root returns the absolute store directory.
func (s *Store) Root() string { return s.root }

const (
	lockDir   = ".locks"
	metaExt   = ".json"
	storeLock = "store"
)

func (s *Store) metaPath(uuid string) string    { return filepath.Join(s.root, uuid+metaExt) }
func (s *Store) backingPath(uuid string) string { return filepath.Join(s.root, uuid) }

// lock takes an exclusive flock on <root>/.locks/<name> (openLockIn's
// rules apply to it). The returned function releases it (release). A
// volume's lock file also holds the note of the device its last detach
// freed (noteDetached). Locks are released by the kernel if the process dies,
// which is what makes a killed CLI safe to rerun.
//
// Lock order (flock detects no deadlocks): volume locks first, then the
// store's, then snapshots'; nothing that holds a later one waits for an
// earlier one (tryLock does not wait). A caller that holds a volume's
// lock takes no other volume's with lock: two or more are taken together,
// by lockAll or lockEach.
func (s *Store) lock(name string) (func(), error) { return s.flock(name, unix.LOCK_EX) }

type lockedVolume struct {
	uuid   string
	unlock func()
}

// lockAll takes the locks of the volumes with the given UUIDs (nil: every
// volume of the store; a UUID named twice is locked once) and returns
// them, released by unlockAll; if one cannot be taken it holds none and
// fails. It is the one way to hold more than one volume's lock (see
// lock), with lockEach: both take them in UUID order, so two callers
// that each hold several wait on each other in one direction only and
// cannot deadlock. The caller holds no volume lock when it calls either.
func (s *Store) lockAll(uuids []string) ([]lockedVolume, error) {
	locked, failed, err := s.lockEach(uuids, s.lock)
	if err == nil && len(failed) > 0 {
		unlockAll(locked)
		errs := make([]error, 0, len(failed))
		for _, f := range failed {
			errs = append(errs, f.err)
		}
		return nil, errors.Join(errs...)
	}
	return locked, err
}

// lockFailure is a volume lock lockEach could not take.
type lockFailure struct {
	uuid string
	err  error
}

// lockEach is lockAll for batches of volumes handled one by one: it takes
// each lock with take (lock, tryLock or lockUntil) and goes on past one it
// cannot take, which it returns in failed (in UUID order) instead: one bad
// lock file leaves out its volume only. err is set, and nothing held,
// only if the store's volumes could not be listed.
func (s *Store) lockEach(uuids []string, take func(string) (func(), error)) (locked []lockedVolume, failed []lockFailure, err error) {
	if uuids == nil {
		if uuids, err = s.uuids(); err != nil {
			return nil, nil, err
		}
	}
	uuids = slices.Clone(uuids)
	slices.Sort(uuids)
	uuids = slices.Compact(uuids)
	locked = make([]lockedVolume, 0, len(uuids))
	for _, uuid := range uuids {
		unlock, err := take(uuid)
		if err != nil {
			failed = append(failed, lockFailure{uuid, err})
			continue
		}
		locked = append(locked, lockedVolume{uuid, unlock})
	}
	return locked, failed, nil
}

// lockUntil is lock bounded by ctx, for lockEach: where ctx can end, it
// tries the lock (tryLock) until it is free or ctx ends, as flock cannot
// be interrupted; where ctx cannot end, it is lock.
func (s *Store) lockUntil(ctx context.Context) func(string) (func(), error) {
	if ctx.Done() == nil {
		return s.lock
	}
	return func(name string) (func(), error) {
		for wait := 10 * time.Millisecond; ; wait = min(2*wait, 500*time.Millisecond) {
			unlock, err := s.tryLock(name)
			if !errors.Is(err, unix.EWOULDBLOCK) {
				return unlock, err
			}
			select {
			case <-ctx.Done():
				return nil, fmt.Errorf("lock %s: another process still holds it (%w): rerun once it is done", name, context.Cause(ctx))
			case <-time.After(wait):
			}
		}
	}
}

// unlockAll releases the locks lockAll took; a second call does nothing.
func unlockAll(vols []lockedVolume) {
	for _, v := range vols {
		v.unlock()
	}
}

// tryLock is lock without waiting: if another holds the lock it fails at
// once, with an error that wraps unix.EWOULDBLOCK.
func (s *Store) tryLock(name string) (func(), error) { return s.flock(name, unix.LOCK_EX|unix.LOCK_NB) }

// flock takes the lock file name's flock. A lock file is removed only by
// its holder (releasing it, see release), so one that is no longer named
// name once its flock is taken was removed while this call waited: flock
// then locks the file that name is now, which makes the lock mean the
// name, not an inode.
func (s *Store) flock(name string, how int) (func(), error) {
	dir, err := s.lockDirFD()
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", name, err)
	}
	defer unix.Close(dir)
	for {
		fd, err := s.openLockIn(dir, name, unix.O_RDWR, true)
		if err != nil {
			return nil, fmt.Errorf("lock %s: %w", name, err)
		}
		err = fsutil.Flock(fd, how)
		var held, named unix.Stat_t
		if err == nil {
			if err = unix.Fstat(fd, &held); err == nil {
				err = unix.Fstatat(dir, name, &named, unix.AT_SYMLINK_NOFOLLOW)
			}
		}
		switch {
		case err == nil && held.Dev == named.Dev && held.Ino == named.Ino:
			// Once: a second close could hit an fd number reused meanwhile.
			s.held.Store(name, fd)
			return sync.OnceFunc(func() { s.release(name, fd) }), nil
		case err == nil, errors.Is(err, unix.ENOENT):
			unix.Close(fd) // removed or replaced while we waited
		default:
			unix.Close(fd)
			return nil, fmt.Errorf("lock %s: %w", name, err)
		}
	}
}

// release releases the lock file name, open as fd, which the caller
// holds. If the record the lock serves is gone (lockedRecord: the volume
// or snapshot was deleted, or never made it past a failed create), the
// lock file goes too, before the flock is let go: .locks holds no file
// for what no longer exists, whoever deleted it and whoever found it
// deleted after waiting (flock makes a new file for a waiter whose file
// was removed). Whoever waits on it locks the file the name is next.
// Removal is best effort: a file left costs nothing but its name.
func (s *Store) release(name string, fd int) {
	s.held.Delete(name)
	defer unix.Close(fd)
	record := s.lockedRecord(name)
	if record == "" {
		return
	}
	if _, err := os.Lstat(record); !errors.Is(err, fs.ErrNotExist) {
		return
	}
	dir, err := s.lockDirFD()
	if err != nil {
		return
	}
	defer unix.Close(dir)
	if err := unix.Unlinkat(dir, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		s.log.Debug("lock file not removed", "lock", name, "error", err)
	}
}

// lockedRecord is the metadata file whose volume or snapshot the lock
// file name serves; "" for the store's own lock, which stays.
func (s *Store) lockedRecord(name string) string {
	if uuid, ok := strings.CutPrefix(name, snapLock("")); ok {
		return s.snapMetaPath(uuid)
	}
	if ValidUUID(name) {
		return s.metaPath(name)
	}
	return ""
}

// heldLock is the fd of the lock name the caller holds (flock); ok is
// false if nobody in this process holds it. The fd stays the holder's:
// the caller neither closes it nor uses it after the lock is released.
func (s *Store) heldLock(name string) (fd int, ok bool) {
	v, ok := s.held.Load(name)
	if !ok {
		return -1, false
	}
	return v.(int), true
}

// lockDirFD opens <root>/.locks (storeSubdirFD). The caller closes the fd.
func (s *Store) lockDirFD() (int, error) { return s.storeSubdirFD(lockDir, "lock directory") }

// openLockIn opens the lock file name in dir, an fd of the lock directory
// (<root>/.locks), with flags (O_RDONLY, O_WRONLY or O_RDWR), making it
// if missing and create is set. A lock file found there must follow a
// backing file's rules (checkFile: a regular file with one link, not a
// symbolic link, on the store's filesystem) before it is opened for I/O,
// so that a device node, FIFO or hard link planted in its place is never
// opened, read or written. It is returned as a plain fd, not an os.File:
// attach --all holds a thousand of these, and os.File would register each
// with the poller. The caller closes it.
func (s *Store) openLockIn(dir int, name string, flags int, create bool) (int, error) {
	path := filepath.Join(s.root, lockDir, name)
	if create {
		fd, err := unix.Openat(dir, name, flags|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err == nil {
			return fd, nil
		}
		if !errors.Is(err, unix.EEXIST) {
			return -1, s.inStore(&os.PathError{Op: "create", Path: path, Err: err})
		}
	}
	fd, _, err := s.openIn(dir, name, "lock file", path, flags)
	return fd, err
}

// writeMeta persists v atomically: temp file, fsync, rename, fsync dir.
// A crash leaves either the old or the new metadata, never a torn file.
// The caller holds v's lock or the store lock; removeStaleTemps relies on
// it.
func (s *Store) writeMeta(v *Volume) error { return s.putMeta(v, fsutil.FlushAll) }

// putMeta is writeMeta with the flush the caller chooses (see
// fsutil.Flush): Create's records of a volume nobody was told of yet
// need not survive a power cut one by one, only the last one does.
func (s *Store) putMeta(v *Volume, flush fsutil.Flush) error {
	stored := *v
	stored.Format = RecordFormat
	stored.Problem = "" // found anew by every reader
	data, err := json.MarshalIndent(&stored, "", "  ")
	if err != nil {
		return fmt.Errorf("write metadata of %s: %w", v.Name, err)
	}
	data = append(data, '\n')
	if err := s.putRecord(s.metaPath(v.UUID), data, flush, v.State == StateDeleting); err != nil {
		return fmt.Errorf("write metadata of %s: %w", v.Name, err)
	}
	return nil
}

// putRecord replaces the record at path, a volume's or a snapshot's
// metadata, with data (fsutil.ReplaceFile, flushed as flush says). A
// record that marks its volume or snapshot deleting is written over the
// old one in place (fsutil.Overwrite) where the store's filesystem has
// no room for a new file: a delete is how room is made, so it must need
// none. A crash may tear that record; a torn record is broken, and a
// delete removes a broken volume or snapshot too. Any other record the
// filesystem has no room for is ErrNoRoom.
func (s *Store) putRecord(path string, data []byte, flush fsutil.Flush, deleting bool) error {
	err := fsutil.ReplaceFile(path, data, 0o600, flush)
	if deleting && fsutil.NoRoom(err) {
		err = fsutil.Overwrite(path, data)
	}
	return s.inStore(err)
}

// maxRecordSize bounds what a volume's or snapshot's metadata file may
// hold when it is read: a record is well under a kilobyte, and labels at
// ValidateLabels' bounds, escaped, keep it below this; anything larger was
// not written by a store.
const maxRecordSize = 1 << 20

// readMeta reads the metadata of the volume uuid. A missing file is
// ErrNotFound; one of a newer format (decodeRecord) is ErrNewer; one that
// cannot be read or parsed, names another volume or holds a field check
// refuses is ErrBroken. Both name the file.
func (s *Store) readMeta(uuid string) (*Volume, error) {
	path := s.metaPath(uuid)
	data, err := fsutil.ReadRegular(path, maxRecordSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("volume %s: %w", uuid, ErrNotFound)
	}
	var v Volume
	if err == nil {
		err = decodeRecord(data, &v)
		if err == nil && v.UUID != uuid {
			err = fmt.Errorf("the file names volume %q", v.UUID)
		}
		if err == nil {
			err = v.check()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("volume %s: %w: %w", uuid, &os.PathError{Op: "read metadata", Path: path, Err: err}, recordClass(err))
	}
	// Never a path from the metadata: the backing file is <root>/<uuid>.
	v.BackingFile = s.backingPath(uuid)
	return &v, nil
}

// check applies the rules a volume's record must meet before the store
// acts on it (metadata files are hostile input): checkLayout's, with the
// sizes a record may hold (sizeKept), a state a record holds
// (checkStoredState), an expansion in progress to no less than the size,
// at most one source, named by its UUID (ValidUUID, as every snapshot's
// and volume's), I/O limits the kernel enforces as given (CheckLimits'
// rule), mkfs options as NormalizeMkfsOptions admits them for the
// filesystem, labels as ValidateLabels admits them, and a valid name.
// The error carries no error class; readMeta makes it ErrBroken.
func (v *Volume) check() error {
	if err := checkLayout(v.Mode, v.FSType, v.Partitioned, v.SizeBytes, v.BlockSize, sizeKept); err != nil {
		return err
	}
	if err := checkStoredState(v.State); err != nil {
		return err
	}
	if v.ExpandingTo != 0 && (v.ExpandingTo < v.SizeBytes || v.ExpandingTo > maxSize || v.ExpandingTo%512 != 0) {
		return fmt.Errorf("expanding to %d is not a multiple of 512 bytes from the size %d up to %s", v.ExpandingTo, v.SizeBytes, FormatSize(maxSize+1))
	}
	switch {
	case v.FromSnapshot != "" && v.ClonedFrom != "":
		return fmt.Errorf("made from snapshot %q and cloned from volume %q; a volume is copied from one source at most", v.FromSnapshot, v.ClonedFrom)
	case v.FromSnapshot != "" && !ValidUUID(v.FromSnapshot):
		return fmt.Errorf("source snapshot uuid %q is not a canonical UUID", v.FromSnapshot)
	case v.ClonedFrom != "" && !ValidUUID(v.ClonedFrom):
		return fmt.Errorf("source volume uuid %q is not a canonical UUID", v.ClonedFrom)
	}
	if err := v.IOLimits.Validate(); err != nil {
		return unclassified(err)
	}
	if _, err := NormalizeMkfsOptions(v.FSType, v.MkfsOptions); err != nil {
		return unclassified(err)
	}
	if err := ValidateLabels(v.Labels); err != nil {
		return unclassified(err)
	}
	return unclassified(ValidateName(v.Name))
}

// unclassified is err's message without its error classes (nil for nil):
// a rule a record breaks makes it ErrBroken, never the ErrInvalid of a
// request that broke the same rule.
func unclassified(err error) error {
	if err == nil {
		return nil
	}
	return errors.New(err.Error())
}

// standIn stands for a volume whose metadata readMeta refused with err
// (ErrBroken, ErrNewer): in state broken or newer, named as standInHead
// says, its backing file where every volume's is, and as large as that
// file (what it promised, for the space policy, as far as anyone can
// tell).
func (s *Store) standIn(uuid string, err error) *Volume {
	state, h := standInHead(uuid, err)
	v := &Volume{Format: h.Format, Name: h.Name, UUID: uuid, State: state, BackingFile: s.backingPath(uuid),
		Labels: h.Labels, Problem: err.Error(), refusal: err}
	var pe *os.PathError
	if errors.As(err, &pe) {
		v.Problem = pe.Error() // the file and the reason, without the classes
	}
	if fi, err := os.Lstat(v.BackingFile); err == nil && fi.Mode().IsRegular() {
		v.SizeBytes = fi.Size()
	}
	return v
}

// lookup is readMeta for listing: a volume whose record is broken or
// newer is returned as its stand-in.
func (s *Store) lookup(uuid string) (*Volume, error) {
	v, err := s.readMeta(uuid)
	if errors.Is(err, ErrBroken) || errors.Is(err, ErrNewer) {
		return s.standIn(uuid, err), nil
	}
	return v, err
}

func (s *Store) removeMeta(uuid string) error {
	if err := os.Remove(s.metaPath(uuid)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove metadata of %s: %w", uuid, err)
	}
	if err := fsutil.SyncDir(s.root); err != nil {
		return fmt.Errorf("remove metadata of %s: %w", uuid, err)
	}
	// The lock file goes when its holder releases it (release).
	return nil
}

// List returns every volume of the store, in every state, sorted by name.
// A volume whose metadata cannot be read is listed in state broken, one
// whose record a newer sparsevol wrote in state newer (standIn), so one
// such file hides nothing else.
func (s *Store) List() ([]*Volume, error) {
	uuids, err := s.uuids()
	if err != nil {
		return nil, err
	}
	var vols []*Volume
	for _, uuid := range uuids {
		v, err := s.lookup(uuid)
		if errors.Is(err, ErrNotFound) {
			continue // deleted while we listed
		}
		if err != nil {
			return nil, err
		}
		vols = append(vols, v)
	}
	sort.Slice(vols, func(i, j int) bool { return vols[i].Name < vols[j].Name })
	return vols, nil
}

// uuids lists the UUIDs of the store's metadata files, without reading
// them. Its read (storeNames) is the one read of the whole store
// directory (besides openPrivate's of a store it must make private, and
// doctor's look for leftovers), so it also sweeps the
// temporary metadata of killed writers it comes across
// (removeStaleTemps): listing, boot's attach --all, detach --all and
// doctor pay for a sweep in the read they make anyway, and no call about
// one volume reads the directory at all.
func (s *Store) uuids() ([]string, error) {
	names, err := s.storeNames()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, name := range names {
		if uuid, ok := strings.CutSuffix(name, metaExt); ok && ValidUUID(uuid) {
			out = append(out, uuid)
		}
	}
	sort.Strings(out)
	return out, nil
}

// storeNames reads the names in the store's directory: the read uuids
// makes, and the one doctor's look for leftovers makes (RecoverCopies,
// Probe). It sweeps the temporary metadata of killed writers among them
// (removeStaleTemps).
func (s *Store) storeNames() ([]string, error) {
	storeDirReads.Add(1)
	f, err := fsutil.OpenDir(s.root)
	if err != nil {
		return nil, fmt.Errorf("list store %s: %w", s.root, err)
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("list store %s: %w", s.root, err)
	}
	s.removeStaleTemps(names)
	return names, nil
}

// storeDirReads counts the reads of a whole store directory this process
// made (uuids, openPrivate): tests hold the calls about one volume to
// none.
var storeDirReads atomic.Int64

// Get resolves a volume by UUID or name; a broken or newer volume is
// returned as its stand-in (standIn). Operations re-read the metadata
// under the volume's lock (withVolume) and so refuse it with ErrBroken or
// ErrNewer.
// A UUID, and a name whose hint holds (see nameDir), cost one metadata
// file whatever the size of the store; only a name without a good hint
// (or of no volume) reads them all.
func (s *Store) Get(ref string) (*Volume, error) {
	if ref == "" {
		return nil, fmt.Errorf("empty volume reference: %w", ErrInvalid)
	}
	if ValidUUID(ref) {
		v, err := s.lookup(ref)
		if err == nil || !errors.Is(err, ErrNotFound) {
			return v, err
		}
	}
	if v := s.byName(ref); v != nil {
		return v, nil
	}
	vols, err := s.List()
	if err != nil {
		return nil, err
	}
	for _, v := range vols {
		if v.Name == ref {
			s.noteName(v.Name, v.UUID)
			return v, nil
		}
	}
	return nil, fmt.Errorf("volume %s: %w", Quote(ref), ErrNotFound)
}

// withVolume resolves ref, takes the volume's lock and re-reads its
// metadata under it, so fn sees what the last holder wrote.
func (s *Store) withVolume(ref string, fn func(v *Volume) error) error {
	v, err := s.Get(ref)
	if err != nil {
		return err
	}
	unlock, err := s.lock(v.UUID)
	if err != nil {
		return err
	}
	defer unlock()
	v, err = s.readMeta(v.UUID)
	if err != nil {
		return err
	}
	return fn(v)
}

// Check returns nil if the store and the node can serve volumes: the
// store directory is still the one Open found, can be searched and
// written, and its filesystem answers statfs mounted read-write; and the
// kernel offers loop devices. It reads no record and not the store
// directory, so its cost does not grow with the store (a liveness probe
// calls it); a broken record is its volume's trouble, which status and
// doctor report.
func (s *Store) Check() error {
	fd, err := s.dirFD()
	if err != nil {
		return fmt.Errorf("check store: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return fmt.Errorf("check store %s: statfs: %w", s.root, err)
	}
	if st.Flags&unix.ST_RDONLY != 0 {
		return fmt.Errorf("check store %s: its filesystem is mounted read-only (remount it read-write): %w", s.root, unix.EROFS)
	}
	if err := unix.Faccessat(fd, ".", unix.R_OK|unix.W_OK|unix.X_OK, unix.AT_EACCESS); err != nil {
		return fmt.Errorf("check store %s: not readable and writable: %w", s.root, err)
	}
	return loop.Supported()
}

// Space describes the store's filesystem and what its volumes promise.
type Space struct {
	FreeBytes      int64 `json:"freeBytes"`      // available to unprivileged writers
	AllocatedBytes int64 `json:"allocatedBytes"` // held by the volumes' files
	CommittedBytes int64 `json:"committedBytes"` // sum of logical sizes, and what snapshots hold
	// SnapshotBytes is what the snapshots' files hold (shared or not):
	// each may come to own all of it as its volume changes.
	SnapshotBytes int64 `json:"snapshotBytes,omitempty"`
	// CapacityBytes is what may still be promised under the policy.
	CapacityBytes   int64   `json:"capacityBytes"`
	OvercommitRatio float64 `json:"overcommitRatio"`
}

// Space measures the store against its overcommit policy.
func (s *Store) Space() (Space, error) {
	vols, err := s.List()
	if err != nil {
		return Space{}, err
	}
	return s.space(vols)
}

func (s *Store) space(vols []*Volume) (Space, error) {
	sns, err := s.listSnapshots()
	if err != nil {
		return Space{}, err
	}
	return s.spaceOf(vols, sns)
}

// spaceOf is space for a caller that listed the snapshots (sns) already.
func (s *Store) spaceOf(vols []*Volume, sns []*Snapshot) (Space, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(s.root, &st); err != nil {
		return Space{}, fmt.Errorf("statfs %s: %w", s.root, err)
	}
	sp := Space{FreeBytes: int64(st.Bavail) * st.Bsize, OvercommitRatio: s.opts.OvercommitRatio}
	for _, v := range vols {
		sp.CommittedBytes += max(v.SizeBytes, v.ExpandingTo)
	}
	if len(sns) == 0 && !anyCopied(vols) {
		// Nothing can share extents: st_blocks is exact, and cheaper.
		for _, v := range vols {
			sp.AllocatedBytes += s.allocated(v.UUID)
		}
	} else {
		// Shared extents count once; a snapshot promises what it holds.
		var held int64
		sp.AllocatedBytes, held = s.allocation(vols, sns)
		sp.CommittedBytes += held
		sp.SnapshotBytes = held
	}
	sp.setCapacity()
	return sp, nil
}

// setCapacity sets CapacityBytes from the other figures: the ratio times
// free plus allocated, less what is committed. It never falls as
// AllocatedBytes grows.
func (sp *Space) setCapacity() {
	// Clamped before the conversion: a float beyond int64 converts to
	// whatever the CPU makes of it (math.MinInt64 on amd64).
	limit := int64(min(sp.OvercommitRatio*float64(sp.FreeBytes+sp.AllocatedBytes), math.MaxInt64/2))
	sp.CapacityBytes = max(0, limit-sp.CommittedBytes)
}

// checkSpaceIn refuses growth by delta bytes beyond the policy over vols
// and sns, as checkSpace says. own is what the store's filesystem holds
// for the growth already in a file of no volume (an import's unnamed
// file, see source.held): it counts as allocated, as it will once the
// file is the volume's, not as space gone. What the files hold only adds
// to the capacity, so growth the free space alone allows is let through
// without measuring them (no FIEMAP of every file); anything else is
// decided on the full figures, which a refusal names.
func (s *Store) checkSpaceIn(vols []*Volume, sns []*Snapshot, delta, own int64, thick bool) error {
	if s.freeAllows(vols, sns, delta, own, thick) {
		return nil
	}
	sp, err := s.spaceOf(vols, sns)
	if err != nil {
		return err
	}
	sp.AllocatedBytes += own
	sp.setCapacity()
	return s.inStore(sp.allows(delta, thick))
}

// freeAllows reports whether the policy allows growth by delta with no
// volume's or snapshot's allocation counted (own only, as checkSpaceIn
// says): spaceOf's figures with AllocatedBytes own, a capacity never
// above the full one. It costs a statfs and a stat of each snapshot's
// file (what a snapshot holds is committed).
func (s *Store) freeAllows(vols []*Volume, sns []*Snapshot, delta, own int64, thick bool) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(s.root, &st); err != nil {
		return false
	}
	sp := Space{FreeBytes: int64(st.Bavail) * st.Bsize, AllocatedBytes: own, OvercommitRatio: s.opts.OvercommitRatio}
	for _, v := range vols {
		sp.CommittedBytes += max(v.SizeBytes, v.ExpandingTo)
	}
	sp.CommittedBytes += s.snapshotsHeld(sns)
	sp.setCapacity()
	return sp.allows(delta, thick) == nil
}

// checkSpace refuses growth by delta bytes beyond the policy. A thick
// (preallocated) volume must also fit in what is physically free: it
// allocates everything now, overcommit or not.
func (s *Store) checkSpace(delta int64, thick bool) error {
	vols, err := s.List()
	if err != nil {
		return err
	}
	return s.checkSpaceOf(vols, delta, 0, thick)
}

// checkSpaceOf is checkSpace for a caller that listed the volumes (vols)
// already, with own as checkSpaceIn says.
func (s *Store) checkSpaceOf(vols []*Volume, delta, own int64, thick bool) error {
	sns, err := s.listSnapshots()
	if err != nil {
		return err
	}
	return s.checkSpaceIn(vols, sns, delta, own, thick)
}

// allows refuses growth by delta bytes beyond sp, as checkSpace says.
func (sp Space) allows(delta int64, thick bool) error {
	if delta > sp.CapacityBytes {
		return fmt.Errorf("%s requested, the store can promise %s more (free %s, committed %s, overcommit ratio %g): %w",
			FormatSize(delta), FormatSize(sp.CapacityBytes), FormatSize(sp.FreeBytes), FormatSize(sp.CommittedBytes), sp.OvercommitRatio, ErrNoSpace)
	}
	if thick {
		return sp.fitsNow(delta, "a preallocated volume")
	}
	return nil
}

// fitsNow refuses what allocates need bytes at once (a preallocated
// volume, a copy of data) beyond what the store's filesystem has free,
// overcommit or not: it would fill the store and fail midway, and every
// thin volume's writes with it. what names the allocation.
func (sp Space) fitsNow(need int64, what string) error {
	if need > sp.FreeBytes {
		return &SpaceError{Err: fmt.Errorf("%s requested for %s, %s are free: %w", FormatSize(need), what, FormatSize(sp.FreeBytes), ErrNoSpace), NoRoom: true}
	}
	return nil
}

// inStore makes err a *SpaceError of s where it is one for want of room:
// a refusal (ErrNoSpace), or a write into the store that its filesystem
// had no room for (fsutil.NoRoom: ENOSPC or EDQUOT, also where a program
// reports it, see execRunner), which is ErrNoRoom. It is the one rule of
// that class, called where what failed wrote into the store and nothing
// else: an ENOSPC from elsewhere (a unit file, an inotify watch) says
// nothing of the store. Anything else comes back as it is.
func (s *Store) inStore(err error) error {
	var se *SpaceError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &se):
		if se.Store == "" {
			se.Store = s.root
		}
		return err
	case errors.Is(err, ErrNoSpace):
		return &SpaceError{Store: s.root, Err: err}
	case fsutil.NoRoom(err):
		return &SpaceError{Store: s.root, Err: err, NoRoom: true}
	}
	return err
}

// roomFor is fitsNow on what the store's filesystem has free now.
func (s *Store) roomFor(need int64, what string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(s.root, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", s.root, err)
	}
	return s.inStore(Space{FreeBytes: int64(st.Bavail) * st.Bsize}.fitsNow(need, what))
}

// Available is how much a new volume may take: CapacityBytes, and for a
// thick volume no more than what is physically free.
func (sp Space) Available(thick bool) int64 {
	if thick {
		return min(sp.CapacityBytes, sp.FreeBytes)
	}
	return sp.CapacityBytes
}
