package volume

// FilesystemBlockSize is the loop logical block size of new filesystem
// volumes. Measured for issue 5 (ext4 on direct-I/O loop devices over the
// same backing filesystem, 512- against 4096-byte sectors): a five-round
// A/B put 4096 ahead on random 4 KiB writes at QD1 (median 8019 against
// 5687 IOPS) and even on reads; the make bench run after it had 4096 at
// 0.92 on those writes and 1.48 on reads. On this shared machine that is
// noise around no loss, and the sequential and QD32 rows do not move. 4096
// is what ext4 and XFS use for their blocks, the best hand setup
// (losetup --sector-size 4096), and a multiple of every direct I/O
// alignment a loop device can use. (One loss: an ext4 below 8 MiB has no
// room for a journal.)
const FilesystemBlockSize = 4096

// blockSizeForMode is the logical block size a new volume is created with.
// Filesystem volumes get FilesystemBlockSize. Block volumes get the store's
// direct I/O alignment (512 on most disks): their consumer reads and
// writes the device itself, and software that issues 512-byte direct I/O
// would fail on a 4096-byte device. Adopted volumes keep 512 (adopt.go).
func blockSizeForMode(dir string, mode Mode) uint32 {
	align := blockSizeFor(dir)
	if mode == ModeFilesystem && align <= FilesystemBlockSize {
		return FilesystemBlockSize
	}
	return align
}
