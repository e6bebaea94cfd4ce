package volume

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/udev"
)

// The identity udev gives a volume's device, from the store.
//
// udev probes every block device it hears of (blkid) to learn the UUID of
// its /dev/disk/by-uuid link; at boot, probing every volume is much of
// udev's work. For a ready filesystem volume the store knows the answer:
// its filesystem type and UUID, proven when it was made. Once attach has
// bound a volume's device and proven the binding its own (loop.Owner), it
// writes them to Options.UdevIdentityDir/<diskseq>, named by the disk
// sequence number of that binding, and the rule sparsevol installs
// (deploy/udev) imports the file instead of probing. The kernel gives every
// bind a new number and reuses none before reboot, so the file describes
// that binding and no other device: not a later binding of the same device
// number, not someone else's binding of the same file. Only root writes the
// directory (on /run). Detach removes the file once the binding is gone;
// a detach the kernel defers leaves it, naming no later device.
//
// A raw volume's content is its user's to write: a probe of it would give
// the device whatever links that content claims, another volume's or the
// node's own /dev/disk/by-uuid among them. Its device gets a file in every
// state, so that udev never probes it: none of the content's links, and
// for a partitioned volume the partition's GPT entry from the store
// (<diskseq>p1), which keeps /dev/disk/by-partuuid. udev may handle the
// kernel's event of a bind before the file is there, and then it probed:
// where it runs (Options.Udev), attach reads udev's record of the binding
// and asks again (settleIdentity).
//
// Filesystem volumes with a filesystem label are probed (e2label can
// change it; the probe keeps /dev/disk/by-label right), and so are
// filesystem volumes being made.

// partTypeLinux is the GPT type GUID of the partition mkfs makes
// (sgdisk typecode 8300), as blkid names it.
const partTypeLinux = "0fc63daf-8483-4772-8e79-3d69d8477de4"

// identityFiles are what udev imports for v's device (disk) and, for a
// partitioned volume, its partition (part); nil where udev probes.
func identityFiles(v *Volume) (disk, part []byte) {
	if !ValidUUID(v.UUID) {
		return nil, nil
	}
	head := "SPARSEVOL_VOLUME=" + v.UUID + "\n"
	switch {
	case v.Mode == ModeBlock && v.Partitioned:
		return []byte(head + "ID_PART_TABLE_TYPE=gpt\n"),
			fmt.Appendf(nil, "%sID_PART_ENTRY_SCHEME=gpt\nID_PART_ENTRY_NUMBER=1\nID_PART_ENTRY_TYPE=%s\nID_PART_ENTRY_UUID=%s\n",
				head, partTypeLinux, v.UUID)
	case v.Mode == ModeBlock:
		return []byte(head), nil
	case v.State != StateReady || v.FSType == "" || slices.Contains(mkfsTokens(v.MkfsOptions), "-L"):
		return nil, nil
	}
	return fmt.Appendf(nil, "%sID_FS_TYPE=%s\nID_FS_USAGE=filesystem\nID_FS_UUID=%s\nID_FS_UUID_ENC=%s\n", head, v.FSType, v.UUID, v.UUID), nil
}

// identityPath is where udev looks for the identity of dev's binding; ""
// where there is none to write. partitionPath is where it looks for its
// first partition's.
func (s *Store) identityPath(dev *loop.Device) string {
	if s.opts.UdevIdentityDir == "" || dev == nil || dev.DiskSeq == 0 {
		return ""
	}
	return filepath.Join(s.opts.UdevIdentityDir, strconv.FormatUint(dev.DiskSeq, 10))
}

func (s *Store) partitionPath(dev *loop.Device) string {
	if path := s.identityPath(dev); path != "" {
		return path + "p1"
	}
	return ""
}

// writeIdentity leaves v's identity for udev's events of dev, a binding
// proven v's (the caller holds v's lock), unless it is there already in
// a file no one else can change (fsutil.ReadOwnRegular; a name holding
// anything else is replaced, never written through): at
// the bind, as early as it can be (bind, bindMany), and where an attach
// keeps a device (keep), bound before there was one. Nothing is written
// into a directory others may write (identityDir). A failure costs only
// the probe udev makes then (which settleIdentity catches for a raw
// volume): it is logged.
func (s *Store) writeIdentity(v *Volume, dev *loop.Device) {
	disk, part := identityFiles(v)
	if s.identityPath(dev) == "" || disk == nil {
		return
	}
	if err := s.identityDir(); err != nil {
		s.log.Warn("udev identity", "volume", v.Name, "device", dev.Path, "error", err)
		return
	}
	for _, f := range []struct {
		path string
		data []byte
	}{{s.identityPath(dev), disk}, {s.partitionPath(dev), part}} {
		if f.path == "" || f.data == nil {
			continue
		}
		if got, err := fsutil.ReadOwnRegular(f.path, int64(len(f.data))); err == nil && bytes.Equal(got, f.data) {
			continue
		}
		if err := writeNew(f.path, f.data); err != nil {
			s.log.Warn("udev identity", "volume", v.Name, "device", dev.Path, "error", err)
		}
	}
}

// identityDir makes Options.UdevIdentityDir (0755) where it is missing
// and proves it a directory, not a symbolic link, of this process's user
// that no one else may write: udev's rule imports whatever file is named
// there, so a directory someone else can write would let them give any
// binding any identity. The error says how to make it so.
func (s *Store) identityDir() error {
	dir := s.opts.UdevIdentityDir
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		if err = os.MkdirAll(dir, 0o755); err == nil {
			fd, err = unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		}
	}
	if err != nil {
		return fmt.Errorf("udev identity directory %s: %w (it must be a directory, not a symbolic link)", dir, err)
	}
	fd, err = fsutil.CheckFD(fd, func(st *unix.Stat_t) error {
		if st.Uid != uint32(os.Geteuid()) || st.Mode&0o022 != 0 {
			return fmt.Errorf("udev identity directory %s is owned by uid %d with mode %04o: others could put identities there "+
				"(remove it, or chown %d and chmod go-w it): %w", dir, st.Uid, st.Mode&0o7777, os.Geteuid(), ErrUnsafe)
		}
		return nil
	})
	if err != nil {
		return err
	}
	unix.Close(fd)
	return nil
}

// settleIdentity proves that udev's record of dev, a raw volume v's
// binding (the caller holds v's lock), was made from the identity
// writeIdentity left and not by probing content v's user wrote, and
// returns once it is; at ctx's end it fails with errProbed. udev that
// handled the kernel's event of the bind before the file was there
// probed: a change event makes it look again. The rule names the binding
// in every record it makes (SPARSEVOL_DISKSEQ); a record of another
// binding, or one the rule did not make (udev reads a rule installed a
// moment ago only some seconds later), is asked about again every
// retryIdentity. Nothing is proven where udev does not run
// (Options.Udev, looked at now: udevRuns), where the kernel numbers no
// bindings, or for a filesystem volume, whose content is the store's.
func (s *Store) settleIdentity(ctx context.Context, v *Volume, dev *loop.Device) error {
	if !s.udevRuns() || v.Mode != ModeBlock || s.identityPath(dev) == "" {
		return nil
	}
	names := []string{filepath.Base(dev.Path)}
	if v.Partitioned {
		parts, err := loop.Partitions(dev.Path)
		if err != nil {
			return err
		}
		for _, p := range parts {
			names = append(names, filepath.Base(p))
		}
	}
	seq := strconv.FormatUint(dev.DiskSeq, 10)
	for _, name := range names {
		if err := s.awaitIdentity(ctx, name, seq, v.UUID); err != nil {
			return err
		}
	}
	return nil
}

// udevRuns reports whether udev runs in Options.Udev now (its control
// socket, udev.Dir.Running: a stat at every call), and where it finds it
// running after it last found it not (or at its first look) installs
// Options.UdevRule there: a udevd that starts or restarts after the store
// was opened gets the rule at the next attach. Safe for concurrent use:
// one caller installs.
func (s *Store) udevRuns() bool {
	if !s.opts.Udev.Running() {
		s.udevSeen.Store(false)
		return false
	}
	if s.opts.UdevRule != nil && !s.udevSeen.Swap(true) {
		if err := s.opts.Udev.InstallRule(s.opts.UdevRuleName, s.opts.UdevRule); err != nil {
			s.log.Warn("could not install sparsevol's udev rule: udev probes the volumes' content, raw volumes' included, "+
				"instead of importing their identity; install deploy/udev/"+s.opts.UdevRuleName+" in the node's /etc/udev/rules.d",
				"error", err)
		}
	}
	return true
}

// errProbed: udev's record of a raw volume's device never became its
// identity. A device bound by the failed attach is detached again.
var errProbed = errors.New("udev probed a raw volume")

// retryIdentity is how long awaitIdentity lets udev be before it asks
// again.
var retryIdentity = 3 * time.Second

// awaitIdentity waits until udev's record of the block device name (a
// kernel name: loop3, loop3p1) is the store's identity of volume uuid for
// the binding numbered seq, asking udev to look again (udev.Change) while
// it is not. A record that imported a file naming another volume, or
// none (SPARSEVOL_VOLUME), is not the store's identity: the file udev
// read was not the one writeIdentity left.
func (s *Store) awaitIdentity(ctx context.Context, name, seq, uuid string) error {
	last := time.Now() // of the bind, or of the last ask
	asked := false
	interval := 5 * time.Millisecond
	for {
		rec, ok, err := s.opts.Udev.Record(name)
		if err != nil {
			return err
		}
		ours := ok && rec["SPARSEVOL_DISKSEQ"] == seq
		if ours && rec["SPARSEVOL_IDENTITY"] == "store" && rec["SPARSEVOL_VOLUME"] == uuid {
			return nil
		}
		if ours && !asked || time.Since(last) >= retryIdentity {
			s.log.Info("udev's record of a raw volume's device is not its identity; asking udev again", "device", name)
			if err := udev.Change(name); err != nil {
				return err
			}
			last, asked = time.Now(), true
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("udev's record of /dev/%s is not the store's identity "+
				"(is 59-sparsevol.rules installed? `udevadm control --reload`, then attach again): %w: %w", name, errProbed, ctx.Err())
		case <-time.After(interval):
		}
		interval = min(interval*3/2, 100*time.Millisecond)
	}
}

// writeNew writes data to path through a new temporary file renamed into
// place (fsutil.ReplaceFile), so that udev reads all of it or nothing and
// no name already in the directory (a link to another file) is written
// through. Nothing is flushed: the directory is on /run.
func writeNew(path string, data []byte) error {
	if err := fsutil.ReplaceFile(path, data, 0o644, fsutil.FlushNone); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// removeIdentity removes what writeIdentity left for dev's binding, once
// it is detached: never while the kernel still holds it bound (a
// deferred detach), where an event of it would probe the content.
func (s *Store) removeIdentity(dev *loop.Device) {
	if path := s.identityPath(dev); path != "" {
		os.Remove(path)
		os.Remove(s.partitionPath(dev))
	}
}
