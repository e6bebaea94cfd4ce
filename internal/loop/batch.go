package loop

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// AttachRequest is one binding asked of AttachMany. FD is the backing
// file, opened by the caller, who closes it after the call.
type AttachRequest struct {
	FD      int
	Options AttachOptions
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
// /dev/loop-control lock and with up to parallel bindings in flight. It
// picks distinct device numbers up front (unbound devices first, then new
// numbers it adds), so its workers never race each other for a device; a
// device that a process outside the lock took in between is retried the
// one-at-a-time way. Like Attach, it does not look for existing bindings.
func AttachMany(reqs []AttachRequest, parallel int) []AttachResult {
	results := make([]AttachResult, len(reqs))
	if len(reqs) == 0 {
		return results
	}
	if parallel < 1 {
		parallel = 1
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

	var wg sync.WaitGroup
	work := make(chan int)
	for range min(parallel, len(reqs)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				results[i] = attachNumber(control, numbers[i], reqs[i])
			}
		}()
	}
	for i := range reqs {
		work <- i
	}
	close(work)
	wg.Wait()

	// Whatever lost its device to an outsider goes the one-at-a-time way.
	for i, r := range results {
		if r.Err != nil && errors.Is(r.Err, unix.EBUSY) {
			results[i] = attachOne(control, reqs[i])
		}
	}
	return results
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

// attachOne is Attach's loop for a caller that holds the control lock.
func attachOne(control int, req AttachRequest) AttachResult {
	want, err := checkRequest(req)
	if err != nil {
		return AttachResult{Err: fmt.Errorf("attach: %w", err)}
	}
	for attempt := 0; ; attempt++ {
		dev, err := attachFree(control, req.FD, want, req.Options)
		if err == nil {
			return AttachResult{Device: dev}
		}
		if !errors.Is(err, unix.EBUSY) || attempt >= attachRetries {
			return AttachResult{Err: fmt.Errorf("attach: %w", err)}
		}
		time.Sleep(time.Duration(1+rand.IntN(10)) * time.Millisecond)
	}
}
