package csi

import (
	"fmt"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	mount "k8s.io/mount-utils"
)

// mountInfoPath is this mount namespace's mount table.
const mountInfoPath = "/proc/self/mountinfo"

// usesOf lists where the block device dev is in use through mounts: as a
// filesystem (its major:minor) and as a device node bind-mounted onto a
// file (the way block volumes are published). Paths are as mountinfo
// shows them.
type usesOf struct {
	fsMounts []string // mounts of the filesystem on dev
	nodeBind []string // bind mounts of the device node itself
}

func deviceUses(dev string) (usesOf, error) {
	var u usesOf
	if dev == "" {
		return u, nil
	}
	var node unix.Stat_t
	if err := unix.Stat(dev, &node); err != nil {
		return u, fmt.Errorf("stat %s: %w", dev, err)
	}
	infos, err := mount.ParseMountInfo(mountInfoPath)
	if err != nil {
		return u, fmt.Errorf("read %s: %w", mountInfoPath, err)
	}
	rdevMajor, rdevMinor := int(unix.Major(node.Rdev)), int(unix.Minor(node.Rdev))
	devMajor, devMinor := int(unix.Major(node.Dev)), int(unix.Minor(node.Dev))
	// The device node's path inside the filesystem that holds it (devtmpfs):
	// a bind mount of the node shows that path as its root.
	nodeRoot := ""
	best := -1
	for _, m := range infos {
		if m.Major == devMajor && m.Minor == devMinor && (dev == m.MountPoint || strings.HasPrefix(dev, strings.TrimSuffix(m.MountPoint, "/")+"/")) &&
			len(m.MountPoint) > best {
			best = len(m.MountPoint)
			rel := strings.TrimPrefix(dev, m.MountPoint)
			nodeRoot = filepath.Join(m.Root, rel)
		}
	}
	for _, m := range infos {
		switch {
		case m.Major == rdevMajor && m.Minor == rdevMinor:
			u.fsMounts = append(u.fsMounts, m.MountPoint)
		case nodeRoot != "" && m.Major == devMajor && m.Minor == devMinor && m.Root == nodeRoot && m.MountPoint != dev:
			u.nodeBind = append(u.nodeBind, m.MountPoint)
		}
	}
	return u, nil
}

// all returns every use.
func (u usesOf) all() []string { return append(append([]string{}, u.fsMounts...), u.nodeBind...) }

// samePath compares paths after resolving symlinks where possible.
func samePath(a, b string) bool {
	return canonical(a) == canonical(b)
}

func canonical(p string) string {
	if r, err := filepath.EvalSymlinks(p); err == nil {
		return r
	}
	return filepath.Clean(p)
}

func containsPath(list []string, p string) bool {
	for _, x := range list {
		if samePath(x, p) {
			return true
		}
	}
	return false
}

// isMountPoint reports whether path is a mount point, by mountinfo.
func isMountPoint(path string) (bool, error) {
	infos, err := mount.ParseMountInfo(mountInfoPath)
	if err != nil {
		return false, fmt.Errorf("read %s: %w", mountInfoPath, err)
	}
	c := canonical(path)
	for _, m := range infos {
		if m.MountPoint == c {
			return true, nil
		}
	}
	return false, nil
}
