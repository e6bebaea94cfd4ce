package volume

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// superblockOf reads the identity of the fsType filesystem at path (a
// device or a file) from its superblock, in process: Found{Type, UUID}
// where the superblock is fsType's by the rules blkid applies to it
// (magic, features, checksum), the zero Found where it is not or where
// this reader is not sure (no checksum to verify, a read that fails).
//
// It only ever confirms: CheckFilesystem accepts what it proves to be
// the volume's own filesystem and asks blkid, which has the last word,
// about everything else.
func superblockOf(path, fsType string) Found {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return Found{}
	}
	defer f.Close()
	buf := make([]byte, 4096)
	if _, err := f.ReadAt(buf, 0); err != nil {
		return Found{}
	}
	switch fsType {
	case "ext4":
		return ext4Superblock(buf[1024:2048])
	case "xfs":
		return xfsSuperblock(f, buf)
	}
	return Found{}
}

// PanicsOnError reports whether the ext4 superblock at path (a device
// or a file) tells the kernel to panic on a filesystem error (mkfs -e
// panic, tune2fs -e panic), which is where the kernel takes the error
// behaviour from when the mount options name none. An image made by
// someone else (adopted, imported) may say so, whatever sparsevol's own
// mkfs allows (Ext4ErrorBehaviors). Unreadable or not ext4: false.
func PanicsOnError(path string) bool {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	sb := make([]byte, 1024)
	if _, err := f.ReadAt(sb, 1024); err != nil {
		return false
	}
	le := binary.LittleEndian
	return le.Uint16(sb[extMagicOff:]) == extMagic && le.Uint16(sb[extErrorsOff:]) == extErrorsPanic
}

// fsBytes returns the size the fsType filesystem at path (a device or a
// file) claims in its superblock, its block count times its block size,
// read in process with no tool: false where path holds no superblock of
// fsType or one whose block size the kernel would not mount. Nothing is
// verified but those fields (a checksum proves nothing of a forged
// superblock): it bounds the filesystem a copy holds before tools see it.
// A size beyond int64 is math.MaxInt64.
func fsBytes(path, fsType string) (int64, bool) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, false
	}
	defer f.Close()
	buf := make([]byte, 2048)
	if _, err := f.ReadAt(buf, 0); err != nil {
		return 0, false
	}
	var blocks, blockSize uint64
	switch fsType {
	case "ext4":
		le, sb := binary.LittleEndian, buf[1024:]
		if le.Uint16(sb[extMagicOff:]) != extMagic || le.Uint32(sb[extLogBlockOff:]) > extMaxLogBlock {
			return 0, false
		}
		blockSize = 1024 << le.Uint32(sb[extLogBlockOff:])
		blocks = uint64(le.Uint32(sb[extBlocksOff:]))
		if le.Uint32(sb[extIncompatOff:])&ext64Bit != 0 {
			blocks |= uint64(le.Uint32(sb[extBlocksHiOff:])) << 32
		}
	case "xfs":
		be := binary.BigEndian
		if string(buf[:4]) != "XFSB" {
			return 0, false
		}
		blockSize, blocks = uint64(be.Uint32(buf[xfsBlockSizeOff:])), be.Uint64(buf[xfsDBlocksOff:])
		if blockSize < 512 || blockSize > 65536 || blockSize&(blockSize-1) != 0 {
			return 0, false
		}
	default:
		return 0, false
	}
	if blocks > math.MaxInt64/blockSize {
		return math.MaxInt64, true
	}
	return int64(blocks * blockSize), true
}

// ext4 superblock fields (offsets into the superblock, 1 KiB in) and
// the feature bits blkid tells ext2, ext3, ext4 and journals apart by.
const (
	extBlocksOff    = 0x04 // s_blocks_count_lo
	extLogBlockOff  = 0x18 // s_log_block_size: 1 KiB shifted left by it
	extMaxLogBlock  = 6    // 64 KiB, the largest block size ext4 has
	extBlocksHiOff  = 0x150
	ext64Bit        = 0x0080 // incompat: s_blocks_count_hi counts
	extMagicOff     = 0x38
	extErrorsOff    = 0x3c // s_errors: 1 continue, 2 remount-ro, 3 panic
	extErrorsPanic  = 3
	extCompatOff    = 0x5c
	extIncompatOff  = 0x60
	extROCompatOff  = 0x64
	extUUIDOff      = 0x68
	extFlagsOff     = 0x160
	extChecksumOff  = 0x3fc
	extMagic        = 0xef53
	extJournalDev   = 0x0008 // incompat: an external journal, no filesystem
	extMetadataCsum = 0x0400 // ro_compat: the superblock carries a crc32c
	extTestFS       = 0x0004 // s_flags: ext4dev
	// What ext3 understands; a feature beyond these makes ext4.
	ext3ROCompat = 0x0001 | 0x0002 | 0x0004 // sparse_super, large_file, btree_dir
	ext3Incompat = 0x0002 | 0x0004 | 0x0010 // filetype, recover, meta_bg
)

// castagnoli is the CRC-32C table, made at its first use: making it
// computes the hardware tables too, work every start of the binary would
// do otherwise.
var castagnoli = sync.OnceValue(func() *crc32.Table { return crc32.MakeTable(crc32.Castagnoli) })

func ext4Superblock(sb []byte) Found {
	le := binary.LittleEndian
	if le.Uint16(sb[extMagicOff:]) != extMagic {
		return Found{}
	}
	incompat, roCompat := le.Uint32(sb[extIncompatOff:]), le.Uint32(sb[extROCompatOff:])
	if incompat&extJournalDev != 0 || le.Uint32(sb[extFlagsOff:])&extTestFS != 0 {
		return Found{}
	}
	if roCompat&^ext3ROCompat == 0 && incompat&^ext3Incompat == 0 {
		return Found{} // ext2 or ext3
	}
	if roCompat&extMetadataCsum == 0 {
		return Found{} // nothing to prove the superblock whole with
	}
	// The kernel's crc32c: seed ~0, no final inversion.
	if ^crc32.Checksum(sb[:extChecksumOff], castagnoli()) != le.Uint32(sb[extChecksumOff:]) {
		return Found{}
	}
	return Found{Type: "ext4", UUID: formatUUID(sb[extUUIDOff : extUUIDOff+16])}
}

// XFS superblock fields (offsets from the start of the device).
const (
	xfsBlockSizeOff = 4 // sb_blocksize
	xfsDBlocksOff   = 8 // sb_dblocks: the data section's blocks
	xfsUUIDOff      = 32
	xfsVersionOff   = 100
	xfsSectSizeOff  = 102
	xfsCRCOff       = 224
	xfsVersion5     = 5 // the low bits of sb_versionnum: v5, with checksums
)

// xfsSuperblock checks the XFS superblock at the start of buf (4 KiB read
// from f): v5 only, whose checksum covers the whole first sector.
func xfsSuperblock(f *os.File, buf []byte) Found {
	be := binary.BigEndian
	if string(buf[:4]) != "XFSB" || be.Uint16(buf[xfsVersionOff:])&0xf != xfsVersion5 {
		return Found{}
	}
	sect := int(be.Uint16(buf[xfsSectSizeOff:]))
	if sect < 512 || sect > 32768 || sect&(sect-1) != 0 {
		return Found{}
	}
	if sect > len(buf) {
		buf = make([]byte, sect)
		if _, err := f.ReadAt(buf, 0); err != nil {
			return Found{}
		}
	}
	sector := buf[:sect]
	stored := binary.LittleEndian.Uint32(sector[xfsCRCOff:])
	crc := crc32.Update(0, castagnoli(), sector[:xfsCRCOff])
	crc = crc32.Update(crc, castagnoli(), make([]byte, 4))
	crc = crc32.Update(crc, castagnoli(), sector[xfsCRCOff+4:])
	if crc != stored {
		return Found{}
	}
	return Found{Type: "xfs", UUID: formatUUID(sector[xfsUUIDOff : xfsUUIDOff+16])}
}

// formatUUID spells 16 bytes as blkid does: lower case, 8-4-4-4-12.
func formatUUID(b []byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}
