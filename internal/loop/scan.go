package loop

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

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

// scans counts sizedLoops' reads.
var scans atomic.Int64

// Scans is how many times this process looked at every bound loop device
// (List, Scan, Bound, BoundCount, a batch's choice of free devices): what
// a call about one device must not need, whatever the number bound, and
// what tests hold such calls to.
func Scans() int64 { return scans.Load() }

// BoundCount is how many loop devices are bound, from one read of
// /proc/partitions (see eachBound): what a caller sizing a batch needs,
// without a look at each device.
func BoundCount() (int, error) {
	sized, err := sizedLoops()
	if err != nil {
		return 0, fmt.Errorf("count loop devices: %w", err)
	}
	return len(sized), nil
}

// sizedLoops lists the numbers of the loop devices /proc/partitions shows
// (those with a non-zero size, which bound devices are; see eachBound).
// Every look at all bound devices starts here, and is counted (Scans).
func sizedLoops() ([]int, error) {
	scans.Add(1)
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
		if strings.HasSuffix(path, DeletedSuffix) || unix.Stat(path, &st) != nil {
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

// Unshared reports whether the file open as fd is open nowhere else: then
// no loop device is bound to it, since a bound device holds an open file
// of its own. It asks the kernel by taking a write lease on fd and
// dropping it at once; the kernel grants one only while fd's is the
// file's only open file (fcntl(2), F_SETLEASE). It costs two fcntl calls,
// whatever the number of bound devices. false means "maybe bound": a
// device or some process has the file open, and only a scan (Bound) can
// tell. An error means this kernel or filesystem gives no leases; the
// caller scans then too. The lease is held for no longer than the call,
// with no owner for its break signal: an opener racing it waits, at most,
// for the second fcntl.
func Unshared(fd int) (bool, error) {
	_, err := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_WRLCK)
	if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EBUSY) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("take a lease: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_UNLCK); err != nil {
		return false, fmt.Errorf("drop a lease: %w", err)
	}
	return true, nil
}
