package csi

import (
	"context"
	"crypto/sha256"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestStageNeverFormats damages the superblock of an unstaged volume and
// stages it again: the node refuses with FailedPrecondition, says what it
// found and how to look, and the backing file stays byte for byte as it was.
func TestStageNeverFormats(t *testing.T) {
	e := newTestEnv(t)
	tests := []struct {
		fsType string
		size   int64
		zeroAt int64 // where 1 KiB of zeros land in the backing file
	}{
		{"ext4", 32 << 20, 1 << 10}, // the primary superblock
		{"xfs", 300 << 20, 0},       // the XFS superblock
	}
	for _, tc := range tests {
		t.Run(tc.fsType, func(t *testing.T) {
			ctx := context.Background()
			c := rwCap(volume.ModeFilesystem, tc.fsType)
			vol := e.createVolume(t, "noformat-"+tc.fsType, tc.size, c, nil)
			p := e.stageAndPublish(t, vol.GetVolumeId(), c)
			writeData(t, volume.ModeFilesystem, p.target, []byte("precious"))
			if _, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: p.id, TargetPath: p.target}); err != nil {
				t.Fatal(err)
			}
			unstage := func() {
				t.Helper()
				if _, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: p.id, StagingTargetPath: p.staging}); err != nil {
					t.Fatal(err)
				}
			}
			unstage()

			backing := filepath.Join(e.store.Root(), p.id)
			zeroRange(t, backing, tc.zeroAt, 1<<10)
			before := fileSum(t, backing)

			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: p.id, StagingTargetPath: p.staging, VolumeCapability: c})
			unstage() // detach whatever the refused stage attached
			if status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("stage of a volume with a damaged superblock: got %v, want FailedPrecondition", err)
			}
			if msg := status.Convert(err).Message(); !strings.Contains(msg, "blkid -p") || !strings.Contains(msg, "nothing blkid recognises") {
				t.Errorf("message %q does not say what was found and how to inspect it", msg)
			}
			if after := fileSum(t, backing); after != before {
				t.Errorf("backing file changed by the refused stage: sha256 %x, was %x", after, before)
			}
			if n := mountCount(t, p.staging); n != 0 {
				t.Errorf("%d mounts at the staging path after the refused stage", n)
			}
			if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: p.id}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// zeroRange overwrites n bytes of path at off with zeros.
func zeroRange(t testing.TB, path string, off, n int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(make([]byte, n), off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// fileSum is the sha256 of path's content.
func fileSum(t testing.TB, path string) [sha256.Size]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum
}
