// Command sparsevol-csi serves sparsevol's volumes to Kubernetes: the CSI
// plugin, its metrics and kubelet registration. The node's volumes are
// managed with the sparsevol command, built from the same packages.
package main

import (
	"os"

	"github.com/sparsevol/sparsevol/internal/cli"
	"github.com/sparsevol/sparsevol/internal/plugincli"
)

func main() {
	cli.SetProcessDefaults()
	os.Exit(plugincli.Main(os.Args[1:], os.Stdout, os.Stderr))
}
