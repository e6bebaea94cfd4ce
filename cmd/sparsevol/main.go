// Command sparsevol manages persistent sparse-file volumes behind loop
// devices; `sparsevol csi` serves them to Kubernetes.
package main

import (
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"

	"github.com/sparsevol/sparsevol/internal/cli"
	"github.com/sparsevol/sparsevol/internal/systemd"
)

func main() {
	processDefaults()
	os.Exit(run(os.Args))
}

// processDefaults sets what the whole process shares, here and nowhere
// else:
//
//   - PATH gains the sbin directories where mkfs, blkid, sgdisk and
//     friends live, which minimal environments and some units lack (the
//     external programs are found through PATH, also by mount-utils);
//   - a heap goal of 50% unless GOGC says otherwise: the CLI runs as
//     short-lived processes, by the hundred at boot on small nodes, where
//     a few extra collections cost less than the memory.
func processDefaults() {
	path := os.Getenv("PATH")
	for _, dir := range []string{"/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"} {
		if !strings.Contains(":"+path+":", ":"+dir+":") {
			path += ":" + dir
		}
	}
	os.Setenv("PATH", strings.TrimPrefix(path, ":"))
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(50)
	}
}

func run(argv []string) int {
	args := argv[1:]
	// systemd runs generators by path with three directories; the
	// generator is a link to this binary.
	if filepath.Base(argv[0]) == systemd.GeneratorName {
		args = append([]string{"units", "generate"}, args...)
	}
	return cli.Main(args, os.Stdout, os.Stderr)
}
