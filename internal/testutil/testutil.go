// Package testutil holds helpers shared by the project's tests.
package testutil

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// SkipRootEnv names the variable that lets a non-root developer skip the
// tests that need real loop devices and mounts. CI never sets it.
const SkipRootEnv = "SPARSEVOL_SKIP_ROOT_TESTS"

// RequireRoot fails the test when not running as root, unless SkipRootEnv
// is set to 1, in which case it skips. Failing by default keeps CI honest:
// an integration test that silently skips proves nothing.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv(SkipRootEnv) == "1" {
		t.Skipf("not root and %s=1", SkipRootEnv)
	}
	t.Fatalf("this test needs root (real loop devices and mounts); run as root or set %s=1 to skip", SkipRootEnv)
}

// Losetup binds path with losetup and args, as a tool other than sparsevol
// would, and returns the device. At cleanup the device is detached only if
// it still serves path: tests of other packages run at the same time, and
// a number detached early may serve one of their files by then.
func Losetup(t testing.TB, path string, args ...string) string {
	t.Helper()
	out, err := exec.Command("losetup", append(append([]string{"--find", "--show"}, args...), path)...).Output()
	if err != nil {
		t.Fatalf("losetup %v %s: %v", args, path, err)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { DetachIfServes(dev, path) })
	return dev
}

// DetachIfServes detaches the loop device dev (losetup -d) if sysfs says
// its backing file is path (or path, deleted since); otherwise it leaves
// the device alone. It returns once the device no longer serves path: a
// process of another test that has the device open for a moment (a scan,
// a blkid) makes the kernel defer the detach until it closes the device,
// and a leak check that runs after this one must not see it bound.
func DetachIfServes(dev, path string) {
	if !serves(dev, path) {
		return
	}
	exec.Command("losetup", "-d", dev).Run()
	for deadline := time.Now().Add(5 * time.Second); serves(dev, path) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
}

// serves reports whether sysfs names path (or path, deleted since) as the
// backing file of the loop device dev.
func serves(dev, path string) bool {
	b, err := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/loop/backing_file")
	if err != nil {
		return false
	}
	return strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)") == path
}

// FilesystemDir makes a filesystem of fsType ("xfs" made with reflink=1,
// or "ext4") in a sparse image of size bytes in a temporary directory,
// mounts it through a loop device and returns the mount point, private
// (mode 0700). At cleanup it is unmounted and the device detached; a
// store on it shows whether sparsevol shares extents (xfs) or copies
// (ext4).
func FilesystemDir(t testing.TB, fsType string, size int64) string {
	t.Helper()
	RequireRoot(t)
	dir := t.TempDir()
	img := filepath.Join(dir, "fs.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	mkfs := []string{"mkfs.ext4", "-q", img}
	if fsType == "xfs" {
		mkfs = []string{"mkfs.xfs", "-q", "-m", "reflink=1", img}
	}
	if out, err := exec.Command(mkfs[0], mkfs[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%v: %v: %s", mkfs, err, out)
	}
	dev := Losetup(t, img)
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", dev, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount %s: %v: %s", dev, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", mnt, err, out)
		}
	})
	if err := os.Chmod(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	return mnt
}

// IsMountPoint reports whether something is mounted at dir: dir lies on
// another device than its parent (lstat, links not followed).
func IsMountPoint(t testing.TB, dir string) bool {
	t.Helper()
	var st, parent syscall.Stat_t
	if err := syscall.Lstat(dir, &st); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Lstat(filepath.Dir(dir), &parent); err != nil {
		t.Fatal(err)
	}
	return st.Dev != parent.Dev
}

// LiveSocket listens on the unix socket path (its directory made if
// missing) until the test ends, accepting and closing every connection:
// a socket another process serves. At the end it checks that the socket
// still answers there, and fails the test if it does not.
func LiveSocket(t testing.TB, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	t.Cleanup(func() {
		defer l.Close()
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Errorf("the live socket at %s no longer answers: %v", path, err)
			return
		}
		c.Close()
	})
}
