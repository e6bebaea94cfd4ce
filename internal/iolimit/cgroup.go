package iolimit

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
)

// DefaultMount is where the cgroup v2 hierarchy is mounted on a node.
const DefaultMount = "/sys/fs/cgroup"

// Environment variables that configure where limits go (the CLI's
// --cgroup-mount and --pods-cgroup flags default to them).
const (
	MountEnv  = "SPARSEVOL_CGROUP_MOUNT"
	CgroupEnv = "SPARSEVOL_PODS_CGROUP"
)

// podCgroups are the cgroups kubelet puts all pods under: the systemd
// cgroup driver's slice, then the cgroupfs driver's directory.
var podCgroups = []string{"kubepods.slice", "kubepods"}

// Config says which cgroup carries the limits. The zero value is the
// default: the pods' cgroup found under DefaultMount.
type Config struct {
	// Mount is the cgroup v2 mount point ("" = DefaultMount). A plugin
	// running in a pod (its own cgroup namespace) is given the host's
	// hierarchy mounted elsewhere.
	Mount string
	// Cgroup is the cgroup that holds all pods, relative to Mount. ""
	// finds it: kubepods.slice (kubelet's systemd driver) or kubepods
	// (cgroupfs driver), whichever exists; if neither does yet (attach at
	// boot runs before kubelet), kubepods.slice is made where systemd
	// runs the hierarchy, and kubelet adopts it. Elsewhere (no systemd, or
	// a container's own cgroup namespace) nothing is guessed: limits fail
	// until the cgroup exists or is named here (and then made).
	Cgroup string
}

// Validate checks the configuration without touching anything: Mount is
// an absolute, clean path and Cgroup a clean relative one below Mount's
// root, both of plain bytes only (plainPath). Errors wrap ErrInvalid and
// name the setting, not its value: this package has no way to show a
// refused value bounded, and the value may be hostile.
func (c Config) Validate() error {
	if c.Mount != "" && (!filepath.IsAbs(c.Mount) || filepath.Clean(c.Mount) != c.Mount || !plainPath(c.Mount)) {
		return fmt.Errorf("cgroup mount: want an absolute, clean path of ASCII letters, digits, '.', '_', '-', '@' and ':' (such as %s): %w", DefaultMount, ErrInvalid)
	}
	if c.Cgroup == "" {
		return nil
	}
	if filepath.IsAbs(c.Cgroup) || filepath.Clean(c.Cgroup) != c.Cgroup || c.Cgroup == "." ||
		slices.Contains(strings.Split(c.Cgroup, "/"), "..") || !plainPath(c.Cgroup) {
		return fmt.Errorf("pods cgroup: want a clean path relative to the cgroup mount, below its root (kubepods.slice, kubepods), of ASCII letters, digits, '.', '_', '-', '@' and ':': %w", ErrInvalid)
	}
	return nil
}

// plainPath reports whether p holds only bytes a cgroup path needs, which
// no terminal and no cgroup file reads as more than text: ASCII letters,
// digits, '.', '_', '-', '@', ':' and the '/' between names.
func plainPath(p string) bool {
	for i := 0; i < len(p); i++ {
		c := p[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("._-@:/", c) >= 0) {
			return false
		}
	}
	return true
}

func (c Config) mount() string {
	if c.Mount == "" {
		return DefaultMount
	}
	return c.Mount
}

// Supported returns nil if limits can be enforced: Mount is a cgroup v2
// hierarchy whose root offers the io controller. Otherwise an error that
// wraps ErrNotSupported and says what the host has instead.
func (c Config) Supported() error {
	if err := c.Validate(); err != nil {
		return err
	}
	m := c.mount()
	var st unix.Statfs_t
	if err := unix.Statfs(m, &st); err != nil {
		return fmt.Errorf("cgroup mount %s: %w: %w", m, err, ErrNotSupported)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		why := "not a cgroup v2 hierarchy (cgroup v1)"
		var u unix.Statfs_t
		if unix.Statfs(filepath.Join(m, "unified"), &u) == nil && u.Type == unix.CGROUP2_SUPER_MAGIC {
			why = "a hybrid hierarchy: the io controller is cgroup v1's blkio, which has no io.max"
		}
		return fmt.Errorf("cgroup mount %s is %s; I/O limits need cgroup v2 (boot with systemd.unified_cgroup_hierarchy=1), or point --cgroup-mount at a cgroup v2 mount: %w",
			m, why, ErrNotSupported)
	}
	ctrl, err := os.ReadFile(filepath.Join(m, "cgroup.controllers"))
	if err != nil {
		return fmt.Errorf("cgroup mount %s: %w: %w", m, err, ErrNotSupported)
	}
	if !slices.Contains(strings.Fields(string(ctrl)), "io") {
		return fmt.Errorf("cgroup v2 at %s does not offer the io controller (controllers: %q; is it bound to a cgroup v1 blkio hierarchy?): %w",
			m, strings.TrimSpace(string(ctrl)), ErrNotSupported)
	}
	return nil
}

// find returns the absolute path of the pods' cgroup and whether it
// exists; with Cgroup unset, the first of podCgroups that exists, or the
// one to make ("" if none may be made).
func (c Config) find() (string, bool) {
	m := c.mount()
	if c.Cgroup != "" {
		p := filepath.Join(m, c.Cgroup)
		return p, isDir(p)
	}
	for _, name := range podCgroups {
		if p := filepath.Join(m, name); isDir(p) {
			return p, true
		}
	}
	// Where systemd runs the hierarchy (the host's, not a container's
	// namespace of it), kubelet's slice may be made ahead of kubelet.
	if isDir(filepath.Join(m, "init.scope")) {
		return filepath.Join(m, podCgroups[0]), false
	}
	return "", false
}

func isDir(p string) bool {
	fi, err := os.Lstat(p)
	return err == nil && fi.IsDir()
}

// Where returns the io.max file limits are written to (for messages and
// status); it may not exist yet.
func (c Config) Where() string {
	p, _ := c.find()
	if p == "" {
		return "(no cgroup holding pods under " + c.mount() + " yet)"
	}
	return filepath.Join(p, "io.max")
}

// Set makes dev's io.max entry on the pods' cgroup exactly l (zero: no
// entry). The cgroup is made if missing, and the io controller enabled in
// the subtree_control of each cgroup above it that lacks it; if the
// write then fails, exactly those changes of this call are undone (the
// cgroups it made removed, the controllers it enabled disabled), so a
// refused Set changes nothing. l must be valid (Validate); the host must
// support limits (Supported) unless l is zero, for which an unsupported
// host is nothing to do.
func (c Config) Set(dev uint64, l Limits) (err error) {
	if err := l.Validate(); err != nil {
		return err
	}
	if l.IsZero() {
		return c.Remove(dev)
	}
	if err := c.Supported(); err != nil {
		return err
	}
	unlock, err := lockHierarchy(c.mount())
	if err != nil {
		return err
	}
	defer unlock()
	cg, ok := c.find()
	if cg == "" {
		return fmt.Errorf("no cgroup holding pods under %s (%s): kubelet has not made it, or this is not the host's hierarchy (in a pod: mount the host's /sys/fs/cgroup and give --cgroup-mount); name it with --pods-cgroup: %w",
			c.mount(), strings.Join(podCgroups, ", "), ErrNotSupported)
	}
	var made, enabled []string
	defer func() {
		if err != nil {
			if uerr := undo(made, enabled); uerr != nil {
				err = errors.Join(err, uerr)
			}
		}
	}()
	if !ok {
		if made, err = makeCgroup(c.mount(), cg); err != nil {
			return err
		}
	}
	if enabled, err = enableIO(c.mount(), cg); err != nil {
		return err
	}
	if setRace != nil {
		setRace()
	}
	return writeLine(cg, l.line(unix.Major(dev), unix.Minor(dev)))
}

// setRace, when a test sets it, runs in Set between the enabling of the
// io controller and the io.max write.
var setRace func()

// lockHierarchy serialises Set with every other Set on the node, in this
// process or another (the CLI beside the plugin, which sees the same
// hierarchy mounted elsewhere): a refused Set undoes the cgroups it made
// and the io controller it enabled, which another Set must not have
// relied on meanwhile. It takes an exclusive flock on the hierarchy's
// root directory, mount, and returns its release, which the caller
// calls.
func lockHierarchy(mount string) (unlock func(), err error) {
	fd, err := unix.Open(mount, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("lock cgroup hierarchy %s: %w", mount, err)
	}
	if err := fsutil.Flock(fd, unix.LOCK_EX); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("lock cgroup hierarchy %s: %w", mount, err)
	}
	return func() { unix.Close(fd) }, nil
}

// makeCgroup makes cg and the cgroups between mount and it that are
// missing, and returns those it made, outermost first.
func makeCgroup(mount, cg string) ([]string, error) {
	var missing, made []string
	for p := cg; p != mount && p != filepath.Dir(p) && !isDir(p); p = filepath.Dir(p) {
		missing = append(missing, p)
	}
	for _, p := range slices.Backward(missing) {
		err := os.Mkdir(p, 0o755)
		if errors.Is(err, fs.ErrExist) {
			continue // made meanwhile by someone else: theirs
		}
		if err != nil {
			return made, fmt.Errorf("make cgroup %s: %w", p, err)
		}
		made = append(made, p)
	}
	return made, nil
}

// undo takes back what a failed Set changed: the io controller out of
// the subtree_control files it was enabled in (enabled, outermost first)
// and the cgroups made (made, outermost first), innermost first.
func undo(made, enabled []string) error {
	var errs []error
	for _, sc := range slices.Backward(enabled) {
		if err := writeFile(sc, "-io"); err != nil {
			errs = append(errs, fmt.Errorf("disable the io controller enabled in %s: %w", sc, err))
		}
	}
	for _, p := range slices.Backward(made) {
		if err := unix.Rmdir(p); err != nil {
			errs = append(errs, fmt.Errorf("remove cgroup %s made: %w", p, err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("undoing a refused limit: %w", errors.Join(errs...))
	}
	return nil
}

// Remove drops dev's io.max entry, if there is one. A host or cgroup
// without limits has none: nothing to do.
func (c Config) Remove(dev uint64) error {
	if c.Supported() != nil {
		return nil
	}
	cg, ok := c.find()
	if !ok {
		return nil
	}
	got, err := readEntry(cg, dev)
	if err != nil || got.IsZero() {
		return err
	}
	return writeLine(cg, Limits{}.line(unix.Major(dev), unix.Minor(dev)))
}

// Get returns dev's io.max entry on the pods' cgroup (zero: none).
func (c Config) Get(dev uint64) (Limits, error) {
	if err := c.Supported(); err != nil {
		return Limits{}, err
	}
	cg, ok := c.find()
	if !ok {
		return Limits{}, nil
	}
	return readEntry(cg, dev)
}

// Entries returns every io.max entry of the pods' cgroup by device
// number: one read for many devices (attach --all). Empty where the host
// cannot hold limits or the cgroup does not exist yet.
func (c Config) Entries() (map[uint64]Limits, error) {
	out := map[uint64]Limits{}
	if c.Supported() != nil {
		return out, nil
	}
	cg, ok := c.find()
	if !ok {
		return out, nil
	}
	err := eachEntry(cg, func(maj, min uint32, l Limits) bool {
		out[unix.Mkdev(maj, min)] = l
		return true
	})
	return out, err
}

// enableIO enables the io controller in the subtree_control of every
// cgroup from mount down to cg's parent that does not have it yet, so
// that cg has an io.max, and returns the subtree_control files it wrote,
// outermost first (also with an error: what was enabled before it).
func enableIO(mount, cg string) ([]string, error) {
	rel, err := filepath.Rel(mount, filepath.Dir(cg))
	if err != nil {
		return nil, fmt.Errorf("cgroup %s: %w", cg, err)
	}
	dir := mount
	parts := []string{}
	if rel != "." {
		parts = strings.Split(rel, "/")
	}
	var enabled []string
	for i := 0; ; i++ {
		sc := filepath.Join(dir, "cgroup.subtree_control")
		data, err := os.ReadFile(sc)
		if err != nil {
			return enabled, fmt.Errorf("enable io controller: %w", err)
		}
		if !slices.Contains(strings.Fields(string(data)), "io") {
			if err := writeFile(sc, "+io"); err != nil {
				return enabled, fmt.Errorf("enable io controller in %s: %w", sc, err)
			}
			enabled = append(enabled, sc)
		}
		if i == len(parts) {
			return enabled, nil
		}
		dir = filepath.Join(dir, parts[i])
	}
}

// writeLine writes one line to cg's io.max.
func writeLine(cg, line string) error {
	p := filepath.Join(cg, "io.max")
	if err := writeFile(p, line); err != nil {
		return fmt.Errorf("write %q to %s: %w", line, p, err)
	}
	return nil
}

// writeFile writes s to the existing file p in one write, as cgroup
// files want; never creates, never follows a final symbolic link.
func writeFile(p, s string) error {
	f, err := os.OpenFile(p, os.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(s)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// readEntry returns dev's limits in cg's io.max (zero if it has none).
func readEntry(cg string, dev uint64) (Limits, error) {
	var got Limits
	err := eachEntry(cg, func(maj, min uint32, l Limits) bool {
		if maj == unix.Major(dev) && min == unix.Minor(dev) {
			got = l
			return false
		}
		return true
	})
	return got, err
}

// eachEntry calls fn for each entry of cg's io.max until fn returns
// false. A cgroup without io.max has none.
func eachEntry(cg string, fn func(maj, min uint32, l Limits) bool) error {
	p := filepath.Join(cg, "io.max")
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", p, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		maj, min, l, err := parseLine(sc.Text())
		if err != nil {
			return fmt.Errorf("read %s: %w", p, err)
		}
		if !fn(maj, min, l) {
			return nil
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read %s: %w", p, err)
	}
	return nil
}

// DeviceNumber returns the device number of the block device node at
// path (not following a symbolic link).
func DeviceNumber(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, fmt.Errorf("%s is not a block device", path)
	}
	return st.Rdev, nil
}
