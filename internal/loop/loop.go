// Package loop is a typed API over Linux loop devices: ioctls on
// /dev/loop-control and /dev/loopN, lookups through sysfs. It knows nothing
// of volumes: callers name a backing file and get a device, or name a
// device and an identity of the backing file they expect it to hold.
//
// Ownership: every function opens and closes its own file descriptors; no
// descriptor outlives a call. Devices are attached without LO_FLAGS_AUTOCLEAR,
// so they stay bound after the attaching process exits and until Detach (or a
// reboot). The kernel only sets autoclear itself when LOOP_CLR_FD is asked of
// a device that is still open elsewhere; Detach reports that as ErrDeferred.
package loop

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

const controlPath = "/dev/loop-control"

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
}

// DirectIO reports whether the kernel performs direct I/O on the backing file.
func (d *Device) DirectIO() bool { return d.Flags&unix.LO_FLAGS_DIRECT_IO != 0 }

// Autoclear reports whether the device detaches itself on last close.
func (d *Device) Autoclear() bool { return d.Flags&unix.LO_FLAGS_AUTOCLEAR != 0 }

// ReadOnly reports whether the device refuses writes.
func (d *Device) ReadOnly() bool { return d.Flags&unix.LO_FLAGS_READ_ONLY != 0 }

// Partscan reports whether the kernel scans the device for partitions.
func (d *Device) Partscan() bool { return d.Flags&unix.LO_FLAGS_PARTSCAN != 0 }

// AttachOptions configures a new binding.
type AttachOptions struct {
	// Tag is stored in lo_file_name (at most 63 bytes), so `losetup -l` and
	// a sysfs-less lookup can tell whose device this is.
	Tag string
	// DirectIO asks for O_DIRECT on the backing file. If the kernel or the
	// backing filesystem refuses, Attach falls back to buffered I/O and the
	// returned Device says so.
	DirectIO bool
	// BlockSize is the logical block size; 0 lets the kernel choose (512).
	BlockSize uint32
	ReadOnly  bool
	// Partscan makes the kernel read the partition table (loopNpM).
	Partscan bool
}

func (o AttachOptions) flags(directIO bool) uint32 {
	var f uint32
	if directIO {
		f |= unix.LO_FLAGS_DIRECT_IO
	}
	if o.ReadOnly {
		f |= unix.LO_FLAGS_READ_ONLY
	}
	if o.Partscan {
		f |= unix.LO_FLAGS_PARTSCAN
	}
	return f
}

// attachRetries bounds how often Attach retries a free device that another
// process (one not honouring the control lock) grabbed first.
const attachRetries = 64

// Attach binds the open file backing to a free loop device and returns
// it. The caller owns backing and closes it after the call; the device
// holds its own reference to the file. Attach never opens a path for the
// backing file, so what is bound is exactly what the caller opened and
// checked. It does not look for an existing binding of the same file:
// callers that need idempotency look first (Bound) under their own lock.
//
// Concurrent attaches are serialised with an exclusive flock on
// /dev/loop-control (as systemd does); processes that do not take the lock
// can still race us to a free device, so EBUSY is retried with bounded jitter.
func Attach(backing int, opts AttachOptions) (*Device, error) {
	control, err := lockControl()
	if err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	defer unix.Close(control) // releases the lock
	r := attachOne(control, AttachRequest{FD: backing, Options: opts})
	return r.Device, r.Err
}

// lockControl opens /dev/loop-control and takes its exclusive flock, which
// serialises attaches among the processes that honour it (as systemd
// does). Closing the returned fd releases the lock.
func lockControl() (int, error) {
	fd, err := unix.Open(controlPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, &os.PathError{Op: "open", Path: controlPath, Err: err}
	}
	if err := flock(fd, unix.LOCK_EX); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("lock %s: %w", controlPath, err)
	}
	return fd, nil
}

func attachFree(control int, backing int, want FileID, opts AttachOptions) (*Device, error) {
	n, err := unix.IoctlRetInt(control, unix.LOOP_CTL_GET_FREE)
	if err != nil {
		return nil, fmt.Errorf("LOOP_CTL_GET_FREE: %w", err)
	}
	return bindNumber(n, backing, want, opts)
}

// bindNumber binds backing to /dev/loopN, which the caller believes free,
// and verifies the result; EBUSY means someone else bound it first.
func bindNumber(n int, backing int, want FileID, opts AttachOptions) (*Device, error) {
	path := devicePath(n)
	mode := unix.O_RDWR
	if opts.ReadOnly {
		mode = unix.O_RDONLY
	}
	fd, err := openUnwatched(n, mode)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)

	directIO := opts.DirectIO
	if err := configure(fd, backing, opts, directIO); err != nil {
		if !directIO || errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("configure %s: %w", path, err)
		}
		// Newer kernels refuse LOOP_CONFIGURE with direct I/O when the
		// backing file cannot do it (alignment, filesystem); retry buffered.
		directIO = false
		if err2 := configure(fd, backing, opts, false); err2 != nil {
			return nil, fmt.Errorf("configure %s: %w", path, err2)
		}
	}
	dev, err := status(fd, n)
	if err != nil {
		return nil, err
	}
	// Verify that what the kernel now holds is what we asked for: our
	// device by the owner's proof, and no autoclear (which would silently
	// drop a persistent volume). Partscan may be on without being asked
	// for: the kernel sets it on every device when the loop module has
	// max_part > 0.
	owner := Owner{ID: want, Tag: opts.Tag, ReadOnly: opts.ReadOnly}
	var bad string
	switch err := owner.Check(dev); {
	case dev.Backing != want:
		// Not ours (someone rebound it between configure and status):
		// leave it alone.
		return nil, fmt.Errorf("verify %s: %w", path, err)
	case err != nil:
		bad = err.Error()
	case dev.Autoclear():
		bad = "autoclear is set on a persistent device"
	case dev.ReadOnly() != opts.ReadOnly, opts.Partscan && !dev.Partscan():
		bad = fmt.Sprintf("flags %#x do not match requested %#x", dev.Flags, opts.flags(directIO))
	}
	if bad != "" {
		// We bound it, so we unbind it: a failed attach leaks no device.
		_ = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
		return nil, fmt.Errorf("verify %s: %s", path, bad)
	}
	return dev, nil
}

func configure(fd int, backing int, opts AttachOptions, directIO bool) error {
	cfg := unix.LoopConfig{
		Fd:   uint32(backing),
		Size: opts.BlockSize,
	}
	cfg.Info.Flags = opts.flags(directIO)
	copy(cfg.Info.File_name[:], opts.Tag)
	err := unix.IoctlLoopConfigure(fd, &cfg)
	if err == nil || !(errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.ENOSYS)) {
		return err
	}
	// Kernels before 5.8 have no LOOP_CONFIGURE (they answer EINVAL for
	// an unknown loop ioctl, as util-linux knows): bind, then set status.
	if err := unix.IoctlSetInt(fd, unix.LOOP_SET_FD, backing); err != nil {
		return fmt.Errorf("LOOP_SET_FD: %w", err)
	}
	info := cfg.Info
	info.Flags &^= unix.LO_FLAGS_DIRECT_IO
	for attempt := 0; ; attempt++ {
		// Older kernels answer EAGAIN while the page cache is flushed.
		err = unix.IoctlLoopSetStatus64(fd, &info)
		if !errors.Is(err, unix.EAGAIN) || attempt >= 50 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		_ = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
		return fmt.Errorf("LOOP_SET_STATUS64: %w", err)
	}
	if opts.BlockSize != 0 {
		if err := unix.IoctlSetInt(fd, unix.LOOP_SET_BLOCK_SIZE, int(opts.BlockSize)); err != nil {
			_ = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
			return fmt.Errorf("LOOP_SET_BLOCK_SIZE: %w", err)
		}
	}
	if directIO {
		// Best effort: a refusal leaves the device buffered, which the
		// caller sees in the returned flags.
		_ = unix.IoctlSetInt(fd, unix.LOOP_SET_DIRECT_IO, 1)
	}
	return nil
}

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
	return dev, nil
}

// List returns every bound loop device. It scans sysfs for devices that have
// a backing file and asks each device for its identity; devices that are
// detached between the scan and the ioctl are skipped.
func List() ([]*Device, error) {
	var devs []*Device
	err := eachBound(func(n int, _ string) error {
		dev, err := Get(devicePath(n))
		if errors.Is(err, ErrNotAttached) {
			return nil // detached since the scan
		}
		if err != nil {
			return err
		}
		devs = append(devs, dev)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list loop devices: %w", err)
	}
	return devs, nil
}

// eachBound calls fn for every bound loop device, with the backing file's
// path as sysfs gives it. It opens no device.
//
// Candidates come from /proc/partitions, which lists only block devices
// with a non-zero size: walking /sys/block would try every loop device the
// machine ever created (thousands after a busy day, most unbound), which
// made each lookup cost milliseconds. A device bound to an empty file has
// no size and is not listed; no volume's file is empty. The loop/ sysfs
// group, which exists only while a file is bound, confirms each candidate.
func eachBound(fn func(n int, backingPath string) error) error {
	sized, err := sizedLoops()
	if err != nil {
		return err
	}
	buf := make([]byte, 4096)
	for _, n := range sized {
		path, ok := readSysString(fmt.Sprintf("/sys/block/loop%d/loop/backing_file", n), buf)
		if !ok {
			continue
		}
		if err := fn(n, path); err != nil {
			return err
		}
	}
	return nil
}

// sizedLoops lists the numbers of the loop devices /proc/partitions shows
// (those with a non-zero size, which bound devices are; see eachBound).
func sizedLoops() ([]int, error) {
	parts, err := os.ReadFile("/proc/partitions")
	if err != nil {
		return nil, err
	}
	var out []int
	for _, line := range strings.Split(string(parts), "\n") {
		fields := strings.Fields(line)
		if len(fields) != 4 || !strings.HasPrefix(fields[3], "loop") {
			continue
		}
		if n, err := strconv.Atoi(fields[3][4:]); err == nil { // loopNpM (partitions) fail here
			out = append(out, n)
		}
	}
	return out, nil
}

// Scan returns every bound device like List, but without opening any of
// them: paths, flags and block size come from sysfs and the identity from
// a stat of the backing file's path (exact for files reachable in this
// mount namespace); only devices whose path cannot be resolved (deleted,
// another namespace) are asked by ioctl. Tags are not filled in, so a
// scanned device proves nothing (Owner.Check needs Bound or Get). Opening
// devices is what periodic callers (doctor, metrics scrapes) must avoid:
// an open at the wrong moment turns someone's detach into a deferred one.
func Scan() ([]*Device, error) {
	buf := make([]byte, 4096)
	var devs []*Device
	err := eachBound(func(n int, path string) error {
		var st unix.Stat_t
		if strings.HasSuffix(path, " (deleted)") || unix.Stat(path, &st) != nil {
			dev, err := Get(devicePath(n))
			if errors.Is(err, ErrNotAttached) {
				return nil
			}
			if err != nil {
				return err
			}
			devs = append(devs, dev)
			return nil
		}
		sys := fmt.Sprintf("/sys/block/loop%d", n)
		dev := &Device{Path: devicePath(n), Number: n, Backing: FileID{Dev: st.Dev, Inode: st.Ino}}
		for attr, flag := range map[string]uint32{
			"/loop/autoclear": unix.LO_FLAGS_AUTOCLEAR, "/loop/partscan": unix.LO_FLAGS_PARTSCAN,
			"/loop/dio": unix.LO_FLAGS_DIRECT_IO, "/ro": unix.LO_FLAGS_READ_ONLY,
		} {
			if v, ok := readSysString(sys+attr, buf); ok && v == "1" {
				dev.Flags |= flag
			}
		}
		if v, ok := readSysString(sys+"/queue/logical_block_size", buf); ok {
			if bs, err := strconv.ParseUint(v, 10, 32); err == nil {
				dev.BlockSize = uint32(bs)
			}
		}
		if v, ok := readSysString(sys+"/loop/offset", buf); ok {
			dev.Offset, _ = strconv.ParseUint(v, 10, 64)
		}
		if v, ok := readSysString(sys+"/loop/sizelimit", buf); ok {
			dev.SizeLimit, _ = strconv.ParseUint(v, 10, 64)
		}
		devs = append(devs, dev)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("scan loop devices: %w", err)
	}
	return devs, nil
}

// Bound returns, for each of the files ids, every device bound to it,
// lowest number first, with its full state read by ioctl (tag, offset,
// size limit: what Owner.Check needs). Devices of other files are not in
// the map; a file with no device has no entry. Whether a device is the
// caller's is for the caller to prove: Bound also returns devices someone
// else bound to the same file.
//
// Opening every bound device for LOOP_GET_STATUS64 costs a block-device
// open and close each, so the scan first stats the path sysfs reports as
// each device's backing file and asks the kernel only about devices whose
// path has an identity sought, or cannot be resolved here (deleted, or
// from another mount namespace). The ioctl stays the proof.
func Bound(ids ...FileID) (map[FileID][]*Device, error) {
	want := make(map[FileID]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	out := map[FileID][]*Device{}
	err := eachBound(func(n int, path string) error {
		var st unix.Stat_t
		if unix.Stat(path, &st) == nil && !want[FileID{Dev: st.Dev, Inode: st.Ino}] {
			return nil // bound to some other file
		}
		dev, err := Get(devicePath(n))
		if errors.Is(err, ErrNotAttached) {
			return nil
		}
		if err != nil {
			return err
		}
		if want[dev.Backing] {
			out[dev.Backing] = append(out[dev.Backing], dev)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("find loop devices: %w", err)
	}
	for _, devs := range out {
		sort.Slice(devs, func(i, j int) bool { return devs[i].Number < devs[j].Number })
	}
	return out, nil
}

// readSysString reads a small sysfs attribute without the extra fstat
// os.ReadFile makes; ok is false if it does not exist.
func readSysString(path string, buf []byte) (string, bool) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", false
	}
	defer unix.Close(fd)
	n, err := unix.Read(fd, buf)
	if err != nil || n <= 0 {
		return "", false
	}
	return strings.TrimSuffix(string(buf[:n]), "\n"), true
}

// Busy returns an ErrBusy error naming who uses the device (mounts, holder
// devices, exclusive claims, processes holding it open), or nil. It changes
// nothing, so callers can refuse an operation before starting it.
func Busy(path string) error {
	n, err := parseNumber(path)
	if err != nil {
		return err
	}
	users := Users(n)
	if len(users) == 0 {
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.EBUSY) {
			users = append(users, "an exclusive open (a mount in another mount namespace, a running mkfs or fsck, or device-mapper)")
		} else if err == nil {
			unix.Close(fd)
		}
	}
	if len(users) > 0 {
		return fmt.Errorf("%s: %w by %s", path, ErrBusy, strings.Join(users, ", "))
	}
	// Processes that merely have it open are often passing through (udev's
	// probe, a `losetup -l`): give them a moment before calling it busy.
	var holders []string
	for wait := time.Duration(0); wait < deferredWait; wait += deferredPoll {
		if holders = openers(n); len(holders) == 0 {
			return nil
		}
		time.Sleep(deferredPoll)
	}
	return fmt.Errorf("%s: %w by %s", path, ErrBusy, strings.Join(holders, ", "))
}

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
	if users := Users(n); len(users) > 0 {
		return fmt.Errorf("detach %s: %w by %s", path, ErrBusy, strings.Join(users, ", "))
	}
	// O_EXCL on a block device fails with EBUSY while it (or one of its
	// partitions) is mounted or claimed, without disturbing the holder.
	fd, _, err := openBound(path, unix.O_RDONLY|unix.O_EXCL, &owner)
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("detach %s: %w (opened exclusively: a mount in another mount namespace, a running mkfs or fsck, or another device)", path, ErrBusy)
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

// Close releases the device.
func (h *Held) Close() error {
	var err error
	h.once.Do(func() { err = unix.Close(h.fd) })
	return err
}

// openDevice opens /dev/loopN. Where /dev is not devtmpfs (some
// containers) the node may be missing for a device the kernel has; it is
// made from the numbers sysfs gives. ENXIO from the open means unbound or
// being torn down.
func openDevice(n int, flags int) (int, error) {
	path := devicePath(n)
	fd, err := unix.Open(path, flags|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		if merr := mknodFromSysfs(n); merr != nil {
			return -1, fmt.Errorf("open %s: %w (and making the node: %v)", path, err, merr)
		}
		fd, err = unix.Open(path, flags|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return -1, fmt.Errorf("open %s: %w", path, err)
	}
	return fd, nil
}

// openUnwatched opens /dev/loopN for binding through a private node of the
// same device number, made in /dev and unlinked at once. Why: udev watches
// /dev/loopN with inotify and answers every close of a writable fd with a
// synthesized "change" event, a full second probe of the device; binding
// already sends its own "change". Twice the udev work per bound device was
// what bringing many volumes up at boot waited for. Where udev does not run
// (nobody watches) or the node cannot be made (no CAP_MKNOD), /dev/loopN is
// opened as before. Callers hold the /dev/loop-control lock, which makes the
// node's name theirs.
func openUnwatched(n int, flags int) (int, error) {
	if !UdevRunning() {
		return openDevice(n, flags)
	}
	var st unix.Stat_t
	if err := unix.Stat(devicePath(n), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return openDevice(n, flags)
	}
	private := privateNodePrefix + strconv.Itoa(n)
	err := unix.Mknod(private, unix.S_IFBLK|0o600, int(st.Rdev))
	if errors.Is(err, unix.EEXIST) { // left by a process killed in between
		_ = unix.Unlink(private)
		err = unix.Mknod(private, unix.S_IFBLK|0o600, int(st.Rdev))
	}
	if err != nil {
		return openDevice(n, flags)
	}
	fd, err := unix.Open(private, flags|unix.O_CLOEXEC, 0)
	unix.Unlink(private)
	if err != nil {
		return openDevice(n, flags)
	}
	return fd, nil
}

// privateNodePrefix names openUnwatched's short-lived nodes.
const privateNodePrefix = "/dev/.sparsevol-bind-loop"

// UdevRunning reports whether udevd runs: it then makes the /dev/disk
// links and watches /dev/loopN. A variable for tests on machines without
// udev.
var UdevRunning = func() bool {
	_, err := os.Stat("/run/udev/control")
	return err == nil
}

func mknodFromSysfs(n int) error {
	b, err := os.ReadFile(fmt.Sprintf("/sys/block/loop%d/dev", n))
	if err != nil {
		return err
	}
	var major, minor uint32
	if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%d:%d", &major, &minor); err != nil {
		return err
	}
	err = unix.Mknod(devicePath(n), unix.S_IFBLK|0o660, int(unix.Mkdev(major, minor)))
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
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

// Size returns the size in bytes the kernel sees for the block device at
// path (/dev/loopN or a partition of it). It reads sysfs (in 512-byte
// sectors, whatever the logical block size), so it does not open the
// device.
func Size(path string) (uint64, error) {
	var buf [32]byte
	attr := "/sys/class/block/" + filepath.Base(path) + "/size"
	v, ok := readSysString(attr, buf[:])
	if !ok {
		return 0, fmt.Errorf("size %s: cannot read %s", path, attr)
	}
	sectors, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("size %s: %w", path, err)
	}
	return sectors * 512, nil
}

// Partitions returns the partition device paths of /dev/loopN (loopNp1, ...)
// as the kernel lists them in sysfs.
func Partitions(path string) ([]string, error) {
	n, err := parseNumber(path)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, dir := range sysDirs(n)[1:] {
		out = append(out, "/dev/"+filepath.Base(dir))
	}
	return out, nil
}

// ParentOf maps a partition device (by path or symlink, e.g.
// /dev/disk/by-partuuid/<uuid> -> /dev/loop3p1) to its whole loop device
// (/dev/loop3); a whole loop device maps to itself. This is the lookup
// `losetup -d` does not do.
func ParentOf(path string) (string, error) {
	resolved, err := filepath.EvalSymlinks(path)
	if err != nil {
		return "", fmt.Errorf("parent of %s: %w", path, err)
	}
	name := filepath.Base(resolved)
	if _, err := parseNumber(resolved); err == nil {
		return "/dev/" + name, nil
	}
	sys, err := filepath.EvalSymlinks(filepath.Join("/sys/class/block", name))
	if err != nil {
		return "", fmt.Errorf("parent of %s: %w", path, err)
	}
	if _, err := os.Stat(filepath.Join(sys, "partition")); err != nil {
		return "", fmt.Errorf("parent of %s: %s is neither a loop device nor a partition", path, resolved)
	}
	parent := "/dev/" + filepath.Base(filepath.Dir(sys))
	if _, err := parseNumber(parent); err != nil {
		return "", fmt.Errorf("parent of %s: %s is not on a loop device", path, resolved)
	}
	return parent, nil
}

func devicePath(n int) string { return "/dev/loop" + strconv.Itoa(n) }

func parseNumber(path string) (int, error) {
	name := filepath.Base(path)
	n, err := strconv.Atoi(strings.TrimPrefix(name, "loop"))
	if !strings.HasPrefix(name, "loop") || err != nil || n < 0 {
		return 0, fmt.Errorf("%s is not a loop device path", path)
	}
	return n, nil
}

func flock(fd, how int) error {
	for {
		err := unix.Flock(fd, how)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}
