package volume

import (
	"context"
	"fmt"
	"strings"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// A volume made from a snapshot, a clone or an import gets an identity of
// its own, the new volume's UUID, so that two volumes never share a
// /dev/disk/by-uuid or by-partuuid link: the filesystem UUID (ext4
// tune2fs -U, XFS xfs_admin -U) or the GPT partition GUID (and a new disk
// GUID). A whole-device raw volume carries no identity on disk.

// checkCopy proves that the copy on path (v's device, bound at size
// bytes, the source's) holds what its source's record says, before any
// tool reads or writes it (newIdentity, checkIdentity, a mount): a
// filesystem of v's type whose superblock claims no more than size
// bytes, or a GPT for a partitioned volume. A copy's content is not its
// record's: a stream is forged by whoever sends it, a snapshot of a block
// volume holds what its pod wrote. Only blkid, the prober, and the
// superblock reader of this process look at it first. Anything else is
// ErrMismatch, naming what the copy holds. A whole-device raw volume
// holds nothing a tool runs on.
func (s *Store) checkCopy(ctx context.Context, v *Volume, path string, size int64) error {
	if v.Mode == ModeBlock && !v.Partitioned {
		return nil
	}
	found, err := s.probe(ctx, path)
	if err != nil {
		return fmt.Errorf("check the copy for %s: %w", v.Name, err)
	}
	const use = "a damaged or forged stream or snapshot; use another"
	if v.Mode == ModeBlock {
		if found.PTType != "gpt" {
			return fmt.Errorf("check the copy for %s: it holds %s, not the GPT its source names (%s): %w", v.Name, found, use, ErrMismatch)
		}
		return nil
	}
	if found.Type != v.FSType {
		return fmt.Errorf("check the copy for %s: it holds %s, not the %s its source names (%s): %w", v.Name, found, v.FSType, use, ErrMismatch)
	}
	if n, ok := fsBytes(path, v.FSType); !ok || n > size {
		claim := "a size no kernel mounts"
		if ok {
			claim = FormatSize(n)
		}
		return fmt.Errorf("check the copy for %s: its %s superblock claims %s, the copy has %s (%s): %w", v.Name, v.FSType, claim, FormatSize(size), use, ErrMismatch)
	}
	return nil
}

// newIdentity gives the copy on dev (v's, held by the caller, who
// holds v's lock; nothing mounts it; checkCopy proved it) v's UUID. ext4 is checked first
// (e2fsck -f -p replays the journal of a copy of a frozen or running
// filesystem, and tune2fs -U wants a checked one); XFS is mounted once,
// privately and with nouuid (the source may be mounted), to replay its
// log, since xfs_admin refuses a dirty log.
func (s *Store) newIdentity(ctx context.Context, v *Volume, dev *loop.Device) error {
	device := dev.Path
	var err error
	switch {
	case v.FSType == "ext4":
		if err = s.fsckCopy(ctx, device); err == nil {
			_, err = s.run.run(ctx, "tune2fs", "-U", v.UUID, device)
		}
	case v.FSType == "xfs":
		err = s.tempMount(v, dev, "nouuid", func(int) error { return nil })
		if err != nil {
			err = fmt.Errorf("replay the log: %w", err)
		} else {
			// What `xfs_admin -U` runs: xfs_admin is a shell script, and
			// the plugin's image carries no shell scripts.
			_, err = s.run.run(ctx, "xfs_db", "-x", "-p", "xfs_admin", "-c", "uuid "+v.UUID, device)
		}
	case v.Partitioned:
		_, err = s.run.run(ctx, "sgdisk", "--partition-guid=1:"+v.UUID, "--disk-guid=R", device)
	default:
		return nil // a whole-device raw volume has no identity
	}
	if err != nil {
		return fmt.Errorf("new identity for %s: %w", v.Name, err)
	}
	return s.checkIdentity(ctx, v, device)
}

// fsckCopy checks (and repairs: journal replay) the ext4 copy at path.
// Exit status 1 means errors were corrected, which a crash-consistent copy
// may need.
func (s *Store) fsckCopy(ctx context.Context, path string) error {
	if _, err := s.run.run(ctx, "e2fsck", "-f", "-p", path); err != nil && exitCode(err) != 1 {
		return err
	}
	return nil
}

// checkIdentity proves the copy at path (a device or file) carries v's
// identity: after newIdentity (xfs_admin, for one, exits 0 when it
// refused), and where an import keeps the stream's UUID.
func (s *Store) checkIdentity(ctx context.Context, v *Volume, path string) error {
	if v.Mode == ModeFilesystem {
		found, err := s.probe(ctx, path)
		if err != nil {
			return fmt.Errorf("identity of %s: %w", v.Name, err)
		}
		if found.Type != v.FSType || found.UUID != v.UUID {
			return fmt.Errorf("identity of %s: the copy holds %s, want %s with UUID %s: %w", v.Name, found, v.FSType, v.UUID, ErrMismatch)
		}
		return nil
	}
	table, err := s.readPartitionTable(ctx, path)
	if err != nil {
		return fmt.Errorf("identity of %s: %w", v.Name, err)
	}
	if len(table.Partitions) != 1 || !strings.EqualFold(table.Partitions[0].UUID, v.UUID) {
		return fmt.Errorf("identity of %s: the copy's partition table is not one partition with GUID %s: %w", v.Name, v.UUID, ErrMismatch)
	}
	return nil
}
