package volume

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Export and import move a volume between nodes as a sparse stream
// (stream.go): `sparsevol export data | ssh node2 sparsevol import data`.

// StreamOptions tune Export and Import.
type StreamOptions struct {
	// Progress, if set, is called with the bytes of the volume covered.
	Progress func(done, total int64)
}

// Export writes the volume or snapshot ref (a volume's name or UUID
// first, then a snapshot's) to w as a sparse stream. A volume is exported
// under its lock and only while nothing uses it (ErrBusy otherwise: take a
// snapshot and export that); a snapshot under its lock.
func (s *Store) Export(ctx context.Context, ref string, w io.Writer, opts StreamOptions) (*StreamHeader, error) {
	v, verr := s.Get(ref)
	if verr != nil && !errors.Is(verr, ErrNotFound) {
		return nil, verr
	}
	sn, serr := s.findSnapshot(ref)
	switch {
	case serr != nil && !errors.Is(serr, ErrNotFound):
		return nil, serr
	case verr == nil && serr == nil:
		return nil, fmt.Errorf("export %s: names a volume and a snapshot; give the UUID (%s or %s): %w", Quote(ref), v.UUID, sn.UUID, ErrInvalid)
	case verr == nil:
		return s.exportVolume(ctx, v.UUID, w, opts)
	case serr == nil:
		return s.exportSnapshot(ctx, sn, w, opts)
	}
	return nil, fmt.Errorf("export %s: no volume or snapshot of that name or UUID: %w", Quote(ref), ErrNotFound)
}

func (s *Store) exportVolume(ctx context.Context, uuid string, w io.Writer, opts StreamOptions) (*StreamHeader, error) {
	var h *StreamHeader
	err := s.withVolume(uuid, func(v *Volume) error {
		if v.State != StateReady || v.ExpandingTo != 0 {
			return fmt.Errorf("export %s: state %s: %w", v.Name, stateOf(v), ErrNotReady)
		}
		fd, _, ours, err := s.openOwned(v, "export")
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := busy(ours); err != nil {
			return fmt.Errorf("export %s: %w (a copy of a volume in use is not consistent: `sparsevol snapshot create %s NAME`, then export the snapshot)", v.Name, err, v.Name)
		}
		// Unused but attached: what its device buffers reaches the file.
		q, err := s.quiesce(v, ours)
		if err != nil {
			return err
		}
		q.release()
		h = &StreamHeader{Name: v.Name, UUID: v.UUID, SizeBytes: v.SizeBytes, Mode: v.Mode, FSType: v.FSType,
			Partitioned: v.Partitioned, BlockSize: v.BlockSize, CreatedAt: v.Created}
		// The file is read over time: a stream of a volume used or
		// written meanwhile may be torn, and is left without its end.
		return writeFile(ctx, w, h, fd, opts.Progress, func() error {
			if q.settle(CopySparse) != ConsistencyQuiet {
				return fmt.Errorf("volume %s was used or written while it was read, so the stream may be torn: it is left without its end, which import refuses; stop its users and export again, or `sparsevol snapshot create %s NAME` and export the snapshot: %w", v.Name, v.Name, ErrBusy)
			}
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("export: %w", err)
	}
	return h, nil
}

func (s *Store) exportSnapshot(ctx context.Context, sn *Snapshot, w io.Writer, opts StreamOptions) (*StreamHeader, error) {
	unlock, err := s.lock(snapLock(sn.UUID))
	if err != nil {
		return nil, err
	}
	defer unlock()
	sn, err = s.readSnapMeta(sn.UUID)
	if err != nil {
		return nil, fmt.Errorf("export: %w", err)
	}
	fd, err := s.openSnapshot(sn)
	if err != nil {
		return nil, fmt.Errorf("export: %w", err)
	}
	defer unix.Close(fd)
	// The volume made of it on the other side is named after the source
	// (a valid name: readSnapMeta checked it).
	h := &StreamHeader{Name: sn.SourceName, UUID: sn.SourceUUID, SizeBytes: sn.SizeBytes, Mode: sn.Mode, FSType: sn.FSType,
		Partitioned: sn.Partitioned, BlockSize: sn.BlockSize, Snapshot: sn.Name, CreatedAt: sn.CreatedAt}
	if err := writeFile(ctx, w, h, fd, opts.Progress, nil); err != nil {
		return nil, fmt.Errorf("export %s: %w", sn.Name, err)
	}
	return h, nil
}

// CheckStreamTarget refuses, with ErrInvalid, the open file f as the
// place a stream is written to where it is a file of the store: a
// volume's backing file (the one exported, too), a snapshot's file or a
// record, which the stream would overwrite or be appended to (`export v
// 1<>FILE`, `>>FILE`) while export reports success. Only a regular file
// on the store's filesystem is looked for, among the store's files
// (links not followed, other filesystems not entered); pipes, terminals
// and files elsewhere pass. The export command calls it on its stdout
// before Export.
func (s *Store) CheckStreamTarget(f *os.File) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("check where the stream goes: stat %s: %w", Shown(f.Name()), err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Dev != s.dir.dev {
		return nil
	}
	found := ""
	walkErr := filepath.WalkDir(s.root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var lst unix.Stat_t
		if err := unix.Lstat(path, &lst); err != nil {
			return err
		}
		switch {
		case lst.Dev != st.Dev && d.IsDir():
			return fs.SkipDir // a mount inside the store (an expansion's)
		case lst.Dev == st.Dev && lst.Ino == st.Ino:
			found = path
			return fs.SkipAll
		}
		return nil
	})
	if found != "" {
		return fmt.Errorf("stdout is %s, a file of the store %s, which the stream would overwrite; redirect it to a file outside the store or a pipe: %w", Shown(found), Shown(s.root), ErrInvalid)
	}
	if walkErr != nil {
		return fmt.Errorf("check where the stream goes: %w", walkErr)
	}
	return nil
}

// writeFile streams the data ranges of the open file fd (up to h's size)
// to w; chunks of zeroes are left out like holes. settled, if set, is
// called once the data is written: an error from it is returned and the
// stream left without its end record, which import refuses.
func writeFile(ctx context.Context, w io.Writer, h *StreamHeader, fd int, progress func(done, total int64), settled func() error) error {
	if err := h.check(); err != nil {
		return fmt.Errorf("%s cannot be exported: %v: %w", h.Name, err, ErrInvalid)
	}
	sw, err := newStreamWriter(w, h)
	if err != nil {
		return err
	}
	buf := make([]byte, maxExtent)
	err = eachDataRange(fd, h.SizeBytes, func(start, end int64) error {
		for off := start; off < end; {
			if err := ctx.Err(); err != nil {
				return err
			}
			chunk := buf[:min(int64(len(buf)), end-off)]
			if err := readAt(fd, chunk, off); err != nil {
				return err
			}
			if !allZero(chunk) {
				if err := sw.extent(off, chunk); err != nil {
					return fmt.Errorf("write the stream: %w", err)
				}
			}
			off += int64(len(chunk))
			if progress != nil {
				progress(off, h.SizeBytes)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	if settled != nil {
		if err := settled(); err != nil {
			return err
		}
	}
	if err := sw.close(); err != nil {
		return fmt.Errorf("write the stream: %w", err)
	}
	if progress != nil {
		progress(h.SizeBytes, h.SizeBytes)
	}
	return nil
}

// ImportRequest describes a volume made from a stream.
type ImportRequest struct {
	Name string
	// KeepUUID keeps the stream's UUID (the volume's identity on disk) if
	// nothing on this node has it; otherwise the volume gets a new one.
	KeepUUID     bool
	KeepAttached bool
	Labels       map[string]string
	StreamOptions
}

// importSpare is what an import leaves free on the store's filesystem for
// everyone else's writes: the header's check is the overcommit policy's,
// and a stream says how much data it holds only at its end, so each
// record must find room beside the spare as it comes (docs/design.md).
const importSpare = 16 << 20

var importSpareWhat = "the stream's next data and the " + FormatSize(importSpare) + " an import leaves free"

// Import makes a volume named req.Name from the stream r. The stream is
// written into an unnamed file of the store (O_TMPFILE), its writeback
// started as it arrives (writebehind.go), each record only while the
// store's filesystem has room for it and importSpare (ErrNoSpace
// otherwise), and checked completely (format,
// bounds, order, checksum) and flushed before the volume appears;
// then it goes through Create's steps (state creating, device, identity,
// unit, ready). A failed import leaves nothing; a killed one leaves
// nothing either before the stream was checked, and a volume in state
// creating for Delete after.
func (s *Store) Import(ctx context.Context, r io.Reader, req ImportRequest) (*Volume, error) {
	if err := ValidateName(req.Name); err != nil {
		return nil, fmt.Errorf("import %s: %w", Quote(req.Name), err)
	}
	if err := ValidateLabels(req.Labels); err != nil {
		return nil, fmt.Errorf("import %s: %w", Quote(req.Name), err)
	}
	if v, err := s.Get(req.Name); err == nil {
		if v.State == StateCreating {
			return nil, fmt.Errorf("import %s: name is taken by volume %s (%s), which %s: %w", req.Name, v.UUID, v.State, v.finishAdvice(), ErrExists)
		}
		return nil, fmt.Errorf("import %s: name is taken by volume %s: %w", req.Name, v.UUID, ErrExists)
	}
	dir, err := s.dirFD()
	if err != nil {
		return nil, err
	}
	defer unix.Close(dir)
	fd, err := unix.Openat(dir, ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("import %s: unnamed file in %s: %w", req.Name, s.root, err)
	}
	defer unix.Close(fd)
	var size int64
	wb := newWriteBehind(fd)
	h, err := readStream(r, func(h *StreamHeader) error {
		if err := s.checkSpace(h.SizeBytes, false); err != nil {
			return err
		}
		size = h.SizeBytes
		if err := unix.Ftruncate(fd, h.SizeBytes); err != nil {
			if errors.Is(err, unix.EFBIG) {
				// Knowable up front, and nothing was written.
				err = fmt.Errorf("%w (the store's filesystem holds no file that large; import it into a store on XFS): %w", err, ErrInvalid)
			}
			return fmt.Errorf("size the unnamed file to the stream's %s: %w", FormatSize(h.SizeBytes), err)
		}
		return nil
	}, func(off int64, data []byte) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := s.roomFor(int64(len(data))+importSpare, importSpareWhat); err != nil {
			return err
		}
		for len(data) > 0 {
			n, err := unix.Pwrite(fd, data, off)
			if err != nil {
				return fmt.Errorf("write at %d: %w", off, err)
			}
			if err := wb.wrote(off, int64(n)); err != nil {
				return err
			}
			data, off = data[n:], off+int64(n)
		}
		if req.Progress != nil {
			req.Progress(off, size)
		}
		return nil
	})
	// What readStream's callbacks write goes into the store; the stream
	// is only read.
	if err != nil {
		return nil, fmt.Errorf("import %s: %w", req.Name, s.inStore(err))
	}
	if err := unix.Fsync(fd); err != nil {
		return nil, fmt.Errorf("import %s: %w", req.Name, s.inStore(err))
	}
	crashPoint("import:checked")
	creq := CreateRequest{
		Name: req.Name, SizeBytes: h.SizeBytes, Mode: h.Mode, FSType: h.FSType,
		NoPartition: h.Mode == ModeBlock && !h.Partitioned, KeepAttached: req.KeepAttached, Labels: req.Labels,
		source: &source{imported: true, importFD: fd, sizeBytes: h.SizeBytes, blockSz: max(h.BlockSize, 512)},
	}
	if req.KeepUUID {
		if err := s.uuidFree(h.UUID); err != nil {
			return nil, fmt.Errorf("import %s: --keep-uuid: %w", req.Name, err)
		}
		creq.UUID, creq.source.keepIdentity = h.UUID, true
	}
	return s.Create(ctx, creq)
}

// diskDir is where udev links the node's filesystems and partitions by
// UUID (by-uuid, by-partuuid); tests point it at a directory of their own.
var diskDir = "/dev/disk"

// uuidFree refuses, with ErrExists, a UUID that a volume or snapshot of
// the store, another store's link or a filesystem or partition of this
// node has. Import --keep-uuid and adopt keep a UUID they did not
// choose, and create is given one (--uuid): this is their one rule.
func (s *Store) uuidFree(uuid string) error {
	if v, err := s.Get(uuid); err == nil {
		return fmt.Errorf("uuid %s is taken by volume %s: %w", uuid, v.Name, ErrExists)
	}
	if sn, err := s.findSnapshot(uuid); err == nil {
		return fmt.Errorf("uuid %s is taken by snapshot %s: %w", uuid, sn.Name, ErrExists)
	}
	for _, dir := range []string{"by-uuid", "by-partuuid"} {
		link := filepath.Join(diskDir, dir, uuid)
		if _, err := os.Lstat(link); err == nil {
			return fmt.Errorf("uuid %s is on this node already (%s): %w", uuid, link, ErrExists)
		}
	}
	return LinkedElsewhere(uuid)
}

// linkImported gives the checked unnamed file fd the name <root>/<uuid>
// (a file a crashed import left under it is replaced).
func (s *Store) linkImported(v *Volume, fd int) error {
	if err := s.removeBacking(v.UUID); err != nil {
		return err
	}
	dir, err := s.dirFD()
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	if err := unix.Linkat(unix.AT_FDCWD, procFD(fd), dir, v.UUID, unix.AT_SYMLINK_FOLLOW); err != nil {
		return &os.PathError{Op: "link", Path: v.BackingFile, Err: err}
	}
	return nil
}
