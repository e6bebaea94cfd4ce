// Package vmrun is the VM harness of the end-to-end suites (test/vm,
// test/k8s): a Debian base image built once and cached by its inputs,
// image layers on top of it, a private copy per run with this checkout
// installed from its .deb (dpkg -i), and boots of that copy under
// qemu (software emulation) with a hard reset, a timeout and the console
// captured. A suite is a Timeline of boots and Scenarios, each in one
// file: guest steps with their shell inline, placed in the boots, and a Go
// check (scenario.go). In the guest a driver runs each boot's steps; steps
// record facts, and the checks decide pass or fail from them (see
// guest/lib.sh).
//
// Every setting is an environment variable with the one prefix
// SPARSEVOL_E2E_ (see Env).
package vmrun

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"
	"time"
)

// EnvPrefix is the prefix of every setting of the end-to-end suites.
const EnvPrefix = "SPARSEVOL_E2E_"

// Env returns $SPARSEVOL_E2E_<name>, or def when it is unset or empty.
func Env(name, def string) string {
	if v := os.Getenv(EnvPrefix + name); v != "" {
		return v
	}
	return def
}

// EnvSet reports whether $SPARSEVOL_E2E_<name> is set to something.
func EnvSet(name string) bool { return os.Getenv(EnvPrefix+name) != "" }

// EnvInt returns $SPARSEVOL_E2E_<name> as an integer, or def; a value that
// is not one fails t.
func EnvInt(t testing.TB, name string, def int) int {
	t.Helper()
	v := os.Getenv(EnvPrefix + name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s%s=%q: %v", EnvPrefix, name, v, err)
	}
	return n
}

// DefaultCache is the cache root: $SPARSEVOL_E2E_CACHE or
// /var/cache/sparsevol-e2e. Images and the Kubernetes binaries live under it.
func DefaultCache() string { return Env("CACHE", "/var/cache/sparsevol-e2e") }

// Config holds the settings shared by every suite.
type Config struct {
	Cache       string        // image cache root (CACHE)
	Mirror      string        // Debian mirror for debootstrap (MIRROR)
	Work        string        // run directory; empty: a new one under /var/tmp (WORK)
	Keep        bool          // keep the run directory after a pass (KEEP)
	MemMiB      int           // guest memory (MEM)
	CPUs        int           // guest CPUs (CPUS)
	BootTimeout time.Duration // one boot; 0: 4 min plus the steps' limits (BOOT_TIMEOUT, seconds)
	Repo        string        // repository root, where `make packages` runs
}

// LoadConfig reads the settings; memMiB is the suite's default guest size.
func LoadConfig(t testing.TB, memMiB int) Config {
	t.Helper()
	return Config{
		Cache:       DefaultCache(),
		Mirror:      Env("MIRROR", "http://deb.debian.org/debian"),
		Work:        Env("WORK", ""),
		Keep:        EnvSet("KEEP"),
		MemMiB:      EnvInt(t, "MEM", memMiB),
		CPUs:        EnvInt(t, "CPUS", 2),
		BootTimeout: time.Duration(EnvInt(t, "BOOT_TIMEOUT", 0)) * time.Second,
		Repo:        repoRoot(t),
	}
}

// repoRoot is the module root: three directories above this file.
func repoRoot(t testing.TB) string {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("vmrun: cannot locate the repository")
	}
	root := filepath.Clean(filepath.Join(filepath.Dir(file), "../../.."))
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("vmrun: no go.mod in %s: %v", root, err)
	}
	return root
}

// RequireHost fails t unless the test runs as root with the host tools a
// run needs.
func RequireHost(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("the VM tests need root (debootstrap, loop mounts of the image)")
	}
	var missing []string
	for _, tool := range []string{"qemu-system-x86_64", "debootstrap", "mkfs.ext4", "mount", "umount", "chroot", "make", "cp", "truncate"} {
		if _, err := lookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if len(missing) > 0 {
		t.Fatalf("missing tools: %v (apt-get install qemu-system-x86 debootstrap e2fsprogs make)", missing)
	}
}

// Logf logs to the test and to stdout at once, so figures show in a plain
// `go test` run as well as in -v output.
func Logf(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	t.Log(msg)
	if !testing.Verbose() {
		fmt.Println(msg)
	}
}
