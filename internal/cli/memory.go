package cli

import (
	"os"
	"runtime/debug"
)

// The CLI runs as short-lived processes, by the hundred at boot (one per
// unit, or one attach --all over every volume), where a smaller heap goal
// costs a few extra collections and saves memory on small nodes. GOGC in
// the environment still wins.
func init() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(50)
	}
}
