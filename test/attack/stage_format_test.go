package attack

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
)

// NodeStage mounts what is there and never formats: a volume whose device
// no longer probes as its own filesystem (superblock gone, or another
// filesystem UUID) is FailedPrecondition, the message names what was
// found and `blkid -p`, and the backing file keeps every byte.
func TestStageNeverFormats(t *testing.T) {
	zero := func(off, n int64) func(t *testing.T, file string) {
		return func(t *testing.T, file string) {
			f, err := os.OpenFile(file, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if _, err := f.WriteAt(make([]byte, n), off); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, tc := range []struct {
		name   string
		fs     string
		size   int64
		damage func(t *testing.T, file string)
	}{
		{"ext4 superblock zeroed", "ext4", 16 << 20, zero(1024, 1024)},
		{"ext4 with another UUID", "ext4", 16 << 20, func(t *testing.T, file string) {
			// tune2fs -U asks for a freshly checked filesystem once it
			// has been mounted.
			exec.Command("e2fsck", "-fy", file).Run() // exit 1: fixed something, fine
			run(t, "tune2fs", "-U", "6f1c3a52-2f9e-4d7b-9a51-0c7f2d3e4b5a", file)
		}},
		{"xfs superblock zeroed", "xfs", 300 << 20, zero(0, 512)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			id := p.createVolume("pvc-stage-never-formats", tc.size, map[string]string{"fsType": tc.fs})
			staging := p.stagingPath(id)
			if err := p.stageAs(id, staging, tc.fs); err != nil {
				t.Fatalf("setup: NodeStageVolume: %v", err)
			}
			if err := os.WriteFile(filepath.Join(staging, "precious"), []byte("data a pod wrote"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := p.unstage(id, staging); err != nil {
				t.Fatalf("setup: NodeUnstageVolume: %v", err)
			}
			file := p.backingFile(id)
			tc.damage(t, file)
			// Attached before the snapshot (after the damage, so the
			// device's cache is fresh): stage finds the device there and
			// must leave it be.
			c.attach(p.store, id)
			c.watch(file)
			before := c.snapshot()
			err := p.stageAs(id, staging, tc.fs)
			c.expectGRPC(err, codes.FailedPrecondition)
			if err != nil && !strings.Contains(err.Error(), "blkid -p") {
				t.Errorf("the refusal does not say how to inspect the device (blkid -p): %v", err)
			}
			c.unchanged(before)
		})
	}
}
