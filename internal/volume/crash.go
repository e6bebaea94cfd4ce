//go:build crashtest

package volume

import (
	"os"
	"syscall"
)

// CrashEnv names the failure-injection hook of the crash-safety tests:
// when it equals a step name, the process kills itself with SIGKILL at that
// step, exactly as a power cut or OOM kill would stop it. Only binaries
// built with -tags crashtest have it.
const CrashEnv = "SPARSEVOL_TEST_CRASH_AT"

func crashPoint(step string) {
	if v := os.Getenv(CrashEnv); v != "" && v == step {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // never returns
	}
}
