package csi

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestNodeExpandRefusesBadRange sends NodeExpandVolume capacity ranges no
// size can meet for a published volume: InvalidArgument, and the volume
// keeps its size.
func TestNodeExpandRefusesBadRange(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	c := rwCap(volume.ModeFilesystem, "xfs")
	vol := e.createVolume(t, "expand-range", 300<<20, c, nil)
	p := e.stageAndPublish(t, vol.GetVolumeId(), c)
	defer e.teardown(t, p)
	tests := []struct {
		name string
		cr   *csi.CapacityRange
	}{
		{"negative required", &csi.CapacityRange{RequiredBytes: -1 << 20}},
		{"negative limit", &csi.CapacityRange{LimitBytes: -1 << 20}},
		{"negative both", &csi.CapacityRange{RequiredBytes: -1, LimitBytes: -1}},
		{"required beyond limit", &csi.CapacityRange{RequiredBytes: 400 << 20, LimitBytes: 350 << 20}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{
				VolumeId: p.id, VolumePath: p.target, StagingTargetPath: p.staging, CapacityRange: tc.cr, VolumeCapability: c,
			})
			wantCode(t, err, codes.InvalidArgument)
			if got := volumeSize(t, e, p.id); got != 300<<20 {
				t.Errorf("volume size %d after a refused expand, want %d", got, 300<<20)
			}
		})
	}
}
