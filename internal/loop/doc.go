// Package loop is a typed API over Linux loop devices: ioctls on
// /dev/loop-control and /dev/loopN, lookups through sysfs. It knows nothing
// of volumes: callers hand in an open backing file and get a device, or
// name a device and prove it is theirs with an Owner.
//
// The files, by concern:
//
//   - attach.go: binding files to devices, one or many under one hold of
//     the /dev/loop-control lock.
//   - device.go: a bound device: its state (Get), the proof of ownership
//     (Owner), and every change to it (Detach, KeepBound, Hold, SetCapacity).
//   - scan.go: finding bound devices (List, Scan, Bound).
//   - sysfs.go: sysfs lookups (sizes, partitions, parents) and device nodes.
//   - users.go: who keeps a device busy (mounts, holders, openers).
//
// Descriptors: functions open and close their own descriptors within the
// call, except Hold, whose Held keeps one open until its Close. Backing
// files are opened by the caller, who passes the fd to Attach or in an
// AttachRequest and closes it after the call: the bound device keeps its
// own reference to the file.
//
// Ownership: nothing in this package changes a device the caller has not
// proven its own (Owner.Check: backing file by device and inode, offset 0,
// no size limit, the expected read-only flag, the caller's tag). Devices
// are attached without LO_FLAGS_AUTOCLEAR, so they stay bound after the
// attaching process exits and until Detach (or a reboot). The kernel only
// sets autoclear itself when LOOP_CLR_FD is asked of a device that is
// still open elsewhere; Detach reports that as ErrDeferred.
//
// Locks: Attach, AttachMany and Reserve hold an exclusive flock on
// /dev/loop-control for the whole call (as systemd does); callers that
// also hold locks of their own (the volume store's) take those first.
package loop
