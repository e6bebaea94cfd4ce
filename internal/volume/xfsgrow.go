package volume

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The XFS ioctls that grow a mounted filesystem, and their arguments, as
// the kernel's fs/xfs/libxfs/xfs_fs.h defines them; x/sys/unix has none.
const (
	// XFS_IOC_FSGEOMETRY_V1, _IOR('X', 100, struct xfs_fsop_geom_v1).
	ioctlXFSGeometryV1 = 0x80705864
	// XFS_IOC_FSGROWFSDATA, _IOW('X', 110, struct xfs_growfs_data).
	ioctlXFSGrowData = 0x4010586e
)

// xfsGeometryV1 is struct xfs_fsop_geom_v1.
type xfsGeometryV1 struct {
	BlockSize    uint32
	RTExtSize    uint32
	AGBlocks     uint32
	AGCount      uint32
	LogBlocks    uint32
	SectSize     uint32
	InodeSize    uint32
	IMaxPct      uint32
	DataBlocks   uint64
	RTBlocks     uint64
	RTExtents    uint64
	LogStart     uint64
	UUID         [16]byte
	SUnit        uint32
	SWidth       uint32
	Version      int32
	Flags        uint32
	LogSectSize  uint32
	RTSectSize   uint32
	DirBlockSize uint32
}

// xfsGrowData is struct xfs_growfs_data.
type xfsGrowData struct {
	NewBlocks uint64
	IMaxPct   uint32
	_         uint32
}

// growXFSData grows the data section of the XFS filesystem that fd (a
// directory of it, opened and proven by the caller, who keeps and closes
// the fd) belongs to, up to size bytes, the size of its data device, as
// `xfs_growfs -d` does: the block size and inode space limit come from
// the geometry, and the filesystem grows to size in whole blocks with the
// limit unchanged. A filesystem that reaches size already is left alone;
// one larger than size is an error.
func growXFSData(fd int, size uint64) error {
	var geo xfsGeometryV1
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), ioctlXFSGeometryV1, uintptr(unsafe.Pointer(&geo))); errno != 0 {
		return fmt.Errorf("XFS_IOC_FSGEOMETRY_V1: %w", errno)
	}
	if geo.BlockSize == 0 {
		return fmt.Errorf("XFS_IOC_FSGEOMETRY_V1: block size 0")
	}
	blocks := size / uint64(geo.BlockSize)
	switch {
	case blocks < geo.DataBlocks:
		return fmt.Errorf("the filesystem has %d blocks of %d bytes, more than its device's %d bytes hold",
			geo.DataBlocks, geo.BlockSize, size)
	case blocks == geo.DataBlocks:
		return nil
	}
	in := xfsGrowData{NewBlocks: blocks, IMaxPct: geo.IMaxPct}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), ioctlXFSGrowData, uintptr(unsafe.Pointer(&in))); errno != 0 {
		return fmt.Errorf("XFS_IOC_FSGROWFSDATA to %d blocks: %w", blocks, errno)
	}
	return nil
}
