// Package testutil holds helpers shared by the project's tests.
package testutil

import (
	"os"
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
