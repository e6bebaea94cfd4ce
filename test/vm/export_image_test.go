//go:build e2e

package vm

import (
	"os"
	"testing"
)

// TestExportImage builds (or finds in the cache) this package's base image
// and writes its directory to the file named by SPARSEVOL_E2E_IMAGE_OUT.
// test/k8s layers its Kubernetes node image on top of it, so both tests
// share one debootstrap and one package list. Skipped unless asked for.
func TestExportImage(t *testing.T) {
	out := os.Getenv("SPARSEVOL_E2E_IMAGE_OUT")
	if out == "" {
		t.Skip("SPARSEVOL_E2E_IMAGE_OUT not set (used by test/k8s)")
	}
	requireHost(t)
	img := buildImage(t, loadConfig(t))
	if err := os.WriteFile(out, []byte(img.Dir+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}
