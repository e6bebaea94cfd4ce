// Command sparsevol manages persistent sparse-file volumes behind loop
// devices: the node command line and what its systemd units run.
// sparsevol-csi serves the volumes to Kubernetes.
package main

import (
	"os"
	"path/filepath"

	"github.com/sparsevol/sparsevol/internal/cli"
	"github.com/sparsevol/sparsevol/internal/systemd"
)

func main() {
	cli.SetProcessDefaults()
	os.Exit(run(os.Args))
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
