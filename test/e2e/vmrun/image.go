package vmrun

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Image is a built, cached VM image: an ext4 root filesystem image with the
// kernel and initramfs installed in it, copied out for qemu -kernel/-initrd.
type Image struct {
	Key    string        // hash of every input of the image and its parents
	Dir    string        // cache directory of this key
	Disk   string        // root filesystem image (sparse)
	Kernel string        // vmlinuz
	Initrd string        // initrd.img
	Built  time.Duration // time spent building it (0 when the cache was warm)
}

func imageIn(dir, key string) Image {
	return Image{Key: key, Dir: dir, Disk: filepath.Join(dir, "root.img"),
		Kernel: filepath.Join(dir, "vmlinuz"), Initrd: filepath.Join(dir, "initrd.img")}
}

// The base image: Debian bookworm, minbase, with systemd as PID 1, udev,
// Debian's own kernel and the tools the guest steps of every suite use.
// Its key hashes baseInputs; bump baseRecipe when the build steps in
// buildBase change in a way the inputs do not show.
const baseRecipe = "v2"

type baseInputs struct {
	Suite    string
	Size     string
	Packages []string
	// Modules the initramfs needs to mount the root disk; the full system
	// loads the rest (loop, 9p, xfs) itself. A short list keeps the
	// initramfs small, which software emulation unpacks noticeably faster.
	Initramfs []string
	Files     [][2]string // path in the image, content
	Timers    []string    // timers disabled: periodic jobs have no place in a VM that lives minutes
}

var base = baseInputs{
	Suite: "bookworm",
	Size:  "8G",
	Packages: []string{"systemd", "systemd-sysv", "udev", "util-linux", "e2fsprogs", "xfsprogs",
		"gdisk", "fdisk", "linux-image-amd64", "initramfs-tools", "kmod", "make", "jq"},
	Initramfs: []string{"virtio_pci", "virtio_blk", "ext4"},
	Files: [][2]string{
		{"etc/fstab", "/dev/vda / ext4 rw,errors=remount-ro 0 1\n"},
		{"etc/hostname", "sparsevol-e2e\n"},
		{"etc/hosts", "127.0.0.1 localhost\n127.0.1.1 sparsevol-e2e\n"},
		// Only the modules listed in initramfs-tools/modules (and their
		// dependencies) go into the initramfs.
		{"etc/initramfs-tools/conf.d/e2e.conf", "MODULES=list\n"},
		{"etc/initramfs-tools/modules", "virtio_pci\nvirtio_blk\next4\n"},
	},
	Timers: []string{"apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer", "fstrim.timer"},
}

// Hostname of every image (the Kubernetes node name too).
const Hostname = "sparsevol-e2e"

func hashKey(parts ...any) string {
	h := sha256.New()
	for _, p := range parts {
		fmt.Fprintf(h, "%#v\n", p)
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// BaseKey is the cache key of the base image.
func BaseKey() string { return hashKey(baseRecipe, base) }

// lockCache takes an exclusive flock of <cache>/<name>; builds of one image
// are serialised across processes by it.
func lockCache(cache, name string) (unlock func(), err error) {
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return nil, fmt.Errorf("image cache: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(cache, name), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("image cache lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("image cache lock: %w", err)
	}
	return func() { f.Close() }, nil
}

// cached returns the image of key under dir, building it with build into
// dir.partial first when dir has no "complete" marker. Other entries of
// the same kind (prefix followed by a key) are removed: the cache holds one
// image per kind.
func cached(t testing.TB, cache, prefix, key, what string, build func(dir string) error) Image {
	t.Helper()
	dir := filepath.Join(cache, prefix+key)
	img := imageIn(dir, key)
	unlock, err := lockCache(cache, "."+strings.TrimSuffix(prefix, "-")+"lock")
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	if _, err := os.Stat(filepath.Join(dir, "complete")); err == nil {
		Logf(t, "image %s: cached %s", what, dir)
		prune(t, cache, prefix, dir)
		return img
	}
	start := time.Now()
	Logf(t, "image %s: building %s", what, dir)
	tmp := dir + ".partial"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		t.Fatalf("image %s: %v", what, err)
	}
	if err := build(tmp); err != nil {
		t.Fatalf("image %s: %v (partial build kept in %s)", what, err, tmp)
	}
	manifest := fmt.Sprintf("key %s\nimage %s\nbuilt %s in %s\n", key, what,
		time.Now().UTC().Format(time.RFC3339), time.Since(start).Round(time.Second))
	if err := os.WriteFile(filepath.Join(tmp, "complete"), []byte(manifest), 0o644); err != nil {
		t.Fatalf("image %s: %v", what, err)
	}
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		t.Fatalf("image %s: %v", what, err)
	}
	img.Built = time.Since(start)
	Logf(t, "image %s: built in %s", what, img.Built.Round(time.Second))
	prune(t, cache, prefix, dir)
	return img
}

// prune removes the cache entries <prefix><16 hex digits>[.partial] other
// than keep.
func prune(t testing.TB, cache, prefix, keep string) {
	entries, err := os.ReadDir(cache)
	if err != nil {
		return
	}
	for _, e := range entries {
		name := strings.TrimSuffix(e.Name(), ".partial")
		key, ok := strings.CutPrefix(name, prefix)
		if !e.IsDir() || !ok || filepath.Join(cache, e.Name()) == keep || len(key) != 16 || strings.Trim(key, "0123456789abcdef") != "" {
			continue
		}
		Logf(t, "image: removing old cache entry %s", e.Name())
		os.RemoveAll(filepath.Join(cache, e.Name()))
	}
}

// BaseImage returns the cached base image, building it first when missing.
func BaseImage(t testing.TB, cfg Config) Image {
	t.Helper()
	return cached(t, cfg.Cache, "", BaseKey(), "base", func(dir string) error { return buildBase(t, cfg, dir) })
}

// builder runs the commands of one image build with their output in
// <dir>/build.log.
type builder struct {
	t       testing.TB
	log     io.Writer
	logPath string
}

func newBuilder(t testing.TB, dir string) (*builder, func(), error) {
	logPath := filepath.Join(dir, "build.log")
	f, err := os.Create(logPath)
	if err != nil {
		return nil, nil, err
	}
	return &builder{t: t, log: f, logPath: logPath}, func() { f.Close() }, nil
}

func (b *builder) run(what, name string, args ...string) error {
	t0 := time.Now()
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = b.log, b.log
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C")
	fmt.Fprintf(b.log, "+ %s %s\n", name, strings.Join(args, " "))
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %s: %v; last lines of %s:\n%s", what, name, err, b.logPath, TailFile(b.logPath, 30))
	}
	Logf(b.t, "image: %s: %s", what, time.Since(t0).Round(100*time.Millisecond))
	return nil
}

func buildBase(t testing.TB, cfg Config, dir string) error {
	b, done, err := newBuilder(t, dir)
	if err != nil {
		return err
	}
	defer done()
	rootfs := filepath.Join(dir, "rootfs")
	if err := b.run("debootstrap", "debootstrap", "--variant=minbase",
		"--include="+strings.Join(base.Packages, ","), base.Suite, rootfs, cfg.Mirror); err != nil {
		return err
	}
	for _, f := range base.Files {
		if err := WriteFile(filepath.Join(rootfs, f[0]), []byte(f[1]), 0o644); err != nil {
			return err
		}
	}
	// Boot to multi-user.target; nothing graphical is installed anyway.
	def := filepath.Join(rootfs, "etc/systemd/system/default.target")
	os.Remove(def)
	if err := os.Symlink("/lib/systemd/system/multi-user.target", def); err != nil {
		return err
	}
	for _, timer := range base.Timers {
		os.Remove(filepath.Join(rootfs, "etc/systemd/system/timers.target.wants", timer))
	}
	if err := b.run("initramfs", "chroot", rootfs, "update-initramfs", "-u", "-k", "all"); err != nil {
		return err
	}
	debs, _ := filepath.Glob(filepath.Join(rootfs, "var/cache/apt/archives/*.deb"))
	for _, d := range debs {
		os.Remove(d)
	}
	if err := copyKernel(rootfs, dir); err != nil {
		return err
	}
	disk := filepath.Join(dir, "root.img")
	if err := b.run("truncate", "truncate", "-s", base.Size, disk); err != nil {
		return err
	}
	if err := b.run("mkfs.ext4 -d", "mkfs.ext4", "-q", "-F", "-L", "e2e-root", "-d", rootfs, disk); err != nil {
		return err
	}
	return os.RemoveAll(rootfs)
}

// copyKernel copies the one installed kernel and initramfs of root to dir.
func copyKernel(root, dir string) error {
	for _, k := range []struct{ glob, dst string }{{"boot/vmlinuz-*", "vmlinuz"}, {"boot/initrd.img-*", "initrd.img"}} {
		m, _ := filepath.Glob(filepath.Join(root, k.glob))
		if len(m) != 1 {
			return fmt.Errorf("expected one %s in the image, found %v", k.glob, m)
		}
		if err := CopyFile(m[0], filepath.Join(dir, k.dst), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// Layer is an image made from another: its disk copied, Debian packages
// installed with apt in a chroot of it, then Customize run on the mounted
// copy. Its key hashes the parent's key, Name, Recipe and Packages: bump
// Recipe when Customize changes.
type Layer struct {
	Name      string // cache directory <cache>/<Name>-<key>
	Recipe    string
	Packages  []string
	Customize func(root string, log io.Writer) error
}

// Layer returns the cached image of l on top of img, building it first when
// missing.
func (img Image) Layer(t testing.TB, cfg Config, l Layer) Image {
	t.Helper()
	return cached(t, cfg.Cache, l.Name+"-", layerKey(img.Key, l), l.Name, func(dir string) error { return buildLayer(t, img, l, dir) })
}

// layerKey hashes the parent's key and the layer's declared inputs.
func layerKey(parent string, l Layer) string { return hashKey(parent, l.Name, l.Recipe, l.Packages) }

func buildLayer(t testing.TB, parent Image, l Layer, dir string) (err error) {
	b, done, err := newBuilder(t, dir)
	if err != nil {
		return err
	}
	defer done()
	disk := filepath.Join(dir, "root.img")
	if err := b.run("copy "+parent.Dir, "cp", "--sparse=always", parent.Disk, disk); err != nil {
		return err
	}
	mnt := filepath.Join(dir, "mnt")
	unmount, err := MountImage(disk, mnt, true)
	if err != nil {
		return err
	}
	defer func() {
		if uerr := unmount(); err == nil {
			err = uerr
		}
	}()
	if len(l.Packages) > 0 {
		// No service may start inside the chroot; apt resolves names with
		// the host's resolver configuration.
		policy := filepath.Join(mnt, "usr/sbin/policy-rc.d")
		if err := os.WriteFile(policy, []byte("#!/bin/sh\nexit 101\n"), 0o755); err != nil {
			return err
		}
		resolv := filepath.Join(mnt, "etc/resolv.conf")
		oldResolv, _ := os.ReadFile(resolv)
		if b, err := os.ReadFile("/etc/resolv.conf"); err == nil {
			WriteFile(resolv, b, 0o644)
		}
		if err := b.run("apt-get update", "chroot", mnt, "apt-get", "update", "-q"); err != nil {
			return err
		}
		args := append([]string{mnt, "apt-get", "install", "-y", "-q", "--no-install-recommends"}, l.Packages...)
		if err := b.run("apt-get install", "chroot", args...); err != nil {
			return err
		}
		b.run("apt-get clean", "chroot", mnt, "apt-get", "clean")
		os.RemoveAll(filepath.Join(mnt, "var/lib/apt/lists"))
		os.MkdirAll(filepath.Join(mnt, "var/lib/apt/lists/partial"), 0o755)
		os.Remove(policy)
		WriteFile(resolv, oldResolv, 0o644)
	}
	if l.Customize != nil {
		if err := l.Customize(mnt, b.log); err != nil {
			return fmt.Errorf("%s: %w", l.Name, err)
		}
	}
	return copyKernel(mnt, dir)
}

// MountImage loop-mounts a root filesystem image on mnt; with chroot, the
// host's /dev, /dev/pts, /proc and /sys are mounted inside it too, for
// commands run with chroot(8). unmount undoes all of it.
func MountImage(disk, mnt string, chroot bool) (unmount func() error, err error) {
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return nil, err
	}
	if err := RunCmd("mount", "-o", "loop", disk, mnt); err != nil {
		return nil, err
	}
	undo := []func() error{func() error { return RunCmd("umount", mnt) }}
	unmount = func() error {
		var first error
		for i := len(undo) - 1; i >= 0; i-- {
			if err := undo[i](); err != nil && first == nil {
				first = err
			}
		}
		return first
	}
	if !chroot {
		return unmount, nil
	}
	for _, m := range [][]string{
		{"--bind", "/dev", "dev"}, {"--bind", "/dev/pts", "dev/pts"}, {"-t", "proc", "proc", "proc"}, {"-t", "sysfs", "sysfs", "sys"},
	} {
		target := filepath.Join(mnt, m[len(m)-1])
		os.MkdirAll(target, 0o755)
		args := append(append([]string{}, m[:len(m)-1]...), target)
		if err := RunCmd("mount", args...); err != nil {
			unmount()
			return nil, err
		}
		undo = append(undo, func() error { return RunCmd("umount", "-l", target) })
	}
	return unmount, nil
}

// chrootOutput runs a command in a chroot and returns its standard output.
func ChrootOutput(root string, log io.Writer, name string, args ...string) ([]byte, error) {
	var out bytes.Buffer
	cmd := exec.Command("chroot", append([]string{root, name}, args...)...)
	cmd.Stdout, cmd.Stderr = &out, log
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("chroot %s %s: %w", name, strings.Join(args, " "), err)
	}
	return out.Bytes(), nil
}
