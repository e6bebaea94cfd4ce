package loop

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Busy returns an ErrBusy error naming who uses the device (mounts, holder
// devices, exclusive claims, processes holding it open), or nil. It changes
// nothing, so callers can refuse an operation before starting it.
func Busy(path string) error {
	n, err := parseNumber(path)
	if err != nil {
		return err
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("%s: %w", path, exclusiveUsers(n))
	} else if err == nil {
		unix.Close(fd)
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

// exclusiveUsers is the ErrBusy error for /dev/loopN, which an O_EXCL open
// found claimed: it names the mounts and holder devices Users finds, or
// says what else claims a device.
func exclusiveUsers(n int) error {
	if users := Users(n); len(users) > 0 {
		return fmt.Errorf("%w by %s", ErrBusy, strings.Join(users, ", "))
	}
	return fmt.Errorf("%w by an exclusive open (a mount in another mount namespace, a running mkfs or fsck, or another device)", ErrBusy)
}

// Users names what keeps /dev/loopN (or one of its partitions) in use in a
// way that forbids detaching: mounts in this mount namespace and holder
// devices (device-mapper and the like). It reads sysfs and mountinfo only.
func Users(n int) []string {
	dirs := sysDirs(n)
	users := mountsOf(devNumbers(dirs))
	for _, dir := range dirs {
		holders, _ := os.ReadDir(filepath.Join(dir, "holders"))
		for _, h := range holders {
			users = append(users, fmt.Sprintf("holder device %s of %s", h.Name(), filepath.Base(dir)))
		}
	}
	return users
}

// devNumbers maps the "major:minor" of each device of dirs (sysDirs: a
// loop device and its partitions) to the device's name, from sysfs.
func devNumbers(dirs []string) map[string]string {
	devnums := map[string]string{}
	for _, dir := range dirs {
		if b, err := os.ReadFile(filepath.Join(dir, "dev")); err == nil {
			devnums[strings.TrimSpace(string(b))] = filepath.Base(dir)
		}
	}
	return devnums
}

// MountPoints returns where the device path (a loop device or partition) is
// mounted in this mount namespace.
func MountPoints(path string) ([]string, error) {
	return ReadMountTable().Of(path)
}

// MountTable maps "major:minor" to mount points, read once from mountinfo
// so that callers reporting many devices do not read it per device.
type MountTable map[string][]string

// ReadMountTable reads this mount namespace's mountinfo.
func ReadMountTable() MountTable {
	t := MountTable{}
	for _, m := range mountEntries() {
		t[devnum(m)] = append(t[devnum(m)], m.Mountpoint)
	}
	return t
}

// Of returns where the device path is mounted.
func (t MountTable) Of(path string) ([]string, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return nil, fmt.Errorf("mount points of %s: %w", path, err)
	}
	return t[fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))], nil
}

// mountEntries reads this mount namespace's mount table; none if it
// cannot be read.
func mountEntries() []*mountinfo.Info {
	infos, _ := mountinfo.GetMounts(nil)
	return infos
}

func devnum(m *mountinfo.Info) string { return strconv.Itoa(m.Major) + ":" + strconv.Itoa(m.Minor) }

func mountsOf(devnums map[string]string) []string {
	var out []string
	for _, m := range mountEntries() {
		if name, ok := devnums[devnum(m)]; ok {
			out = append(out, fmt.Sprintf("mount of %s at %q", name, m.Mountpoint))
		}
	}
	return out
}

// openers names processes that hold /dev/loopN or its partitions open, by
// scanning /proc/*/fd: an fd counts when it is open on a block device node
// of one of those device numbers, whatever its path (a node made with
// mknod elsewhere, a container's /dev/xvda). Each fd's target is looked
// at through its /proc link with AT_STATX_DONT_SYNC, so a file on a
// network or FUSE filesystem is not asked about; fds that name no path
// (sockets, pipes) are skipped unlooked. Best effort: it may miss
// processes in other PID namespaces.
func openers(n int) []string {
	devs := devNumbers(sysDirs(n))
	if len(devs) == 0 {
		return nil
	}
	self := strconv.Itoa(os.Getpid())
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []string
	for _, p := range procs {
		if _, err := strconv.Atoi(p.Name()); err != nil || p.Name() == self {
			continue
		}
		dir := filepath.Join("/proc", p.Name(), "fd")
		fds, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			if opensOneOf(filepath.Join(dir, fd.Name()), devs) {
				comm, _ := os.ReadFile(filepath.Join("/proc", p.Name(), "comm"))
				out = append(out, fmt.Sprintf("pid %s (%q)", p.Name(), strings.TrimSpace(string(comm))))
				break
			}
		}
	}
	return out
}

// opensOneOf reports whether link, a /proc/PID/fd entry, is open on a
// block device node of one of devs (devNumbers).
func opensOneOf(link string, devs map[string]string) bool {
	target, err := os.Readlink(link)
	if err != nil || !strings.HasPrefix(target, "/") {
		return false
	}
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, link, unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE, &stx); err != nil {
		return false
	}
	_, ok := devs[fmt.Sprintf("%d:%d", stx.Rdev_major, stx.Rdev_minor)]
	return stx.Mode&unix.S_IFMT == unix.S_IFBLK && ok
}

// Writes is what the kernel counted of the changes made to a loop
// device's data (its partitions' count into it): completed writes and
// discards, the sectors they covered, and the writes in flight (the
// kernel counts a discard in flight as a write). Reads count nowhere
// here: a reader (udev's probe, a backup) changes no data. Two equal
// readings with no write in flight prove that no write completed, or
// was under way, in between: a writer that opened the device, wrote and
// closed between two Busy checks moves them.
type Writes struct {
	Writes, WriteSectors, Discards, DiscardSectors, InFlight uint64
}

// Idle reports whether no write was in flight when w was read.
func (w Writes) Idle() bool { return w.InFlight == 0 }

// WritesOf reads the counters of d (/sys/block/loopN/stat). Where the
// kernel does not count for the device (queue/iostats 0) they would never
// move, and WritesOf errs: they prove nothing.
func WritesOf(d *Device) (Writes, error) {
	dir := fmt.Sprintf("/sys/block/loop%d", d.Number)
	buf := make([]byte, 256)
	if v, ok := readSysString(dir+"/queue/iostats", buf); !ok || v != "1" {
		return Writes{}, fmt.Errorf("write counters of %s: %s/queue/iostats is not 1: the kernel does not count its I/O", d.Path, dir)
	}
	v, ok := readSysString(dir+"/stat", buf)
	if !ok {
		return Writes{}, fmt.Errorf("write counters of %s: cannot read %s/stat", d.Path, dir)
	}
	f := strings.Fields(v)
	if len(f) < 14 {
		return Writes{}, fmt.Errorf("write counters of %s: %s/stat has %d fields, want at least 14", d.Path, dir, len(f))
	}
	var n [14]uint64
	for _, i := range []int{4, 6, 11, 13} { // see Documentation/block/stat.rst
		x, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return Writes{}, fmt.Errorf("write counters of %s: %s/stat: %w", d.Path, dir, err)
		}
		n[i] = x
	}
	// stat's in_flight sums reads and writes; inflight has them apart.
	v, ok = readSysString(dir+"/inflight", buf)
	if f = strings.Fields(v); !ok || len(f) != 2 {
		return Writes{}, fmt.Errorf("write counters of %s: cannot read %s/inflight", d.Path, dir)
	}
	inFlight, err := strconv.ParseUint(f[1], 10, 64)
	if err != nil {
		return Writes{}, fmt.Errorf("write counters of %s: %s/inflight: %w", d.Path, dir, err)
	}
	return Writes{Writes: n[4], WriteSectors: n[6], InFlight: inFlight, Discards: n[11], DiscardSectors: n[13]}, nil
}
