package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestLeanDependencies: the node binary links none of the CSI plugin's
// stack (it is sparsevol-csi's), nor the man page generator, nor any
// Kubernetes package: every package linked is initialised at every start
// of every node command.
func TestLeanDependencies(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 10 {
		t.Fatalf("go list -deps listed %d packages: %q", len(deps), deps)
	}
	for _, d := range deps {
		for _, heavy := range []string{
			"google.golang.org/grpc", "google.golang.org/protobuf",
			"github.com/container-storage-interface/",
			"github.com/prometheus/",
			"github.com/spf13/cobra/doc", "github.com/russross/blackfriday",
			"k8s.io/",
			"github.com/sparsevol/sparsevol/internal/csi",
			"github.com/sparsevol/sparsevol/internal/kubelet",
			"github.com/sparsevol/sparsevol/internal/plugincli",
		} {
			if d == heavy || strings.HasPrefix(d, strings.TrimSuffix(heavy, "/")+"/") {
				t.Errorf("sparsevol links %s (via %s)", d, heavy)
			}
		}
	}
}

// TestCSIMoved: `sparsevol csi` says where the plugin went and serves
// nothing.
func TestCSIMoved(t *testing.T) {
	r := sparsevol(t, t.TempDir(), nil, "csi", "--endpoint", "unix:///nonexistent/csi.sock", "--node-id", "n")
	if r.code != 2 || !strings.Contains(r.stderr, "sparsevol-csi") {
		t.Errorf("exit %d, stderr %q; want exit 2 naming sparsevol-csi", r.code, r.stderr)
	}
}
