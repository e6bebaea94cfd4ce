package testutil

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// HostFeaturesEnv lists, comma-separated, the host features a run must
// have (FeatureIOLimits, FeatureSysResource). The VM suite's guest run
// sets it: there a test that finds a feature missing fails, instead of
// passing by the branch written for hosts without it.
const HostFeaturesEnv = "SPARSEVOL_TEST_HOST_HAS"

// Host features a test may find missing.
const (
	// FeatureIOLimits is cgroup v2 with the io controller (io.max).
	FeatureIOLimits = "io-limits"
	// FeatureSysResource is CAP_SYS_RESOURCE, which online ext4 growth
	// needs.
	FeatureSysResource = "sys-resource"
)

// HostLacks reports whether this host lacks feature, which why explains
// (nil: it has it), and logs it. Where HostFeaturesEnv lists feature, a
// missing one fails the test instead.
func HostLacks(t testing.TB, feature string, why error) bool {
	t.Helper()
	if why == nil {
		return false
	}
	if slices.Contains(strings.Split(os.Getenv(HostFeaturesEnv), ","), feature) {
		t.Fatalf("this run must have %s (%s=%s), but: %v", feature, HostFeaturesEnv, os.Getenv(HostFeaturesEnv), why)
	}
	t.Logf("this host lacks %s: %v", feature, why)
	return true
}

// CapSysResource returns nil if CAP_SYS_RESOURCE (bit 24) is in this
// process's effective capabilities, otherwise why not.
func CapSysResource() error {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			var caps uint64
			if _, err := fmt.Sscanf(strings.TrimSpace(v), "%x", &caps); err != nil {
				return fmt.Errorf("CapEff %q: %w", v, err)
			}
			if caps&(1<<24) == 0 {
				return fmt.Errorf("CAP_SYS_RESOURCE (CapEff bit 24) is not in this process's effective set %#x", caps)
			}
			return nil
		}
	}
	return fmt.Errorf("no CapEff in /proc/self/status")
}

// PrivateCgroup2 mounts a cgroup v2 hierarchy of the test's own and names
// a cgroup in it for the test, which nothing has made yet: limits of the
// code under test go there, never to the node's pods' cgroup. At cleanup
// the cgroup is removed and the hierarchy unmounted. cgroup v2 is one
// hierarchy: where the host runs it, this is the host's, with the io
// controller; where io is bound to cgroup v1 blkio (hybrid), it lacks io.
func PrivateCgroup2(t testing.TB) (mount, cgroup string) {
	t.Helper()
	mount = t.TempDir()
	if err := unix.Mount("none", mount, "cgroup2", 0, ""); err != nil {
		t.Fatalf("mount cgroup2 at %s: %v", mount, err)
	}
	t.Cleanup(func() { unix.Unmount(mount, unix.MNT_DETACH) })
	cgroup = "sparsevol-test-" + filepath.Base(t.TempDir())
	t.Cleanup(func() { os.Remove(filepath.Join(mount, cgroup)) })
	return mount, cgroup
}
