package volume

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
)

// Found is what blkid recognises on a device or file: a filesystem (Type,
// UUID) or a partition table (PTType). Empty fields: nothing recognised.
type Found struct {
	Type   string
	UUID   string
	PTType string
}

func (f Found) String() string {
	switch {
	case f.Type != "":
		return fmt.Sprintf("%s with UUID %q", f.Type, f.UUID)
	case f.PTType != "":
		return "a " + f.PTType + " partition table"
	}
	return "nothing blkid recognises"
}

// probe asks blkid, bypassing its cache, what path holds. Nothing
// recognised is not an error (blkid exits 2 with no output then).
func (s *Store) probe(ctx context.Context, path string) (Found, error) {
	out, err := s.run.run(ctx, "blkid", "--probe", "--output", "export", path)
	if err != nil && len(out) == 0 {
		if exitCode(err) == 2 {
			return Found{}, nil
		}
		return Found{}, fmt.Errorf("probe %s: %w", path, err)
	}
	tags := parseExport(out)
	return Found{Type: tags["TYPE"], UUID: strings.ToLower(tags["UUID"]), PTType: tags["PTTYPE"]}, nil
}

// CheckFilesystem proves that device holds v's own filesystem: type
// v.FSType and UUID v.UUID. Anything else (nothing, another filesystem,
// another UUID) is ErrMismatch, naming what was found and how to look at
// it; callers never format in answer to it. Only Create formats.
//
// The superblock is read in process first (superblockOf); what that does
// not prove is the volume's own goes to blkid, whose answer decides.
func (s *Store) CheckFilesystem(ctx context.Context, v *Volume, device string) error {
	if v.Mode != ModeFilesystem {
		return nil
	}
	if superblockOf(device, v.FSType) == (Found{Type: v.FSType, UUID: v.UUID}) {
		return nil
	}
	found, err := s.probe(ctx, device)
	if err != nil {
		return fmt.Errorf("volume %s: %w", v.Name, err)
	}
	if found.Type == v.FSType && found.UUID == v.UUID {
		return nil
	}
	return fmt.Errorf("volume %s: %s holds %s, not the volume's %s with UUID %s (inspect it with `blkid -p %s`%s; only create formats a volume): %w",
		v.Name, device, found, v.FSType, v.UUID, device, fsckHint(v.FSType, device), ErrMismatch)
}

func fsckHint(fsType, device string) string {
	switch fsType {
	case "ext4":
		return " and `e2fsck -n " + device + "`"
	case "xfs":
		return " and `xfs_repair -n " + device + "`"
	}
	return ""
}

// partitionTable is what sfdisk --json says of a partition table.
type partitionTable struct {
	LastLBA    int64 `json:"lastlba"`
	Partitions []struct {
		Start int64  `json:"start"`
		Size  int64  `json:"size"`
		UUID  string `json:"uuid"`
	} `json:"partitions"`
}

// readPartitionTable reads the partition table of path (a device or a file).
func (s *Store) readPartitionTable(ctx context.Context, path string) (partitionTable, error) {
	out, err := s.run.run(ctx, "sfdisk", "--json", path)
	if err != nil {
		return partitionTable{}, fmt.Errorf("read partition table of %s: %w", path, err)
	}
	var doc struct {
		PartitionTable partitionTable `json:"partitiontable"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		return partitionTable{}, fmt.Errorf("read partition table of %s: %w", path, err)
	}
	return doc.PartitionTable, nil
}
