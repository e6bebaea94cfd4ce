package volume

// FilesystemBlockSize is the loop logical block size of new filesystem
// volumes: what ext4 and XFS use for their blocks and a multiple of every
// direct I/O alignment, at no measured cost (docs/design.md has the
// figures).
const FilesystemBlockSize = 4096

// blockSizeForMode is the logical block size a new volume is created with.
// Filesystem volumes get FilesystemBlockSize, a multiple of every
// alignment blockSizeFor reports, so the store is not asked. Block
// volumes get the store's direct I/O alignment (512 on most disks): their
// consumer reads and writes the device itself, and software that issues
// 512-byte direct I/O would fail on a 4096-byte device. Adopted volumes
// keep 512 (adopt.go).
func blockSizeForMode(dir string, mode Mode) uint32 {
	if mode == ModeFilesystem {
		return FilesystemBlockSize
	}
	return blockSizeFor(dir)
}
