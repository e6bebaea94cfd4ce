package attack

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
)

// NodeStage mounts what is there and never formats: a volume whose device
// no longer probes as its own filesystem is FailedPrecondition, the
// message names what was found and `blkid -p`, and the backing file keeps
// every byte.
func TestStageNeverFormats(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	p := c.startPlugin("022")
	id := p.createVolume("pvc-stage-never-formats", 16<<20, nil)
	staging := p.mustStage(id)
	if err := os.WriteFile(filepath.Join(staging, "precious"), []byte("data a pod wrote"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := p.unstage(id, staging); err != nil {
		t.Fatalf("setup: NodeUnstageVolume: %v", err)
	}
	// Zero the primary superblock: blkid no longer sees ext4.
	file := p.backingFile(id)
	f, err := os.OpenFile(file, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(make([]byte, 1024), 1024); err != nil {
		t.Fatal(err)
	}
	f.Close()
	// Attached before the snapshot (after the damage, so the device's
	// cache is fresh): stage finds the device there and must leave it be.
	c.attach(p.store, id)
	c.watch(file)
	before := c.snapshot()
	err = p.stage(id, staging)
	c.expectGRPC(err, codes.FailedPrecondition)
	if err != nil && !strings.Contains(err.Error(), "blkid -p") {
		t.Errorf("the refusal does not say how to inspect the device (blkid -p): %v", err)
	}
	c.unchanged(before)
}
