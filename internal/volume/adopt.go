package volume

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// Adopt registers existing sparse files in place, without moving or
// rewriting any data: a file holding ext4 or XFS becomes a filesystem
// volume whose UUID is the filesystem UUID, a file holding a GPT with one
// partition becomes a partitioned block volume whose UUID is the partition
// GUID. If dir is not empty, every path must lie inside it (after resolving
// symlinks); with no paths, every regular file in dir is a candidate.
//
// All candidates are checked before any is registered: one bad file
// rejects the whole call and nothing changes. Files already registered are
// returned as they are (adopt is idempotent).
func (s *Store) Adopt(ctx context.Context, paths []string, dir string) ([]*Volume, error) {
	if dir != "" {
		resolved, err := filepath.EvalSymlinks(dir)
		if err != nil {
			return nil, fmt.Errorf("adopt: directory %s: %w: %w", dir, err, ErrInvalid)
		}
		dir = resolved
		if len(paths) == 0 {
			entries, err := os.ReadDir(dir)
			if err != nil {
				return nil, fmt.Errorf("adopt: %w", err)
			}
			for _, e := range entries {
				if e.Type().IsRegular() {
					paths = append(paths, filepath.Join(dir, e.Name()))
				}
			}
		}
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("adopt: no files to adopt: %w", ErrInvalid)
	}
	unlock, err := s.lock(storeLock)
	if err != nil {
		return nil, err
	}
	defer unlock()
	existing, err := s.List()
	if err != nil {
		return nil, err
	}
	byFile := map[loop.FileID]*Volume{}
	names := map[string]bool{}
	uuids := map[string]bool{}
	for _, v := range existing {
		if id, err := loop.FileIDOf(v.BackingFile); err == nil {
			byFile[id] = v
		}
		names[v.Name] = true
		uuids[v.UUID] = true
	}

	var out, fresh []*Volume
	for _, p := range paths {
		v, err := s.probeForAdoption(ctx, p, dir)
		if err != nil {
			return nil, fmt.Errorf("adopt %s: %w", p, err)
		}
		if id, _ := loop.FileIDOf(v.BackingFile); byFile[id] != nil {
			out = append(out, byFile[id])
			continue
		}
		if uuids[v.UUID] {
			return nil, fmt.Errorf("adopt %s: uuid %s is already a volume of this store: %w", p, v.UUID, ErrExists)
		}
		if names[v.Name] {
			v.Name = v.UUID
		}
		if names[v.Name] {
			return nil, fmt.Errorf("adopt %s: name %s is taken: %w", p, v.Name, ErrExists)
		}
		names[v.Name], uuids[v.UUID] = true, true
		fresh = append(fresh, v)
	}
	for _, v := range fresh {
		if err := s.writeMeta(v); err != nil {
			return nil, err
		}
		s.log.Info("volume adopted", "volume", v.Name, "uuid", v.UUID, "file", v.BackingFile)
		out = append(out, v)
	}
	return out, nil
}

func (s *Store) probeForAdoption(ctx context.Context, path, dir string) (*Volume, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	resolved, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	if dir != "" {
		rel, err := filepath.Rel(dir, resolved)
		if err != nil || rel == ".." || strings.HasPrefix(rel, "../") || filepath.IsAbs(rel) {
			return nil, fmt.Errorf("%s lies outside %s: %w", resolved, dir, ErrInvalid)
		}
	}
	fi, err := os.Stat(resolved)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file: %w", resolved, ErrInvalid)
	}
	if fi.Size() < MiB || fi.Size()%512 != 0 {
		return nil, fmt.Errorf("%s (%d bytes) is not a sparse volume: size not a multiple of 512 or below 1 MiB: %w", resolved, fi.Size(), ErrInvalid)
	}
	v := &Volume{
		Name:        filepath.Base(resolved),
		SizeBytes:   fi.Size(),
		BackingFile: resolved,
		DirectIO:    *s.opts.DirectIO,
		BlockSize:   512, // what losetup used when these files were made
		Adopted:     true,
		State:       StateReady,
		Created:     fi.ModTime().UTC().Truncate(time.Second),
	}
	if ValidateName(v.Name) != nil {
		v.Name = ""
	}
	probe, err := s.run.run(ctx, "blkid", "--probe", "--output", "export", resolved)
	if err != nil && len(probe) == 0 {
		return nil, fmt.Errorf("%s holds no filesystem or partition table blkid knows (blkid: %v): %w", resolved, err, ErrInvalid)
	}
	tags := parseExport(probe)
	switch {
	case tags["TYPE"] == "ext4" || tags["TYPE"] == "xfs":
		v.Mode, v.FSType, v.UUID = ModeFilesystem, tags["TYPE"], strings.ToLower(tags["UUID"])
	case tags["PTTYPE"] == "gpt":
		guid, err := s.singlePartitionGUID(ctx, resolved)
		if err != nil {
			return nil, err
		}
		v.Mode, v.Partitioned, v.UUID = ModeBlock, true, guid
	default:
		return nil, fmt.Errorf("%s is not a sparse volume: no ext4, xfs or GPT found: %w", resolved, ErrInvalid)
	}
	if !ValidUUID(v.UUID) {
		return nil, fmt.Errorf("%s: on-disk UUID %q is not a UUID: %w", resolved, v.UUID, ErrInvalid)
	}
	if v.Name == "" {
		v.Name = v.UUID
	}
	return v, nil
}

func (s *Store) singlePartitionGUID(ctx context.Context, path string) (string, error) {
	out, err := s.run.run(ctx, "sfdisk", "--json", path)
	if err != nil {
		return "", fmt.Errorf("read partition table: %w: %w", err, ErrInvalid)
	}
	var table struct {
		PartitionTable struct {
			Partitions []struct {
				UUID string `json:"uuid"`
			} `json:"partitions"`
		} `json:"partitiontable"`
	}
	if err := json.Unmarshal(out, &table); err != nil {
		return "", fmt.Errorf("read partition table: %w", err)
	}
	if n := len(table.PartitionTable.Partitions); n != 1 {
		return "", fmt.Errorf("%s has %d partitions, a sparse block volume has exactly one: %w", path, n, ErrInvalid)
	}
	return strings.ToLower(table.PartitionTable.Partitions[0].UUID), nil
}

// parseExport reads blkid's KEY=value lines.
func parseExport(b []byte) map[string]string {
	tags := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			tags[k] = v
		}
	}
	return tags
}
