// Package testutil holds helpers shared by the project's tests.
package testutil

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
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
// the device alone.
func DetachIfServes(dev, path string) {
	b, err := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/loop/backing_file")
	if err != nil {
		return
	}
	if got := strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)"); got != path {
		return
	}
	exec.Command("losetup", "-d", dev).Run()
}
