package csi

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestLogAttrsBounded: every field logAttrs logs is a client's string, and
// each is logged as volume.Clip shows it (ASCII, its first 64 bytes), so
// that megabytes in a request are never megabytes in a log line.
func TestLogAttrsBounded(t *testing.T) {
	huge := strings.Repeat("x", 1<<20)
	hostile := "\u202eevil\n" + huge
	tests := []struct {
		req  any
		want string
	}{
		{&csi.CreateVolumeRequest{Name: huge}, "name=" + volume.Clip(huge)},
		{&csi.DeleteVolumeRequest{VolumeId: hostile}, "volume_id=" + volume.Clip(hostile)},
		{&csi.NodeStageVolumeRequest{VolumeId: huge, StagingTargetPath: hostile},
			"volume_id=" + volume.Clip(huge) + " staging_target_path=" + volume.Clip(hostile)},
		{&csi.NodePublishVolumeRequest{VolumeId: huge, StagingTargetPath: huge, TargetPath: hostile},
			"volume_id=" + volume.Clip(huge) + " staging_target_path=" + volume.Clip(huge) + " target_path=" + volume.Clip(hostile)},
		{&csi.NodeGetVolumeStatsRequest{VolumeId: huge, VolumePath: hostile, StagingTargetPath: huge},
			"volume_id=" + volume.Clip(huge) + " staging_target_path=" + volume.Clip(huge) + " volume_path=" + volume.Clip(hostile)},
		{&csi.CreateSnapshotRequest{Name: hostile, SourceVolumeId: huge}, "name=" + volume.Clip(hostile) + " source_volume_id=" + volume.Clip(huge)},
		{&csi.DeleteSnapshotRequest{SnapshotId: huge}, "snapshot_id=" + volume.Clip(huge)},
		{&csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: hostile}, "group_snapshot_id=" + volume.Clip(hostile)},
	}
	for _, tc := range tests {
		if got := loggedAttrs(tc.req); got != tc.want {
			t.Errorf("%T: logged %.300q (%d bytes), want %q", tc.req, got, len(got), tc.want)
		}
	}
}

// TestLogLineOfHugeRequestBounded: a call whose name, ids and paths are a
// MiB each, sent over the plugin's socket, is logged in one line of at
// most maxLogLine bytes, the error message of a refusal included.
func TestLogLineOfHugeRequestBounded(t *testing.T) {
	const maxLogLine = 1024
	var logged testutil.SyncBuffer
	e := newTestEnv(t, envOptions{log: &logged})
	ctx := context.Background()
	huge := strings.Repeat("x", 1<<20)
	fs := rwCap(volume.ModeFilesystem, "ext4")
	tests := []struct {
		method string
		call   func() error
	}{
		{"CreateVolume", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: huge, VolumeCapabilities: []*csi.VolumeCapability{fs}})
			return err
		}},
		{"DeleteVolume", func() error {
			_, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: huge})
			return err
		}},
		{"NodeStageVolume", func() error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: huge, StagingTargetPath: "/" + huge, VolumeCapability: fs})
			return err
		}},
		{"NodePublishVolume", func() error {
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: huge, StagingTargetPath: "/" + huge, TargetPath: "/" + huge, VolumeCapability: fs})
			return err
		}},
		{"NodeGetVolumeStats", func() error {
			_, err := e.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: huge, VolumePath: "/" + huge})
			return err
		}},
		{"CreateSnapshot", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: huge, SourceVolumeId: huge})
			return err
		}},
	}
	for _, tc := range tests {
		t.Run(tc.method, func(t *testing.T) {
			tc.call()
			var line string
			for _, l := range strings.Split(logged.String(), "\n") {
				if strings.Contains(l, "method="+tc.method+" ") {
					line = l
				}
			}
			if line == "" {
				t.Fatalf("no log line of %s", tc.method)
			}
			if len(line) > maxLogLine {
				t.Errorf("%s logged a line of %d bytes, at most %d wanted: %.300s", tc.method, len(line), maxLogLine, line)
			}
		})
	}
}

// TestListenMetrics: the metrics address is host:port with a numeric port;
// any other form is ErrInvalid and nothing is opened.
func TestListenMetrics(t *testing.T) {
	tests := []struct {
		addr string
		ok   bool
	}{
		{"127.0.0.1:0", true},
		{"localhost:0", true},
		{"[::1]:0", true},
		{"", false},
		{"9809", false},
		{":", false},
		{":metrics", false},
		{":65536", false},
		{":-1", false},
		{"127.0.0.1:0\n--x", false},
	}
	for _, tc := range tests {
		l, err := ListenMetrics(tc.addr)
		if l != nil {
			l.Close()
		}
		// A host without IPv6 cannot listen on [::1], but must still
		// take the address's form.
		if tc.ok && err != nil && (errors.Is(err, volume.ErrInvalid) || !strings.Contains(tc.addr, "::1")) {
			t.Errorf("ListenMetrics(%q): %v", tc.addr, err)
		}
		if !tc.ok && (!errors.Is(err, volume.ErrInvalid) || !strings.Contains(err.Error(), "metrics address")) {
			t.Errorf("ListenMetrics(%q): %v, want ErrInvalid naming the metrics address", tc.addr, err)
		}
	}
}

// TestServerBounds: the CSI socket refuses a request message beyond
// maxRequestBytes with ResourceExhausted and headers beyond
// maxHeaderBytes, before the driver sees either, while the largest
// requests the sidecars send (a group snapshot of many volumes, a
// CreateVolume whose topology names every node of a large cluster) and
// the headers they send reach it.
func TestServerBounds(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	fs := rwCap(volume.ModeFilesystem, "ext4")
	const tooLarge = "grpc: received message larger than max"
	manyNodes := make([]*csi.Topology, 10000)
	for i := range manyNodes {
		manyNodes[i] = &csi.Topology{Segments: map[string]string{TopologyKey: fmt.Sprintf("node-%05d.pool-a.region-1.example.com", i)}}
	}
	manyIDs := make([]string, 20000)
	for i := range manyIDs {
		manyIDs[i] = fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
	}
	tests := []struct {
		name    string
		call    func() error
		refused bool
	}{
		{"request beyond the bound", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: strings.Repeat("x", maxRequestBytes), VolumeCapabilities: []*csi.VolumeCapability{fs}})
			return err
		}, true},
		{"headers beyond the bound", func() error {
			hctx := metadata.AppendToOutgoingContext(ctx, "x-pad", strings.Repeat("x", maxHeaderBytes))
			_, err := e.ident.Probe(hctx, &csi.ProbeRequest{})
			return err
		}, true},
		{"topology of 10000 nodes, twice", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-big-topology", VolumeCapabilities: []*csi.VolumeCapability{fs},
				CapacityRange:             &csi.CapacityRange{RequiredBytes: 16 << 20},
				AccessibilityRequirements: &csi.TopologyRequirement{Requisite: manyNodes, Preferred: manyNodes}})
			return err
		}, false},
		{"group snapshot of 20000 volumes", func() error {
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "group", SourceVolumeIds: manyIDs})
			return err
		}, false},
		{"headers of a sidecar", func() error {
			hctx := metadata.AppendToOutgoingContext(ctx, "x-pad", strings.Repeat("x", 4<<10))
			_, err := e.ident.Probe(hctx, &csi.ProbeRequest{})
			return err
		}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := e.calls()
			err := tc.call()
			reached := e.calls() > before
			switch {
			case tc.refused && (err == nil || reached):
				t.Errorf("reached the driver: %v; want it refused by the server", err)
			case tc.refused && strings.Contains(tc.name, "request") && (status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), tooLarge)):
				t.Errorf("err = %.200v; want ResourceExhausted, %q", err, tooLarge)
			case !tc.refused && !reached:
				t.Errorf("never reached the driver: %.200v", err)
			}
		})
	}
}
