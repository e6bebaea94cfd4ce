package loop

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

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

// DeletedSuffix is what the kernel appends to the path of a bound file
// that was removed (or renamed over) since it was bound.
const DeletedSuffix = " (deleted)"

// BackingFile returns the path of the file loop device n is bound to, as
// the kernel names it in this process's mount namespace (a file opened
// through another namespace's mounts is named from that namespace's
// root), with DeletedSuffix if the file was removed since. ErrNotAttached
// if n is not bound.
func BackingFile(n int) (string, error) {
	path, ok := readSysString(fmt.Sprintf("/sys/block/loop%d/loop/backing_file", n), make([]byte, 4096))
	if !ok {
		return "", fmt.Errorf("backing file of %s: %w", devicePath(n), ErrNotAttached)
	}
	return path, nil
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

func mknodFromSysfs(n int) error {
	dev, err := sysfsDevT(n)
	if err != nil {
		return err
	}
	err = unix.Mknod(devicePath(n), unix.S_IFBLK|0o660, int(dev))
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
	return err
}

// sysfsDevT is the device number the kernel gives loop device n
// (/sys/block/loopN/dev), whatever node sits at /dev/loopN.
func sysfsDevT(n int) (uint64, error) {
	path := fmt.Sprintf("/sys/block/loop%d/dev", n)
	s, ok := readSysString(path, make([]byte, 32))
	if !ok {
		return 0, fmt.Errorf("read %s: loop%d is gone", path, n)
	}
	var major, minor uint32
	if _, err := fmt.Sscanf(s, "%d:%d", &major, &minor); err != nil {
		return 0, fmt.Errorf("parse %s %q: %w", path, s, err)
	}
	return unix.Mkdev(major, minor), nil
}

// DevT returns the device number of d, from the kernel (sysfs) for the
// loop device d.Number, not from a lookup of d.Path: the number names
// the device the caller proved, even if the /dev node was replaced since.
func (d *Device) DevT() (uint64, error) { return sysfsDevT(d.Number) }

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

// NotifyChange makes the kernel send udev a "change" event for the device
// and its partitions, so udev probes again what mkfs or sgdisk just wrote.
// udev re-probes on its own when a writer closes a device it watches, but
// the watch may not be in place yet on a device bound a moment ago.
func NotifyChange(path string) error {
	n, err := parseNumber(path)
	if err != nil {
		return err
	}
	for _, dir := range sysDirs(n) {
		if err := os.WriteFile(filepath.Join(dir, "uevent"), []byte("change"), 0); err != nil {
			return fmt.Errorf("notify udev of %s: %w", filepath.Base(dir), err)
		}
	}
	return nil
}

// sysDirs lists the sysfs directories of /dev/loopN and of its partitions
// (loopNp1, ...), the device's first.
func sysDirs(n int) []string {
	name := fmt.Sprintf("loop%d", n)
	dir := filepath.Join("/sys/block", name)
	parts, _ := filepath.Glob(filepath.Join(dir, name+"p*")) // only a bad pattern errs
	return append([]string{dir}, parts...)
}
