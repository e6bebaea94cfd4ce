package volume

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/loop"
)

// The filesystem identity udev gives a volume's device, from the store.
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
// directory (on /run). Detach removes the file.
//
// Raw volumes are probed as before (their partition table is their user's
// to change), and so are volumes with a filesystem label (e2label can
// change it; the probe keeps /dev/disk/by-label right).

// identityFile is what udev imports for v, or nil if v is probed.
func identityFile(v *Volume) []byte {
	if v.State != StateReady || v.Mode != ModeFilesystem || v.FSType == "" || !ValidUUID(v.UUID) ||
		slices.Contains(v.MkfsOptions, "-L") {
		return nil
	}
	return fmt.Appendf(nil, "ID_FS_TYPE=%s\nID_FS_USAGE=filesystem\nID_FS_UUID=%s\nID_FS_UUID_ENC=%s\n", v.FSType, v.UUID, v.UUID)
}

// identityPath is where udev looks for the identity of dev's binding; ""
// where there is none to write.
func (s *Store) identityPath(dev *loop.Device) string {
	if s.opts.UdevIdentityDir == "" || dev == nil || dev.DiskSeq == 0 {
		return ""
	}
	return filepath.Join(s.opts.UdevIdentityDir, strconv.FormatUint(dev.DiskSeq, 10))
}

// writeIdentity leaves v's identity for udev's event of dev, a binding of
// v's this call made and proved (the caller holds v's lock). A failure
// costs only the probe udev makes then: it is logged.
func (s *Store) writeIdentity(v *Volume, dev *loop.Device) {
	path := s.identityPath(dev)
	data := identityFile(v)
	if path == "" || data == nil {
		return
	}
	err := writeNew(path, data)
	if errors.Is(err, unix.ENOENT) {
		if err = os.MkdirAll(s.opts.UdevIdentityDir, 0o755); err == nil {
			err = writeNew(path, data)
		}
	}
	if err != nil {
		s.log.Warn("udev identity", "volume", v.Name, "device", dev.Path, "error", err)
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
// it is detached.
func (s *Store) removeIdentity(dev *loop.Device) {
	if path := s.identityPath(dev); path != "" {
		os.Remove(path)
	}
}
