package loop

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

var (
	// ErrNotAttached is returned when a device has no backing file bound.
	ErrNotAttached = errors.New("loop device not attached")
	// ErrNotOwned is returned when a device is not provably the caller's
	// (see Owner.Check); nothing was changed.
	ErrNotOwned = errors.New("loop device not ours")
	// ErrBusy is returned when a device is mounted, held or open and the
	// requested change was refused; nothing was changed.
	ErrBusy = errors.New("loop device in use")
	// ErrDeferred is returned when LOOP_CLR_FD was accepted but the kernel
	// only marked the device for autoclear because another opener still
	// holds it: it detaches when the last opener closes.
	ErrDeferred = errors.New("loop detach deferred until last close")
)

// FileID identifies a backing file the way the kernel records it in
// lo_device/lo_inode: by device and inode, never by path.
type FileID struct {
	Dev   uint64
	Inode uint64
}

// FileIDOfFD returns the identity of the open file fd.
func FileIDOfFD(fd int) (FileID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return FileID{}, fmt.Errorf("fstat: %w", err)
	}
	return FileID{Dev: st.Dev, Inode: st.Ino}, nil
}

// Owner is what a caller must prove to touch a device: the device is its
// own only when it is bound to the owner's file (by device and inode, never
// by path), from offset 0, with no size limit, with the owner's read-only
// flag and carrying the owner's tag. A device someone else bound to the
// same file (losetup -o, --sizelimit, -r, or an untagged losetup) is a
// window onto the file that is not ours: nothing detaches, resizes, links
// or formats it.
type Owner struct {
	ID       FileID
	Tag      string
	ReadOnly bool
}

// Check returns nil if d is provably the owner's device, else an error
// wrapping ErrNotOwned that says what differs. d must come from an ioctl
// (Get, Bound): a sysfs scan does not know the tag.
func (o Owner) Check(d *Device) error {
	var why string
	switch {
	case d.Backing != o.ID:
		why = fmt.Sprintf("bound to file %d:%d, not %d:%d", d.Backing.Dev, d.Backing.Inode, o.ID.Dev, o.ID.Inode)
	case d.Offset != 0:
		why = fmt.Sprintf("bound at offset %d of the file", d.Offset)
	case d.SizeLimit != 0:
		why = fmt.Sprintf("limited to %d bytes of the file", d.SizeLimit)
	case d.ReadOnly() != o.ReadOnly:
		why = fmt.Sprintf("read-only=%t, want %t", d.ReadOnly(), o.ReadOnly)
	case d.Tag != o.Tag:
		why = fmt.Sprintf("tagged %q, not %q", d.Tag, o.Tag)
	}
	if why == "" {
		return nil
	}
	return fmt.Errorf("%s is %s: %w", d.Path, why, ErrNotOwned)
}

// Device describes a bound loop device.
type Device struct {
	Path      string // /dev/loopN
	Number    int
	Backing   FileID
	Tag       string // lo_file_name as set at attach time
	Flags     uint32
	BlockSize uint32 // logical block size in bytes
	// Bytes is the device's size when it was bound or asked by ioctl; 0
	// when unknown (devices found by a sysfs scan).
	Bytes uint64
	// Offset and SizeLimit are where in the backing file the device
	// starts and how much of it it shows (0: to the end).
	Offset    uint64
	SizeLimit uint64
	// DiskSeq is the kernel's disk sequence number of the binding
	// (BLKGETDISKSEQ): every bind takes a new one, never reused until
	// reboot, so it names this binding and no later one. 0 where the
	// kernel has none (before 5.15).
	DiskSeq uint64
}

// DirectIO reports whether the kernel performs direct I/O on the backing file.
func (d *Device) DirectIO() bool { return d.Flags&unix.LO_FLAGS_DIRECT_IO != 0 }

// Autoclear reports whether the device detaches itself on last close.
func (d *Device) Autoclear() bool { return d.Flags&unix.LO_FLAGS_AUTOCLEAR != 0 }

// ReadOnly reports whether the device refuses writes.
func (d *Device) ReadOnly() bool { return d.Flags&unix.LO_FLAGS_READ_ONLY != 0 }

// Partscan reports whether the kernel scans the device for partitions.
func (d *Device) Partscan() bool { return d.Flags&unix.LO_FLAGS_PARTSCAN != 0 }

// Get returns the state of /dev/loopN or ErrNotAttached.
func Get(path string) (*Device, error) {
	fd, dev, err := openBound(path, unix.O_RDONLY, nil)
	if err != nil {
		return nil, err
	}
	unix.Close(fd)
	return dev, nil
}

// openBound opens the loop device at path and reads its state. ENXIO (no
// file bound, or being torn down) becomes ErrNotAttached; with owner set, a
// device that is not provably the owner's is refused with ErrNotOwned. On
// success the caller closes fd.
func openBound(path string, flags int, owner *Owner) (int, *Device, error) {
	n, err := parseNumber(path)
	if err != nil {
		return -1, nil, err
	}
	fd, err := openDevice(n, flags)
	if errors.Is(err, unix.ENXIO) {
		return -1, nil, fmt.Errorf("%w: %w", err, ErrNotAttached)
	}
	if err != nil {
		return -1, nil, err
	}
	dev, err := status(fd, n)
	if err == nil && owner != nil {
		err = owner.Check(dev)
	}
	if err != nil {
		unix.Close(fd)
		return -1, nil, err
	}
	return fd, dev, nil
}

func status(fd, n int) (*Device, error) {
	info, err := unix.IoctlLoopGetStatus64(fd)
	if err != nil {
		if errors.Is(err, unix.ENXIO) {
			return nil, fmt.Errorf("status %s: %w", devicePath(n), ErrNotAttached)
		}
		return nil, fmt.Errorf("status %s: LOOP_GET_STATUS64: %w", devicePath(n), err)
	}
	dev := &Device{
		Path:      devicePath(n),
		Number:    n,
		Backing:   FileID{Dev: info.Device, Inode: info.Inode},
		Tag:       string(bytes.TrimRight(info.File_name[:], "\x00")),
		Flags:     info.Flags,
		Offset:    info.Offset,
		SizeLimit: info.Sizelimit,
	}
	if bs, err := unix.IoctlGetInt(fd, unix.BLKSSZGET); err == nil {
		dev.BlockSize = uint32(bs)
	}
	var size uint64
	if err := ioctlPtr(fd, unix.BLKGETSIZE64, &size); err == nil {
		dev.Bytes = size
	}
	var seq uint64
	if err := ioctlPtr(fd, blkGetDiskSeq, &seq); err == nil {
		dev.DiskSeq = seq
	}
	return dev, nil
}

// blkGetDiskSeq is BLKGETDISKSEQ, _IOR(0x12, 128, __u64).
const blkGetDiskSeq = 0x80081280

// Detach unbinds path, but only if it is provably owner's (Owner.Check).
// A device that is mounted, held by another device or opened
// exclusively is refused with ErrBusy and left as it is. If another process
// merely has it open, the kernel defers the detach until that process closes
// it; Detach then returns ErrDeferred naming who holds it.
func Detach(path string, owner Owner) error {
	n, err := parseNumber(path)
	if err != nil {
		return err
	}
	// O_EXCL on a block device fails with EBUSY while it (or one of its
	// partitions) is mounted or claimed, without disturbing the holder:
	// the one check, whatever the number of mounts and devices. Who
	// holds it is looked up only to say so.
	fd, _, err := openBound(path, unix.O_RDONLY|unix.O_EXCL, &owner)
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("detach %s: %w", path, exclusiveUsers(n))
	}
	if err != nil {
		return fmt.Errorf("detach %s: %w", path, err)
	}
	err = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
	// Our own descriptor counts as an opener: the kernel finishes the
	// teardown when it is closed.
	unix.Close(fd)
	if err != nil {
		if errors.Is(err, unix.ENXIO) {
			return fmt.Errorf("detach %s: %w", path, ErrNotAttached)
		}
		return fmt.Errorf("detach %s: LOOP_CLR_FD: %w", path, err)
	}
	// Short-lived openers (udev's blkid probe after a change event, a
	// `losetup -l`) defer the teardown by milliseconds; give them a moment
	// before calling the detach deferred.
	var after *Device
	for wait := time.Duration(0); wait < deferredWait; wait += deferredPoll {
		after, err = Get(path)
		if errors.Is(err, ErrNotAttached) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("detach %s: check: %w", path, err)
		}
		if after.Backing != owner.ID {
			return nil // detached and already reused by someone else
		}
		time.Sleep(deferredPoll)
	}
	if after.Backing == owner.ID {
		holders := openers(n)
		who := "another process"
		if len(holders) > 0 {
			who = strings.Join(holders, ", ")
		}
		return fmt.Errorf("detach %s: still open by %s; autoclear set, the kernel detaches it on last close: %w", path, who, ErrDeferred)
	}
	return nil
}

// How long Detach waits for transient openers before reporting a
// deferred detach.
const (
	deferredWait = 2 * time.Second
	deferredPoll = 10 * time.Millisecond
)

// KeepBound makes sure a device proven owner's stays bound: a detach
// that the kernel deferred (autoclear set because someone held the device
// open) is cancelled by clearing autoclear. It returns ErrNotAttached if the
// device is already being torn down, so the caller binds a new one.
func KeepBound(path string, owner Owner) (*Device, error) {
	fd, dev, err := openBound(path, unix.O_RDONLY, &owner)
	if err != nil {
		return nil, fmt.Errorf("keep %s bound: %w", path, err)
	}
	defer unix.Close(fd)
	if !dev.Autoclear() {
		return dev, nil
	}
	info, err := unix.IoctlLoopGetStatus64(fd)
	if err == nil {
		info.Flags &^= unix.LO_FLAGS_AUTOCLEAR
		err = unix.IoctlLoopSetStatus64(fd, info)
	}
	if errors.Is(err, unix.ENXIO) {
		return nil, fmt.Errorf("keep %s bound: %w", path, ErrNotAttached)
	}
	if err != nil {
		return nil, fmt.Errorf("keep %s bound: clear autoclear: %w", path, err)
	}
	return status(fd, dev.Number)
}

// Held is a loop device kept open after it was proven an owner's. While
// it is open, a LOOP_CLR_FD by anyone is only deferred, so the device
// number cannot be rebound to another file under a program (mkfs,
// resize2fs, mount) that works on it by path. The holder must Close it;
// Close is safe to call more than once.
type Held struct {
	Device *Device
	fd     int
	once   sync.Once
}

// Hold opens the device at path, proves it is owner's and keeps it open
// until Close.
func Hold(path string, owner Owner) (*Held, error) {
	fd, dev, err := openBound(path, unix.O_RDONLY, &owner)
	if err != nil {
		return nil, fmt.Errorf("hold %s: %w", path, err)
	}
	return &Held{Device: dev, fd: fd}, nil
}

// Sync writes what the kernel buffers for the device to its backing file
// (fsync of the block device).
func (h *Held) Sync() error {
	if err := unix.Fsync(h.fd); err != nil {
		return fmt.Errorf("flush %s: %w", h.Device.Path, err)
	}
	return nil
}

// Close releases the device.
func (h *Held) Close() error {
	var err error
	h.once.Do(func() { err = unix.Close(h.fd) })
	return err
}

// SetCapacity makes the kernel re-read the size of the backing file of the
// device, after the file was grown. owner is proven first, as in Detach.
func SetCapacity(path string, owner Owner) error {
	fd, _, err := openBound(path, unix.O_RDONLY, &owner)
	if err != nil {
		return fmt.Errorf("set capacity %s: %w", path, err)
	}
	defer unix.Close(fd)
	if err := unix.IoctlSetInt(fd, unix.LOOP_SET_CAPACITY, 0); err != nil {
		return fmt.Errorf("set capacity %s: LOOP_SET_CAPACITY: %w", path, err)
	}
	return nil
}

func ioctlPtr(fd int, req uint, arg *uint64) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(unsafe.Pointer(arg)))
	if errno != 0 {
		return errno
	}
	return nil
}
