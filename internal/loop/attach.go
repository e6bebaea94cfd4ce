package loop

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"strconv"
	"time"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/parallel"
	"golang.org/x/sys/unix"
)

// ControlPath is where the kernel offers loop devices.
const ControlPath = "/dev/loop-control"

// Supported returns nil if this kernel offers loop devices to us: the
// control device opens for writing.
func Supported() error {
	fd, err := unix.Open(ControlPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("loop support: %w", &os.PathError{Op: "open", Path: ControlPath, Err: err})
	}
	return unix.Close(fd)
}

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
	// QuietUdev binds through a private device node (see openUnwatched),
	// so that udev probes the bound device once, not twice. Callers set
	// it where udevd runs (volume: Options.Udev, where this process sees
	// the node's udev).
	QuietUdev bool
	// Prefer, if set, is a device (/dev/loopN) Attach tries before it
	// asks the kernel for a free one: LOOP_CTL_GET_FREE walks every
	// device below the first free one. It is a hint, never trusted: the
	// kernel refuses a bound device, the result is verified as every
	// binding is, and any failure falls back to the kernel's choice.
	Prefer string
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
	fd, err := unix.Open(ControlPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, &os.PathError{Op: "open", Path: ControlPath, Err: err}
	}
	if err := fsutil.Flock(fd, unix.LOCK_EX); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("lock %s: %w", ControlPath, err)
	}
	return fd, nil
}

// bindNumber binds backing to /dev/loopN, which the caller believes free,
// and verifies the result; EBUSY means someone else bound it first.
func bindNumber(n int, backing int, want FileID, opts AttachOptions) (*Device, error) {
	path := devicePath(n)
	mode := unix.O_RDWR
	if opts.ReadOnly {
		mode = unix.O_RDONLY
	}
	open := openDevice
	if opts.QuietUdev {
		open = openUnwatched
	}
	fd, err := open(n, mode)
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

// openUnwatched opens /dev/loopN for binding through a private node of the
// same device number, made in /dev and unlinked at once. Why: udev watches
// /dev/loopN with inotify and answers every close of a writable fd with a
// synthesized "change" event, a full second probe of the device; binding
// already sends its own "change", and twice the udev work per bound device
// is what bringing many volumes up at boot waits for. Where the node cannot
// be made (no CAP_MKNOD), /dev/loopN is opened as before. udev's own lock
// protocol (LOCK_EX on /dev/loopN while binding) does not avoid the second
// probe: the holder's close is the watched event (docs/design.md). Callers
// hold the /dev/loop-control lock, which makes the node's name theirs.
func openUnwatched(n int, flags int) (int, error) {
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

// AttachRequest is one binding asked of AttachMany. FD is the backing
// file, opened by the caller, who closes it after the call.
type AttachRequest struct {
	FD      int
	Options AttachOptions
	// Bound, if set, is called with the device as soon as it is bound and
	// proven, by the worker that bound it, while AttachMany still binds
	// others: what the caller leaves for udev's event of the bind is
	// there as early as it can be.
	Bound func(*Device)
}

// AttachResult is the outcome of one AttachRequest, at the same index.
type AttachResult struct {
	Device *Device
	Err    error
}

// DefaultParallel is how many devices AttachMany configures at once.
// Binding a loop device costs the kernel little CPU but waits (a queue
// freeze and its grace period); waits overlap, so a few workers bind many
// devices in a fraction of the sequential time even on two cores.
const DefaultParallel = 8

// AttachMany binds each request's file to its own free loop device, like
// Attach called once per request, but under one hold of the
// /dev/loop-control lock and with up to workers bindings in flight. It
// picks distinct device numbers up front (unbound devices first, then new
// numbers it adds), so its workers never race each other for a device; a
// device that a process outside the lock took in between is retried the
// one-at-a-time way. Like Attach, it does not look for existing bindings.
func AttachMany(reqs []AttachRequest, workers int) []AttachResult {
	results := make([]AttachResult, len(reqs))
	if len(reqs) == 0 {
		return results
	}
	fail := func(err error) []AttachResult {
		for i := range results {
			results[i].Err = fmt.Errorf("attach: %w", err)
		}
		return results
	}
	control, err := lockControl()
	if err != nil {
		return fail(err)
	}
	defer unix.Close(control) // releases the lock
	numbers, err := pickNumbers(len(reqs))
	if err != nil {
		return fail(err)
	}

	parallel.For(len(reqs), workers, func(i int) {
		results[i] = reqs[i].bound(attachNumber(control, numbers[i], reqs[i]))
	})

	// Whatever lost its device to an outsider goes the one-at-a-time way.
	for i, r := range results {
		if r.Err != nil && errors.Is(r.Err, unix.EBUSY) {
			results[i] = reqs[i].bound(attachOne(control, reqs[i]))
		}
	}
	return results
}

// bound calls req.Bound for a successful result.
func (req AttachRequest) bound(r AttachResult) AttachResult {
	if r.Err == nil && req.Bound != nil {
		req.Bound(r.Device)
	}
	return r
}

// Reserve makes sure at least count unbound loop devices exist, adding the
// missing ones, and returns how many it added. Why: the kernel announces a
// new device to udev at once, and if udev gets to that "add" only after the
// device was bound, it probes the bound device fully, and then again for
// the bind's own "change". Devices added a moment before they are bound let
// udev handle their "add" while they are still empty, which costs it
// little. AttachMany uses the free devices, lowest first.
func Reserve(count int) (int, error) {
	if count <= 0 {
		return 0, nil
	}
	control, err := lockControl()
	if err != nil {
		return 0, fmt.Errorf("reserve loop devices: %w", err)
	}
	defer unix.Close(control)
	return reserveLocked(control, count)
}

// reserveLocked is Reserve for a caller holding the control lock.
func reserveLocked(control, count int) (int, error) {
	slots, err := pickNumbers(count)
	if err != nil {
		return 0, fmt.Errorf("reserve loop devices: %w", err)
	}
	added := 0
	for _, s := range slots {
		if !s.add {
			continue
		}
		made, err := addDevice(control, s.n)
		if err != nil {
			return added, fmt.Errorf("reserve loop devices: %w", err)
		}
		if made {
			added++
		}
	}
	return added, nil
}

// addDevice creates /dev/loopN through the control fd; made is false when
// the device already existed (EEXIST), which is not an error.
func addDevice(control, n int) (made bool, err error) {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(control), unix.LOOP_CTL_ADD, uintptr(n))
	switch errno {
	case 0:
		return true, nil
	case unix.EEXIST:
		return false, nil
	}
	return false, fmt.Errorf("LOOP_CTL_ADD %d: %w", n, errno)
}

// slot is a device number for one request and whether it must be created.
type slot struct {
	n   int
	add bool
}

// pickNumbers returns count device numbers: unbound existing devices,
// lowest first, then numbers above every existing device.
func pickNumbers(count int) ([]slot, error) {
	entries, err := os.ReadDir("/sys/block")
	if err != nil {
		return nil, fmt.Errorf("list loop devices: %w", err)
	}
	// Devices with a size are bound; the others are free. (A device bound
	// to an empty file has no size: binding it fails with EBUSY, and that
	// request is retried the one-at-a-time way.) No per-device sysfs look:
	// a busy machine has thousands of unbound loop devices.
	sized, err := sizedLoops()
	if err != nil {
		return nil, fmt.Errorf("list loop devices: %w", err)
	}
	bound := make(map[int]bool, len(sized))
	for _, n := range sized {
		bound[n] = true
	}
	var free []int
	highest := -1
	for _, e := range entries {
		n, err := parseNumber(e.Name())
		if err != nil {
			continue
		}
		highest = max(highest, n)
		if !bound[n] {
			free = append(free, n)
		}
	}
	sort.Ints(free)
	out := make([]slot, 0, count)
	for _, n := range free {
		if len(out) == count {
			break
		}
		out = append(out, slot{n: n})
	}
	for n := highest + 1; len(out) < count; n++ {
		out = append(out, slot{n: n, add: true})
	}
	return out, nil
}

// checkRequest validates a request and returns its file's identity.
func checkRequest(req AttachRequest) (FileID, error) {
	if len(req.Options.Tag) >= unix.LO_NAME_SIZE {
		return FileID{}, fmt.Errorf("tag %q longer than %d bytes", req.Options.Tag, unix.LO_NAME_SIZE-1)
	}
	return FileIDOfFD(req.FD)
}

func attachNumber(control int, s slot, req AttachRequest) AttachResult {
	want, err := checkRequest(req)
	if err != nil {
		return AttachResult{Err: fmt.Errorf("attach: %w", err)}
	}
	if s.add {
		// Made by someone meanwhile: binding it tells if it is free.
		if _, err := addDevice(control, s.n); err != nil {
			return AttachResult{Err: fmt.Errorf("attach: %w", err)}
		}
	}
	dev, err := bindNumber(s.n, req.FD, want, req.Options)
	if err != nil {
		return AttachResult{Err: fmt.Errorf("attach: %w", err)}
	}
	return AttachResult{Device: dev}
}

// unboundNumber returns the number of the loop device path if sysfs shows
// the device and no file bound to it: a preferred device (see
// AttachOptions.Prefer) worth trying. A bound device is passed over
// without being opened, since opening someone's device for writing makes
// udev probe it again at close.
func unboundNumber(path string) (int, bool) {
	n, err := parseNumber(path)
	if err != nil {
		return 0, false
	}
	sys := "/sys/block/loop" + strconv.Itoa(n)
	if _, err := os.Lstat(sys); err != nil {
		return 0, false
	}
	if _, err := os.Lstat(sys + "/loop/backing_file"); err == nil {
		return 0, false
	}
	return n, true
}

// attachOne is Attach's loop for a caller that holds the control lock.
func attachOne(control int, req AttachRequest) AttachResult {
	want, err := checkRequest(req)
	if err != nil {
		return AttachResult{Err: fmt.Errorf("attach: %w", err)}
	}
	if n, ok := unboundNumber(req.Options.Prefer); ok {
		if dev, err := bindNumber(n, req.FD, want, req.Options); err == nil {
			return AttachResult{Device: dev}
		}
	}
	for attempt := 0; ; attempt++ {
		n, err := unix.IoctlRetInt(control, unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return AttachResult{Err: fmt.Errorf("attach: LOOP_CTL_GET_FREE: %w", err)}
		}
		dev, err := bindNumber(n, req.FD, want, req.Options)
		if err == nil {
			return AttachResult{Device: dev}
		}
		if !errors.Is(err, unix.EBUSY) || attempt >= attachRetries {
			return AttachResult{Err: fmt.Errorf("attach: %w", err)}
		}
		time.Sleep(time.Duration(1+rand.IntN(10)) * time.Millisecond)
	}
}
