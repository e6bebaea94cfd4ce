package testutil

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestDetachIfServesWaitsForOpeners holds the device open, as a scan by a
// test of another package would, while DetachIfServes runs: it must not
// return while the device still serves the file.
func TestDetachIfServesWaitsForOpeners(t *testing.T) {
	RequireRoot(t)
	path := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	dev := Losetup(t, path)
	f, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		f.Close()
	}()
	DetachIfServes(dev, path)
	if serves(dev, path) {
		t.Fatalf("DetachIfServes returned while %s still serves %s", dev, path)
	}
}
