package csi

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

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

// lockedBuffer is a bytes.Buffer the plugin's goroutines write and a test
// reads.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestLogLineOfHugeRequestBounded: a call whose name, ids and paths are a
// MiB each, sent over the plugin's socket, is logged in one line of at
// most maxLogLine bytes, the error message of a refusal included.
func TestLogLineOfHugeRequestBounded(t *testing.T) {
	const maxLogLine = 1024
	var logged lockedBuffer
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
