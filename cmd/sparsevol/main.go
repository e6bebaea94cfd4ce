// Command sparsevol manages persistent sparse-file volumes behind loop
// devices; `sparsevol csi` serves them to Kubernetes.
package main

import (
	"os"

	"github.com/sparsevol/sparsevol/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
}
