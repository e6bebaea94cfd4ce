//go:build e2e

package vm

import (
	"os"
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// TestExportImage builds (or finds in the cache) the base image and writes
// its directory to the file named by SPARSEVOL_E2E_IMAGE_OUT, for test/k8s.
func TestExportImage(t *testing.T) {
	out := os.Getenv("SPARSEVOL_E2E_IMAGE_OUT")
	if out == "" {
		t.Skip("SPARSEVOL_E2E_IMAGE_OUT not set (used by test/k8s)")
	}
	vmrun.RequireHost(t)
	img := vmrun.BaseImage(t, vmrun.LoadConfig(t, 1024))
	if err := os.WriteFile(out, []byte(img.Dir+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}
