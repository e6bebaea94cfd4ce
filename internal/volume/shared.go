package volume

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Space of files that share extents (a snapshot and its volume on a
// reflink store, a clone and its source) is counted once: FIEMAP reports
// each extent of a file with its physical place and FIEMAP_EXTENT_SHARED
// when another file uses it too. A file's own cost is its extents that
// are not shared; the store's allocation is every file's own cost plus
// the union of the shared physical ranges.

// fileUsage is what FIEMAP says of one file.
type fileUsage struct {
	own    int64       // bytes in extents no other file shares
	shared []physRange // physical ranges of the shared extents
}

type physRange struct{ start, end uint64 }

func (u fileUsage) sharedBytes() int64 {
	var n int64
	for _, r := range u.shared {
		n += int64(r.end - r.start)
	}
	return n
}

// FIEMAP's structures (linux/fiemap.h).
const (
	ioctlFIEMAP       = 0xc020660b // _IOWR('f', 11, struct fiemap)
	fiemapHeader      = 32
	fiemapExtentSize  = 56
	fiemapBatch       = 256
	fiemapExtentLast  = 0x1
	fiemapExtentShare = 0x2000
)

// errNoFiemap: the filesystem cannot map extents (tmpfs, some network
// filesystems); callers count st_blocks as the file's own.
var errNoFiemap = errors.New("FIEMAP not supported")

// usageOf maps the extents of the open file fd.
func usageOf(fd int) (fileUsage, error) {
	var u fileUsage
	buf := make([]byte, fiemapHeader+fiemapBatch*fiemapExtentSize)
	ne := binary.NativeEndian
	for start := uint64(0); ; {
		clear(buf)
		ne.PutUint64(buf[0:], start)            // fm_start
		ne.PutUint64(buf[8:], ^uint64(0)-start) // fm_length: to the end
		ne.PutUint32(buf[24:], fiemapBatch)     // fm_extent_count
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), ioctlFIEMAP, uintptr(unsafe.Pointer(&buf[0])))
		if errno == unix.EOPNOTSUPP || errno == unix.ENOTTY {
			return u, errNoFiemap
		}
		if errno != 0 {
			return u, fmt.Errorf("FIEMAP: %w", errno)
		}
		n := int(ne.Uint32(buf[20:])) // fm_mapped_extents
		if n == 0 {
			return u, nil
		}
		last := false
		for i := 0; i < n; i++ {
			e := fiemapHeader + i*fiemapExtentSize
			logical, physical, length := ne.Uint64(buf[e:]), ne.Uint64(buf[e+8:]), ne.Uint64(buf[e+16:])
			flags := ne.Uint32(buf[e+40:])
			if flags&fiemapExtentShare != 0 {
				u.shared = append(u.shared, physRange{physical, physical + length})
			} else {
				u.own += int64(length)
			}
			start = logical + length
			last = last || flags&fiemapExtentLast != 0
		}
		if last {
			return u, nil
		}
	}
}

// countOnce returns the bytes the files of us occupy together: each file's
// own bytes, and every shared physical range once.
func countOnce(us []fileUsage) int64 {
	var total int64
	var ranges []physRange
	for _, u := range us {
		total += u.own
		ranges = append(ranges, u.shared...)
	}
	sort.Slice(ranges, func(i, j int) bool { return ranges[i].start < ranges[j].start })
	var end uint64
	for _, r := range ranges {
		if r.start < end {
			if r.end <= end {
				continue
			}
			r.start = end
		}
		total += int64(r.end - r.start)
		end = r.end
	}
	return total
}

// measureFile returns the usage of the file name in dir (the rules of
// backing.go apply) and its st_blocks in bytes. A file that is missing or
// breaks the rules counts nothing; where FIEMAP is missing, st_blocks is
// the file's own.
func (s *Store) measureFile(dir int, name, kind, path string) (fileUsage, int64) {
	fd, _, err := s.openIn(dir, name, kind, path, unix.O_RDONLY)
	if err != nil {
		return fileUsage{}, 0
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fileUsage{}, 0
	}
	allocated := st.Blocks * 512
	u, err := usageOf(fd)
	if err != nil {
		return fileUsage{own: allocated}, allocated
	}
	return u, allocated
}

// measureSnapshots fills AllocatedBytes and OwnBytes of sns.
func (s *Store) measureSnapshots(sns []*Snapshot) {
	dir, err := s.snapDirFD()
	if err != nil {
		return
	}
	defer unix.Close(dir)
	for _, sn := range sns {
		if sn.State == StateBroken {
			continue
		}
		u, allocated := s.measureFile(dir, sn.UUID, "snapshot file", s.snapPath(sn.UUID))
		sn.AllocatedBytes, sn.OwnBytes = allocated, u.own
	}
}

// sharedBytes is how much of volume uuid's backing file other files share.
func (s *Store) sharedBytes(uuid string) int64 {
	dir, err := s.dirFD()
	if err != nil {
		return 0
	}
	defer unix.Close(dir)
	u, _ := s.measureFile(dir, uuid, "backing file", s.backingPath(uuid))
	return u.sharedBytes()
}

// snapshotsHeld is what the files of sns hold (st_blocks), as allocation
// counts it: nothing for a file that is missing or breaks the rules.
func (s *Store) snapshotsHeld(sns []*Snapshot) int64 {
	if len(sns) == 0 {
		return 0
	}
	dir, err := s.snapDirFD()
	if err != nil {
		return 0
	}
	defer unix.Close(dir)
	var held int64
	for _, sn := range sns {
		if sn.State == StateBroken {
			continue
		}
		if st, err := s.statIn(dir, sn.UUID, "snapshot file", s.snapPath(sn.UUID)); err == nil {
			held += st.Blocks * 512
		}
	}
	return held
}

// allocation measures the store's volumes and snapshots: what their files
// occupy together (shared extents once), and what the snapshots' files
// hold (each may come to own all of it as its source changes).
func (s *Store) allocation(vols []*Volume, sns []*Snapshot) (allocated, snapshotsHeld int64) {
	dir, err := s.dirFD()
	if err != nil {
		return 0, 0
	}
	defer unix.Close(dir)
	var us []fileUsage
	for _, v := range vols {
		u, _ := s.measureFile(dir, v.UUID, "backing file", s.backingPath(v.UUID))
		us = append(us, u)
	}
	if len(sns) > 0 {
		sdir, err := s.snapDirFD()
		if err == nil {
			defer unix.Close(sdir)
			for _, sn := range sns {
				if sn.State == StateBroken {
					continue
				}
				u, held := s.measureFile(sdir, sn.UUID, "snapshot file", s.snapPath(sn.UUID))
				us = append(us, u)
				snapshotsHeld += held
			}
		}
	}
	return countOnce(us), snapshotsHeld
}
