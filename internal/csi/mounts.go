package csi

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// devNum is a device number split as mountinfo shows it.
type devNum struct{ major, minor int }

func devNumOf(rdev uint64) devNum { return devNum{int(unix.Major(rdev)), int(unix.Minor(rdev))} }

func (n devNum) of(m *mountinfo.Info) bool { return m.Major == n.major && m.Minor == n.minor }

// usesOf lists where the block device dev is in use through mounts: as a
// filesystem (its major:minor) and as a device node bind-mounted onto a
// file (the way block volumes are published). Paths are as mountinfo
// shows them. It is also the proof that a mount is the volume's: owns.
type usesOf struct {
	fsMounts []string // mounts of the filesystem on dev
	nodeBind []string // bind mounts of the device node itself

	known    bool   // dev was given: the identities below are set
	fs       devNum // the device itself (its filesystem's mounts show it)
	nodeDev  devNum // the filesystem holding the device node (devtmpfs)
	nodeRoot string // the node's path inside that filesystem; "" if unknown

	table []*mountinfo.Info // the mount table read, nil if none was
}

// deviceUses reads the mount table for the uses of dev. An empty dev (no
// device) has no uses and owns nothing.
func deviceUses(dev string) (usesOf, error) {
	var u usesOf
	if dev == "" {
		return u, nil
	}
	var node unix.Stat_t
	if err := unix.Stat(dev, &node); err != nil {
		return u, fmt.Errorf("stat %s: %w", dev, err)
	}
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		return u, fmt.Errorf("read the mount table: %w", err)
	}
	u.known, u.fs, u.nodeDev, u.table = true, devNumOf(node.Rdev), devNumOf(node.Dev), infos
	// The device node's path inside the filesystem that holds it (devtmpfs):
	// a bind mount of the node shows that path as its root.
	best := -1
	for _, m := range infos {
		if u.nodeDev.of(m) && (dev == m.Mountpoint || strings.HasPrefix(dev, strings.TrimSuffix(m.Mountpoint, "/")+"/")) &&
			len(m.Mountpoint) > best {
			best = len(m.Mountpoint)
			rel := strings.TrimPrefix(dev, m.Mountpoint)
			u.nodeRoot = filepath.Join(m.Root, rel)
		}
	}
	for _, m := range infos {
		switch {
		case u.fs.of(m):
			u.fsMounts = append(u.fsMounts, m.Mountpoint)
		case u.isNodeBind(m) && m.Mountpoint != dev:
			u.nodeBind = append(u.nodeBind, m.Mountpoint)
		}
	}
	return u, nil
}

func (u usesOf) isNodeBind(m *mountinfo.Info) bool {
	return u.nodeRoot != "" && u.nodeDev.of(m) && m.Root == u.nodeRoot
}

// owns reports whether mount m is a use of the device: its filesystem
// (mounted or bound anywhere) or a bind of its device node. This is the
// proof required before anything at a node path is unmounted or removed.
func (u usesOf) owns(m *mountinfo.Info) bool {
	return u.known && (u.fs.of(m) || u.isNodeBind(m))
}

// all returns every use.
func (u usesOf) all() []string { return append(append([]string{}, u.fsMounts...), u.nodeBind...) }

// samePath compares a node path with a path of the mount table. Neither
// needs resolving: node paths hold no link (checkNodePath), and the
// kernel spells mount points resolved.
func samePath(a, b string) bool {
	return filepath.Clean(a) == filepath.Clean(b)
}

func containsPath(list []string, p string) bool {
	for _, x := range list {
		if samePath(x, p) {
			return true
		}
	}
	return false
}

// topMount returns the mount visible at path (the last of those stacked
// there), and false if path is no mount point. path must be clean and free
// of symlinks (checkNodePath), so it is spelled as mountinfo spells it.
func topMount(path string) (*mountinfo.Info, bool, error) {
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, false, fmt.Errorf("read the mount table: %w", err)
	}
	m, ok := topMountIn(infos, path)
	return m, ok, nil
}

// topMountIn is topMount in a mount table read already.
func topMountIn(infos []*mountinfo.Info, path string) (*mountinfo.Info, bool) {
	var at []*mountinfo.Info
	for _, m := range infos {
		if m.Mountpoint == path {
			at = append(at, m)
		}
	}
	for _, m := range at {
		covered := false
		for _, o := range at {
			if o.Parent == m.ID && o.ID != m.ID {
				covered = true
				break
			}
		}
		if !covered {
			return m, true
		}
	}
	return nil, false
}

// isMountPoint reports whether path is a mount point, by the mount table
// deviceUses read for u (one read for both questions), or by a table read
// now where it read none.
func (u usesOf) isMountPoint(path string) (bool, error) {
	if u.table == nil {
		_, ok, err := topMount(path)
		return ok, err
	}
	_, ok := topMountIn(u.table, path)
	return ok, nil
}

// describeMount names a mount for messages: what it is and from where.
func describeMount(m *mountinfo.Info) string {
	return fmt.Sprintf("%s %s (device %d:%d, root %s)", m.FSType, m.Source, m.Major, m.Minor, m.Root)
}

// unmountOwned unmounts the mounts stacked at path from the top for as
// long as each is the volume's (uses.owns), and leaves alone the first one
// that is not, returning it as foreign. unmounted counts what it took away.
// Each unmount is umount(2) itself, what umount(8) would call, without a
// process; EINVAL (nothing mounted there any more) is no error: the
// volume is already gone from path.
//
// The unmount names path's last component in its directory as the
// no-follow walk opened it (openNodeParent): a directory swapped for a
// link since cannot lead it to another mount. Where that directory is
// gone, nothing of the volume can be mounted there.
func (d *Driver) unmountOwned(path string, uses usesOf) (unmounted int, foreign *mountinfo.Info, err error) {
	parent, base, err := openNodeParent(path)
	if errors.Is(err, unix.ENOENT) {
		return 0, nil, nil
	}
	if err != nil {
		return 0, nil, err
	}
	defer unix.Close(parent)
	for range 8 {
		top, ok, err := topMount(path)
		if err != nil || !ok {
			return unmounted, nil, err
		}
		if !uses.owns(top) {
			return unmounted, top, nil
		}
		if nodePathRace != nil {
			nodePathRace(path)
		}
		if err := unix.Unmount(procFD(parent)+"/"+base, unix.UMOUNT_NOFOLLOW); err != nil && !errors.Is(err, unix.EINVAL) {
			return unmounted, nil, fmt.Errorf("unmount %s: %w", path, err)
		}
		unmounted++
	}
	return unmounted, nil, fmt.Errorf("unmount %s: still mounted after 8 unmounts", path)
}

// bindMount binds what source is open on (a block device node, or the
// volume's filesystem at its staging path) onto what target is open on,
// read-only if readOnly: a clone of source's mount (open_tree) is made
// read-only before it is attached (mount_setattr), then attached to
// target (move_mount). Nothing is looked up by name again, and a
// read-only bind is never writable, not for a moment. The clone keeps
// the per-mount flags of source's mount (the staging mount's options).
// The caller owns both fds.
func bindMount(source, target int, readOnly bool) error {
	clone, err := unix.OpenTree(source, "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH)
	if err != nil {
		return fmt.Errorf("clone the mount (open_tree): %w", err)
	}
	defer unix.Close(clone)
	if readOnly {
		if err := unix.MountSetattr(clone, "", unix.AT_EMPTY_PATH, &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}); err != nil {
			return fmt.Errorf("make the bind read-only (mount_setattr): %w", err)
		}
	}
	if err := unix.MoveMount(clone, "", target, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the bind (move_mount): %w", err)
	}
	return nil
}

// openOn opens the node path p (openNodePath) and proves that what it
// reaches is on dev, the volume's device: its filesystem, for a staging
// path it mounted. Anything else (a path swapped since it was mounted on)
// is volume.ErrUnsafe. The caller closes the fd.
func openOn(p, dev string) (int, error) {
	var d unix.Stat_t
	if err := unix.Stat(dev, &d); err != nil {
		return -1, err
	}
	fd, err := openNodePath(p, existing)
	if err != nil {
		return -1, err
	}
	return fsutil.CheckFD(fd, func(st *unix.Stat_t) error {
		if d.Mode&unix.S_IFMT != unix.S_IFBLK || st.Dev != d.Rdev {
			return fmt.Errorf("%s is not on %s: %w", p, dev, volume.ErrUnsafe)
		}
		return nil
	})
}

// openDevice opens the block device node dev with O_PATH, not following a
// link: what a block volume's bind clones.
func openDevice(dev string) (int, error) {
	fd, err := unix.Open(dev, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open %s: %w", dev, err)
	}
	return fsutil.CheckFD(fd, func(st *unix.Stat_t) error {
		if st.Mode&unix.S_IFMT != unix.S_IFBLK {
			return fmt.Errorf("%s is not a block device: %w", dev, volume.ErrUnsafe)
		}
		return nil
	})
}

// mountFlags are the mount(8) options that are mount(2) flags: set or
// cleared, in the order given, as mount(8) applies them.
var mountFlags = map[string]struct{ set, clear uintptr }{
	"defaults":    {},
	"ro":          {set: unix.MS_RDONLY},
	"rw":          {clear: unix.MS_RDONLY},
	"nosuid":      {set: unix.MS_NOSUID},
	"suid":        {clear: unix.MS_NOSUID},
	"nodev":       {set: unix.MS_NODEV},
	"dev":         {clear: unix.MS_NODEV},
	"noexec":      {set: unix.MS_NOEXEC},
	"exec":        {clear: unix.MS_NOEXEC},
	"sync":        {set: unix.MS_SYNCHRONOUS},
	"async":       {clear: unix.MS_SYNCHRONOUS},
	"dirsync":     {set: unix.MS_DIRSYNC},
	"noatime":     {set: unix.MS_NOATIME},
	"atime":       {clear: unix.MS_NOATIME},
	"nodiratime":  {set: unix.MS_NODIRATIME},
	"diratime":    {clear: unix.MS_NODIRATIME},
	"relatime":    {set: unix.MS_RELATIME},
	"norelatime":  {clear: unix.MS_RELATIME},
	"strictatime": {set: unix.MS_STRICTATIME},
	"lazytime":    {set: unix.MS_LAZYTIME},
	"nolazytime":  {clear: unix.MS_LAZYTIME},
}

// fsDataOptions are options mount(8) hands to the filesystem as they are
// (ext4 and XFS both know them).
var fsDataOptions = map[string]bool{"discard": true, "nodiscard": true}

// fsMountOptions are the ext4 and XFS options mount flags may carry
// beyond mountFlags and fsDataOptions; mount(8) hands them to the
// filesystem. A key ending in "=" takes a value of mountValue's
// characters; fsMountValues lists the only values some keys take.
// Nothing here names a path or a device (logdev, journal_path), sets up
// a loop device (loop, offset, sizelimit), moves or remounts (bind,
// move, remount), or panics the node on an error (errors=panic).
var fsMountOptions = map[string]bool{
	// ext4
	"errors=": true, "data=": true, "data_err=": true, "commit=": true, "barrier": true, "nobarrier": true,
	"barrier=": true, "journal_checksum": true, "nojournal_checksum": true, "journal_async_commit": true,
	"journal_ioprio=": true, "delalloc": true, "nodelalloc": true, "max_batch_time=": true,
	"min_batch_time=": true, "auto_da_alloc": true, "noauto_da_alloc": true, "init_itable=": true,
	"noinit_itable": true, "stripe=": true, "dioread_nolock": true, "dioread_lock": true, "i_version": true,
	"nombcache": true, "block_validity": true, "noblock_validity": true, "acl": true, "noacl": true,
	"user_xattr": true, "nouser_xattr": true, "resgid=": true, "resuid=": true, "mb_optimize_scan=": true,
	"prefetch_block_bitmaps": true, "no_prefetch_block_bitmaps": true,
	// both
	"grpid": true, "bsdgroups": true, "nogrpid": true, "sysvgroups": true, "quota": true, "noquota": true,
	"usrquota": true, "grpquota": true, "prjquota": true,
	// XFS
	"allocsize=": true, "attr2": true, "noattr2": true, "filestreams": true, "ikeep": true, "noikeep": true,
	"inode32": true, "inode64": true, "largeio": true, "nolargeio": true, "logbufs=": true, "logbsize=": true,
	"noalign": true, "nouuid": true, "uquota": true, "uqnoenforce": true, "pquota": true, "pqnoenforce": true,
	"gquota": true, "gqnoenforce": true, "sunit=": true, "swidth=": true, "swalloc": true, "wsync": true,
}

// fsMountValues are the only values the keys listed take; errors= takes
// volume's Ext4ErrorBehaviors, the rule mkfs -e follows too.
var fsMountValues = map[string][]string{
	"errors":   volume.Ext4ErrorBehaviors,
	"data":     {"ordered", "writeback", "journal"},
	"data_err": {"ignore", "abort"},
}

// checkMountOptions refuses (volume.ErrInvalid) a mount option that is
// not in mountFlags, fsDataOptions or fsMountOptions, or an empty one.
// Every capability is checked before anything is done with it
// (checkRequested); mountArgs then knows each option's way.
func checkMountOptions(options []string) error {
	for _, o := range options {
		for _, opt := range strings.Split(o, ",") {
			if _, ok := mountFlags[opt]; ok || fsDataOptions[opt] {
				continue
			}
			key, value, hasValue := strings.Cut(opt, "=")
			switch {
			case !hasValue && fsMountOptions[key]:
				continue
			case hasValue && fsMountOptions[key+"="] && mountValue(value) &&
				(fsMountValues[key] == nil || slices.Contains(fsMountValues[key], value)):
				continue
			}
			return fmt.Errorf("mount option %s is not one sparsevol passes on (mount(2) flags, discard, and ext4 and XFS options that name no path or device): %w", volume.Quote(opt), volume.ErrInvalid)
		}
	}
	return nil
}

// mountValue reports whether v is a value fsMountOptions may take: a
// number, a size or a word, no path.
func mountValue(v string) bool {
	if v == "" || len(v) > 64 {
		return false
	}
	for _, c := range v {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

// mountArgs turns mount(8) options, checked by checkMountOptions, into
// mount(2) flags and the filesystem's data: each option mountFlags knows
// is a flag, set or cleared in order as mount(8) does, and every other
// one is the filesystem's, as mount(8) would hand it on.
func mountArgs(options []string) (flags uintptr, data string, err error) {
	if err := checkMountOptions(options); err != nil {
		return 0, "", err
	}
	var fsOpts []string
	for _, o := range options {
		for _, opt := range strings.Split(o, ",") {
			if f, known := mountFlags[opt]; known {
				flags = flags&^f.clear | f.set
				continue
			}
			fsOpts = append(fsOpts, opt)
		}
	}
	return flags, strings.Join(fsOpts, ","), nil
}

// withErrorBehavior returns options with errors=remount-ro added where
// the ext4 superblock on dev says panic (volume.PanicsOnError) and no
// option names a behaviour: a superblock comes from whoever made the
// image (adopt, import), and a volume's errors must not panic the node.
// A behaviour the superblock or the options give otherwise stands. The
// options given are not changed.
func withErrorBehavior(dev, fsType string, options []string) []string {
	if fsType != "ext4" {
		return options
	}
	for _, o := range options {
		for _, opt := range strings.Split(o, ",") {
			if strings.HasPrefix(opt, "errors=") {
				return options
			}
		}
	}
	if !volume.PanicsOnError(dev) {
		return options
	}
	return append(slices.Clone(options), "errors=remount-ro")
}

// mountFilesystem mounts the fsType filesystem on dev at target (a
// node path, its missing directories made by openNodePath) with mount(8)
// options (and an ext4 error behaviour: withErrorBehavior), by mount(2)
// onto the directory opened: no process, and no name looked up again.
func mountFilesystem(dev, target, fsType string, options []string) error {
	flags, data, err := mountArgs(withErrorBehavior(dev, fsType, options))
	if err != nil {
		return err
	}
	fd, err := openNodePath(target, makeDir)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Mount(dev, procFD(fd), fsType, flags, data); err != nil {
		return fmt.Errorf("mount(2) %s at %s, type %s, options %q: %w", dev, target, fsType, strings.Join(options, ","), err)
	}
	return nil
}
