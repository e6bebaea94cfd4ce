package volume

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"golang.org/x/sys/unix"
)

// sectorSize is the logical block size of v's loop device, which is the
// sector size of its partition table.
func (v *Volume) sectorSize() uint32 {
	if v.BlockSize == 0 {
		return 512 // the kernel's default, what volumes made without one got
	}
	return v.BlockSize
}

// readAt fills buf from offset off of the open file fd.
func readAt(fd int, buf []byte, off int64) error {
	for len(buf) > 0 {
		n, err := unix.Pread(fd, buf, off)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return fmt.Errorf("read at %d: %w", off, err)
		case n == 0:
			return fmt.Errorf("read at %d: %w", off, io.ErrUnexpectedEOF)
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

// gptEnd returns the byte just past the last sector the GPT in the file at
// fd claims: its backup header's, which moves to the end when the table
// is grown.
func gptEnd(fd int, sector int64) (int64, error) {
	hdr := make([]byte, 92)
	if err := readAt(fd, hdr, sector); err != nil {
		return 0, err
	}
	if string(hdr[:8]) != "EFI PART" {
		return 0, errors.New("no GPT header in the file")
	}
	alternate := int64(binary.LittleEndian.Uint64(hdr[32:]))
	return (alternate + 1) * sector, nil
}

// fsEnd returns the size the ext4 or XFS filesystem in the open file fd
// says it has, from its primary superblock.
func fsEnd(fd int, fsType string) (int64, error) {
	switch fsType {
	case "ext4":
		sb := make([]byte, 1024)
		if err := readAt(fd, sb, 1024); err != nil {
			return 0, err
		}
		if binary.LittleEndian.Uint16(sb[0x38:]) != 0xef53 {
			return 0, errors.New("no ext4 superblock in the file")
		}
		blocks := uint64(binary.LittleEndian.Uint32(sb[0x4:]))
		const incompat64bit = 0x80
		if binary.LittleEndian.Uint32(sb[0x60:])&incompat64bit != 0 {
			blocks |= uint64(binary.LittleEndian.Uint32(sb[0x150:])) << 32
		}
		logSize := binary.LittleEndian.Uint32(sb[0x18:])
		if logSize > 6 { // block sizes of 1 KiB to 64 KiB
			return 0, fmt.Errorf("ext4 superblock with block size 2^(10+%d)", logSize)
		}
		return int64(blocks) << (10 + logSize), nil
	case "xfs":
		sb := make([]byte, 16)
		if err := readAt(fd, sb, 0); err != nil {
			return 0, err
		}
		if string(sb[:4]) != "XFSB" {
			return 0, errors.New("no XFS superblock in the file")
		}
		return int64(binary.BigEndian.Uint64(sb[8:])) * int64(binary.BigEndian.Uint32(sb[4:])), nil
	}
	return 0, fmt.Errorf("filesystem %q unknown", fsType)
}

// contentEnd returns how far what a create writes into v's backing file
// (at fd) reaches: the partition table of a partitioned block volume
// (gptEnd), the filesystem of a filesystem volume (fsEnd), named by what.
// A whole-device raw volume holds nothing of the kind: what is "" and end
// 0. It is the rule of both an expansion abandoned (usedBeyond) and a
// copy grown to its volume's size (finishCopy).
func contentEnd(v *Volume, fd int) (what string, end int64, err error) {
	switch {
	case v.Partitioned:
		end, err = gptEnd(fd, int64(v.sectorSize()))
		return "the partition table", end, err
	case v.Mode == ModeFilesystem:
		end, err = fsEnd(fd, v.FSType)
		return "the " + v.FSType + " filesystem", end, err
	}
	return "", 0, nil
}
