//go:build e2e

package vm

import (
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The base image: Debian bookworm, minbase, with systemd as PID 1, udev,
// Debian's own kernel and the tools the guest steps use. It is built once and
// cached under $SPARSEVOL_E2E_CACHE/<key>/, where key hashes the package list
// and this file (the build recipe), so changing either builds a new image.

const (
	suite       = "bookworm"
	imageSize   = "8G"
	imageRecipe = "v1"
)

var imagePackages = []string{
	"systemd", "systemd-sysv", "udev", "util-linux", "e2fsprogs", "xfsprogs",
	"gdisk", "fdisk", "linux-image-amd64", "initramfs-tools", "kmod", "make",
	"jq",
}

// Modules the initramfs needs to mount the root disk; the full system loads
// the rest (loop, 9p, xfs) itself. A short list keeps the initramfs at a few
// MiB instead of ~35 MiB, which software emulation unpacks noticeably slower.
var initramfsModules = []string{"virtio_pci", "virtio_blk", "ext4"}

//go:embed image_test.go
var recipeSource []byte

// image is a built, cached base image.
type image struct {
	Dir    string // cache directory of this key
	Disk   string // ext4 root filesystem image (sparse)
	Kernel string
	Initrd string
	Built  time.Duration // time spent building (0 when the cache was warm)
}

func imageKey() string {
	h := sha256.New()
	fmt.Fprintf(h, "recipe %s\nsuite %s\nsize %s\n", imageRecipe, suite, imageSize)
	fmt.Fprintf(h, "packages %s\n", strings.Join(imagePackages, ","))
	fmt.Fprintf(h, "initramfs %s\n", strings.Join(initramfsModules, ","))
	h.Write(recipeSource)
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// buildImage returns the cached image for the current key, building it first
// if it is missing. Builds are serialised by a lock file in the cache root.
func buildImage(t *testing.T, cfg config) image {
	t.Helper()
	key := imageKey()
	dir := filepath.Join(cfg.cache, key)
	img := image{
		Dir:    dir,
		Disk:   filepath.Join(dir, "root.img"),
		Kernel: filepath.Join(dir, "vmlinuz"),
		Initrd: filepath.Join(dir, "initrd.img"),
	}
	if err := os.MkdirAll(cfg.cache, 0o755); err != nil {
		t.Fatalf("image cache: %v", err)
	}
	lock, err := os.OpenFile(filepath.Join(cfg.cache, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatalf("image cache lock: %v", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatalf("image cache lock: %v", err)
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)

	if _, err := os.Stat(filepath.Join(dir, "complete")); err == nil {
		logf(t, "image: cached %s", dir)
		return img
	}
	start := time.Now()
	logf(t, "image: building %s (debootstrap %s from %s, packages %s)", dir, suite, cfg.mirror, strings.Join(imagePackages, " "))
	tmp := dir + ".partial"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		t.Fatalf("image: %v", err)
	}
	if err := buildInto(t, cfg, tmp); err != nil {
		t.Fatalf("image: %v (partial build kept in %s)", err, tmp)
	}
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		t.Fatalf("image: %v", err)
	}
	img.Built = time.Since(start)
	logf(t, "image: built in %s", img.Built.Round(time.Second))
	return img
}

func buildInto(t *testing.T, cfg config, dir string) error {
	rootfs := filepath.Join(dir, "rootfs")
	logPath := filepath.Join(dir, "build.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	step := func(what string, name string, args ...string) error {
		t0 := time.Now()
		cmd := exec.Command(name, args...)
		cmd.Stdout = logFile
		cmd.Stderr = logFile
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C")
		fmt.Fprintf(logFile, "+ %s %s\n", name, strings.Join(args, " "))
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s: %s: %v; last lines of %s:\n%s", what, name, err, logPath, tailFile(logPath, 30))
		}
		logf(t, "image: %s: %s", what, time.Since(t0).Round(100*time.Millisecond))
		return nil
	}

	if err := step("debootstrap", "debootstrap", "--variant=minbase",
		"--include="+strings.Join(imagePackages, ","), suite, rootfs, cfg.mirror); err != nil {
		return err
	}

	// Configuration of the guest system.
	files := map[string]string{
		"etc/fstab":    "/dev/vda / ext4 rw,errors=remount-ro 0 1\n",
		"etc/hostname": "sparsevol-e2e\n",
		"etc/hosts":    "127.0.0.1 localhost\n127.0.1.1 sparsevol-e2e\n",
		// Only the modules listed in initramfs-tools/modules (and their
		// dependencies) go into the initramfs.
		"etc/initramfs-tools/conf.d/e2e.conf": "MODULES=list\n",
		"etc/initramfs-tools/modules":         strings.Join(initramfsModules, "\n") + "\n",
	}
	for name, content := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(rootfs, name)), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(rootfs, name), []byte(content), 0o644); err != nil {
			return err
		}
	}
	// Boot to multi-user.target; nothing graphical is installed anyway.
	def := filepath.Join(rootfs, "etc/systemd/system/default.target")
	os.Remove(def)
	if err := os.Symlink("/lib/systemd/system/multi-user.target", def); err != nil {
		return err
	}
	// Periodic jobs have no place in a test VM that lives a minute.
	for _, timer := range []string{"apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer", "fstrim.timer"} {
		os.Remove(filepath.Join(rootfs, "etc/systemd/system/timers.target.wants", timer))
	}
	if err := step("initramfs", "chroot", rootfs, "update-initramfs", "-u", "-k", "all"); err != nil {
		return err
	}
	// Downloaded packages are not needed in the image.
	debs, _ := filepath.Glob(filepath.Join(rootfs, "var/cache/apt/archives/*.deb"))
	for _, d := range debs {
		os.Remove(d)
	}

	for _, k := range []struct{ glob, dst string }{
		{"boot/vmlinuz-*", "vmlinuz"},
		{"boot/initrd.img-*", "initrd.img"},
	} {
		m, _ := filepath.Glob(filepath.Join(rootfs, k.glob))
		if len(m) != 1 {
			return fmt.Errorf("expected one %s in the image, found %v", k.glob, m)
		}
		if err := copyFile(m[0], filepath.Join(dir, k.dst)); err != nil {
			return err
		}
	}

	disk := filepath.Join(dir, "root.img")
	if err := step("truncate", "truncate", "-s", imageSize, disk); err != nil {
		return err
	}
	if err := step("mkfs.ext4 -d", "mkfs.ext4", "-q", "-F", "-L", "e2e-root", "-d", rootfs, disk); err != nil {
		return err
	}
	if err := os.RemoveAll(rootfs); err != nil {
		return err
	}
	manifest := fmt.Sprintf("key %s\nsuite %s\npackages %s\nbuilt %s\n", imageKey(), suite,
		strings.Join(imagePackages, " "), time.Now().UTC().Format(time.RFC3339))
	return os.WriteFile(filepath.Join(dir, "complete"), []byte(manifest), 0o644)
}

func copyFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o644)
}
