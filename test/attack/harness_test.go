package attack

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// linkDir is where sparsevol publishes /dev/sparsevol/<uuid>; it is
// node-wide, so only the links of a case's own UUIDs are looked at.
const linkDir = "/dev/sparsevol"

// kase is one attack's world: a private directory holding its stores, its
// victims and its kubelet directory. Whatever the case (or a regression)
// binds or mounts there is undone at cleanup, also on failure.
type kase struct {
	t   *testing.T
	dir string
	// stores are listed in every snapshot.
	stores []string
	// watched are victim paths (files or directory trees) checksummed in
	// every snapshot.
	watched []string
	// mountPoints outside dir whose mounts are part of every snapshot,
	// with the mount IDs there before the case, which cleanup keeps.
	mountPoints map[string][]string
	// uuids whose /dev/sparsevol link is part of every snapshot, besides
	// those of the stores' volumes.
	uuids []string
}

func newCase(t *testing.T) *kase {
	t.Helper()
	testutil.RequireRoot(t)
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	c := &kase{t: t, dir: dir, mountPoints: map[string][]string{}}
	t.Cleanup(c.cleanup)
	return c
}

// path names a file of the case.
func (c *kase) path(elem ...string) string {
	return filepath.Join(append([]string{c.dir}, elem...)...)
}

// mkdir makes a directory of the case (0700) and returns its path.
func (c *kase) mkdir(elem ...string) string {
	c.t.Helper()
	p := c.path(elem...)
	if err := os.MkdirAll(p, 0o700); err != nil {
		c.t.Fatal(err)
	}
	return p
}

// store makes an empty store directory (0700), listed in every snapshot.
func (c *kase) store(name string) string {
	c.t.Helper()
	s := c.mkdir(name)
	c.stores = append(c.stores, s)
	return s
}

// watch adds victim paths to every snapshot.
func (c *kase) watch(paths ...string) { c.watched = append(c.watched, paths...) }

// watchMountPoint adds a mount point outside the case directory (such as
// /etc) to every snapshot; cleanup removes mounts made there by the case.
func (c *kase) watchMountPoint(p string) {
	c.t.Helper()
	var ids []string
	for _, m := range readMountInfo(c.t) {
		if m.point == p {
			ids = append(ids, m.id)
		}
	}
	c.mountPoints[p] = ids
}

// victim writes a file of random content (watched) and returns its path.
func (c *kase) victim(name string, size int) string {
	c.t.Helper()
	p := c.path("victim", name)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		c.t.Fatal(err)
	}
	b := make([]byte, size)
	rand.Read(b)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		c.t.Fatal(err)
	}
	c.watch(p)
	return p
}

// zeroFile makes a sparse file of size bytes (a device that "looks blank").
func (c *kase) zeroFile(name string, size int64) string {
	c.t.Helper()
	p := c.path("victim", name)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		c.t.Fatal(err)
	}
	f, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR|os.O_EXCL, 0o600)
	if err != nil {
		c.t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		c.t.Fatal(err)
	}
	c.watch(p)
	return p
}

// ext4Image makes a file holding an ext4 filesystem (what adopt accepts).
func (c *kase) ext4Image(name string) string {
	c.t.Helper()
	p := c.zeroFile(name, 16<<20)
	run(c.t, "mkfs.ext4", "-q", "-F", p)
	return p
}

// run runs a helper program the test needs and fails the test if it fails.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// ---- the CLI ----

// result is what a CLI process did.
type result struct {
	args           []string
	code           int
	stdout, stderr string
}

func (r result) String() string {
	return fmt.Sprintf("sparsevol %s: exit %d\nstdout: %s\nstderr: %s",
		strings.Join(r.args, " "), r.code, strings.TrimSpace(r.stdout), strings.TrimSpace(r.stderr))
}

// sv runs the CLI on store with args. Units go to a directory of the case,
// never the host's.
func (c *kase) sv(store string, args ...string) result {
	c.t.Helper()
	return c.svEnv(nil, store, args...)
}

// svEnv is sv with extra environment variables.
func (c *kase) svEnv(env []string, store string, args ...string) result {
	c.t.Helper()
	full := append([]string{"--root", store, "--unit-dir", c.path("units")}, args...)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, full...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Dir = c.dir
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	r := result{args: args, stdout: stdout.String(), stderr: stderr.String()}
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	case err != nil:
		c.t.Fatalf("run sparsevol %v: %v", args, err)
	}
	return r
}

// mustSV runs the CLI and fails the test unless it exits 0; it returns
// standard output, trimmed.
func (c *kase) mustSV(store string, args ...string) string {
	c.t.Helper()
	r := c.sv(store, args...)
	if r.code != 0 {
		c.t.Fatalf("setup: %v", r)
	}
	return strings.TrimSpace(r.stdout)
}

// create makes a volume (not attached) and returns its UUID.
func (c *kase) create(store, name string, args ...string) string {
	c.t.Helper()
	if !slices.Contains(args, "--size") {
		args = append(args, "--size", "16M")
	}
	return c.mustSV(store, append([]string{"create", name, "--no-start"}, args...)...)
}

// attach attaches a volume and returns its data device.
func (c *kase) attach(store, ref string) string {
	c.t.Helper()
	c.mustSV(store, "attach", ref)
	return c.status(store, ref).DataDevice
}

// volStatus is the part of `status -o json` the cases read.
type volStatus struct {
	Name        string `json:"name"`
	UUID        string `json:"uuid"`
	State       string `json:"state"`
	SizeBytes   int64  `json:"sizeBytes"`
	BackingFile string `json:"backingFile"`
	Attached    bool   `json:"attached"`
	Device      string `json:"device"`
	DataDevice  string `json:"dataDevice"`
	ExpandingTo int64  `json:"expandingTo"`
}

func (c *kase) status(store, ref string) volStatus {
	c.t.Helper()
	out := c.mustSV(store, "status", ref, "-o", "json")
	var st volStatus
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		c.t.Fatalf("status %s: %v: %s", ref, err, out)
	}
	return st
}

// expectCode fails the case unless r exited with one of codes.
func (c *kase) expectCode(r result, codes ...int) {
	c.t.Helper()
	if !slices.Contains(codes, r.code) {
		c.t.Errorf("want exit %v, got %v", codes, r)
	}
}

// ---- snapshots ----

// state is what must not change when sparsevol refuses an attack.
type state struct {
	sums   map[string]string // victim path -> content digest
	loops  map[string]string // loop device -> binding (file, offset, limit, flags, tag)
	mounts []string          // mountinfo lines of the case's mount points and devices
	links  map[string]string // /dev/sparsevol/<uuid> -> target
	stores map[string]string // store -> `list -o json` and directory listing
}

// snapshot records the case's world.
func (c *kase) snapshot() state {
	c.t.Helper()
	return c.snapshotWith(nil)
}

// snapshotWith records the case's world, with the /dev/sparsevol links of
// extra UUIDs (those of volumes that were there before).
func (c *kase) snapshotWith(extra []string) state {
	c.t.Helper()
	s := state{sums: map[string]string{}, links: map[string]string{}, stores: map[string]string{}}
	for _, p := range c.watched {
		s.sums[p] = digest(p)
	}
	loops := c.loops()
	s.loops = map[string]string{}
	for dev, l := range loops {
		s.loops[dev] = l.String()
	}
	s.mounts = c.mounts(loops)
	uuids := append(slices.Clone(c.uuids), extra...)
	for _, st := range c.stores {
		s.stores[st] = c.storeListing(st)
		uuids = append(uuids, storeUUIDs(st)...)
	}
	for _, u := range uuids {
		s.links[u] = readLink(filepath.Join(linkDir, u))
	}
	return s
}

// unchanged fails the case for every difference between before and now.
func (c *kase) unchanged(before state) {
	c.t.Helper()
	var uuids []string
	for u := range before.links {
		uuids = append(uuids, u)
	}
	now := c.snapshotWith(uuids)
	diffMap(c.t, "victim", before.sums, now.sums)
	diffMap(c.t, "loop device", before.loops, now.loops)
	diffMap(c.t, "/dev/sparsevol link", before.links, now.links)
	diffMap(c.t, "store", before.stores, now.stores)
	if !slices.Equal(before.mounts, now.mounts) {
		c.t.Errorf("mount table changed:\nbefore:\n  %s\nafter:\n  %s",
			strings.Join(before.mounts, "\n  "), strings.Join(now.mounts, "\n  "))
	}
}

func diffMap(t *testing.T, what string, before, after map[string]string) {
	t.Helper()
	keys := map[string]bool{}
	for k := range before {
		keys[k] = true
	}
	for k := range after {
		keys[k] = true
	}
	sorted := make([]string, 0, len(keys))
	for k := range keys {
		sorted = append(sorted, k)
	}
	sort.Strings(sorted)
	for _, k := range sorted {
		b, okb := before[k]
		a, oka := after[k]
		switch {
		case !okb:
			t.Errorf("%s %s appeared: %s", what, k, a)
		case !oka:
			t.Errorf("%s %s vanished (was %s)", what, k, b)
		case a != b:
			t.Errorf("%s %s changed:\nbefore: %s\nafter:  %s", what, k, b, a)
		}
	}
}

// digest describes a path's content: a file's hash and link count, a
// symlink's target, every file of a directory tree.
func digest(p string) string {
	fi, err := os.Lstat(p)
	switch {
	case err != nil:
		return "missing"
	case fi.Mode()&fs.ModeSymlink != 0:
		return "symlink -> " + readLink(p)
	case fi.IsDir():
		var parts []string
		filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
			if err == nil && q != p {
				rel, _ := filepath.Rel(p, q)
				parts = append(parts, rel+"="+digest(q))
				if d.IsDir() {
					return filepath.SkipDir // digest(q) covered it
				}
			}
			return nil
		})
		return "dir{" + strings.Join(parts, ", ") + "}"
	}
	f, err := os.Open(p)
	if err != nil {
		return "unreadable: " + err.Error()
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "unreadable: " + err.Error()
	}
	return fmt.Sprintf("sha256:%s size=%d mode=%v links=%d", hex.EncodeToString(h.Sum(nil))[:16],
		fi.Size(), fi.Mode(), fi.Sys().(*syscall.Stat_t).Nlink)
}

func fileDigest(t *testing.T, p string) string {
	t.Helper()
	if _, err := os.Stat(p); err != nil {
		t.Fatal(err)
	}
	return digest(p)
}

func readLink(p string) string {
	target, err := os.Readlink(p)
	if err != nil {
		return "absent"
	}
	return target
}

// storeListing is `sparsevol list -o json` (without the allocation, which
// a mounted filesystem changes by itself) and the store's directory
// entries (without lock files).
func (c *kase) storeListing(store string) string {
	c.t.Helper()
	r := c.sv(store, "list", "-o", "json")
	var b strings.Builder
	var vols []map[string]any
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &vols) != nil {
		fmt.Fprintf(&b, "list: exit %d: %s %s", r.code, r.stdout, r.stderr)
	} else {
		for _, v := range vols {
			delete(v, "allocatedBytes")
		}
		sort.Slice(vols, func(i, j int) bool { return fmt.Sprint(vols[i]["uuid"]) < fmt.Sprint(vols[j]["uuid"]) })
		j, _ := json.Marshal(vols)
		b.Write(j)
	}
	entries, _ := os.ReadDir(store)
	for _, e := range entries {
		if e.Name() == ".locks" {
			continue
		}
		fi, err := os.Lstat(filepath.Join(store, e.Name()))
		if err != nil {
			continue
		}
		fmt.Fprintf(&b, "\n  %s %v size=%d links=%d", e.Name(), fi.Mode(), fi.Size(), fi.Sys().(*syscall.Stat_t).Nlink)
		if fi.Mode()&fs.ModeSymlink != 0 {
			fmt.Fprintf(&b, " -> %s", readLink(filepath.Join(store, e.Name())))
		}
	}
	return b.String()
}

// storeUUIDs names the volumes of a store by their metadata files, which
// need not parse.
func storeUUIDs(store string) []string {
	var out []string
	entries, _ := os.ReadDir(store)
	for _, e := range entries {
		if u, ok := strings.CutSuffix(e.Name(), ".json"); ok && !strings.HasPrefix(u, ".") {
			out = append(out, u)
		}
	}
	return out
}

// ---- loop devices ----

// loopState is what the kernel says a loop device is bound to.
type loopState struct {
	name     string // loopN
	backing  string // sysfs backing_file (" (deleted)" when unlinked)
	dev      string // major:minor of the device and its partitions
	parts    []string
	info     unix.LoopInfo64
	readOnly string
	sectors  string // /sys/block/loopN/size
}

func (l loopState) String() string {
	return fmt.Sprintf("file=%s inode=%d offset=%d sizelimit=%d sectors=%s ro=%s flags=%#x tag=%q",
		l.backing, l.info.Inode, l.info.Offset, l.info.Sizelimit, l.sectors, l.readOnly, l.info.Flags, cString(l.info.File_name[:]))
}

func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// loops returns the loop devices bound to files under the case directory
// (other tests on this machine have their own).
func (c *kase) loops() map[string]loopState {
	out := map[string]loopState{}
	names, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range names {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		backing := strings.TrimSpace(string(b))
		if !strings.HasPrefix(backing, c.dir+"/") {
			continue
		}
		name := filepath.Base(filepath.Dir(filepath.Dir(f)))
		sys := filepath.Join("/sys/block", name)
		l := loopState{name: name, backing: backing, dev: sysString(filepath.Join(sys, "dev")), readOnly: sysString(filepath.Join(sys, "ro")), sectors: sysString(filepath.Join(sys, "size"))}
		parts, _ := filepath.Glob(filepath.Join(sys, name+"p*", "dev"))
		for _, p := range parts {
			l.parts = append(l.parts, sysString(p))
		}
		if fd, err := unix.Open("/dev/"+name, unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
			if info, err := unix.IoctlLoopGetStatus64(fd); err == nil {
				l.info = *info
			}
			unix.Close(fd)
		}
		out["/dev/"+name] = l
	}
	return out
}

func sysString(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}

// foreignLoop binds file to a free loop device the way losetup would, not
// through sparsevol: at offset, with sizelimit, read-only or not, with
// tag as lo_file_name (the file's path when empty, as losetup does). It
// returns the device; cleanup detaches it.
func (c *kase) foreignLoop(file string, offset, sizelimit uint64, readOnly bool, tag string) string {
	c.t.Helper()
	if tag == "" {
		tag = file
	}
	mode, flags := unix.O_RDWR, uint32(0)
	if readOnly {
		mode, flags = unix.O_RDONLY, unix.LO_FLAGS_READ_ONLY
	}
	ffd, err := unix.Open(file, mode|unix.O_CLOEXEC, 0)
	if err != nil {
		c.t.Fatal(err)
	}
	defer unix.Close(ffd)
	ctl, err := unix.Open("/dev/loop-control", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		c.t.Fatal(err)
	}
	defer unix.Close(ctl)
	// Other processes on the host (parallel tests, a bench) race for free
	// devices too: retry until a deadline rather than a count.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		n, err := unix.IoctlRetInt(ctl, unix.LOOP_CTL_GET_FREE)
		if err != nil {
			c.t.Fatalf("LOOP_CTL_GET_FREE: %v", err)
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		fd, err := unix.Open(dev, mode|unix.O_CLOEXEC, 0)
		if err != nil {
			time.Sleep(20 * time.Millisecond) // devtmpfs node not there yet
			continue
		}
		cfg := unix.LoopConfig{Fd: uint32(ffd), Info: unix.LoopInfo64{Offset: offset, Sizelimit: sizelimit, Flags: flags}}
		copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], tag)
		err = unix.IoctlLoopConfigure(fd, &cfg)
		unix.Close(fd)
		if errors.Is(err, unix.EBUSY) {
			continue // another process took it between GET_FREE and CONFIGURE
		}
		if err != nil {
			c.t.Fatalf("LOOP_CONFIGURE %s on %s: %v", dev, file, err)
		}
		return dev
	}
	c.t.Fatal("no free loop device for the foreign binding within 10 s")
	return ""
}

// detachLoop unbinds a loop device (LOOP_CLR_FD; the kernel defers it
// while the device is open).
func detachLoop(dev string) error {
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
}

// ---- mounts ----

type mountEntry struct {
	id, dev, point, line string
}

func readMountInfo(t *testing.T) []mountEntry {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []mountEntry
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		out = append(out, mountEntry{id: f[0], dev: f[2], point: fsutil.UnescapeOctal(f[4]), line: line})
	}
	return out
}

// mounts returns the mountinfo lines of mount points under the case
// directory or watched by it, and of mounts of the case's loop devices
// wherever they are.
func (c *kase) mounts(loops map[string]loopState) []string {
	devs := map[string]bool{}
	for _, l := range loops {
		devs[l.dev] = true
		for _, p := range l.parts {
			devs[p] = true
		}
	}
	var out []string
	for _, m := range readMountInfo(c.t) {
		_, watched := c.mountPoints[m.point]
		if watched || m.point == c.dir || strings.HasPrefix(m.point, c.dir+"/") || devs[m.dev] {
			out = append(out, m.line)
		}
	}
	return out
}

// cleanup undoes what the case (or a regression) left: mounts under the
// case directory, of its devices, or new at watched mount points; loop
// devices bound to its files; /dev/sparsevol links of its volumes.
func (c *kase) cleanup() {
	loops := c.loops()
	devs := map[string]bool{}
	for _, l := range loops {
		devs[l.dev] = true
		for _, p := range l.parts {
			devs[p] = true
		}
	}
	for range 4 { // stacked mounts
		var points []string
		for _, m := range readMountInfo(c.t) {
			old, watched := c.mountPoints[m.point]
			if (watched && !slices.Contains(old, m.id)) || strings.HasPrefix(m.point, c.dir+"/") || m.point == c.dir || devs[m.dev] {
				points = append(points, m.point)
			}
		}
		if len(points) == 0 {
			break
		}
		sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
		for _, p := range points {
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				c.t.Logf("cleanup: unmount %s: %v", p, err)
			}
		}
	}
	uuids := slices.Clone(c.uuids)
	for _, st := range c.stores {
		uuids = append(uuids, storeUUIDs(st)...)
	}
	for _, u := range uuids {
		link := filepath.Join(linkDir, u)
		target, err := filepath.EvalSymlinks(link)
		if err != nil {
			if readLink(link) != "absent" {
				os.Remove(link) // dangling
			}
			continue
		}
		for dev := range loops {
			if target == dev || strings.HasPrefix(target, dev+"p") {
				os.Remove(link)
			}
		}
	}
	for dev := range loops {
		if err := detachLoop(dev); err != nil && !errors.Is(err, unix.ENXIO) {
			c.t.Logf("cleanup: detach %s: %v", dev, err)
		}
	}
}
