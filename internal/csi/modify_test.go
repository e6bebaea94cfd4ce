package csi

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/iolimit"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestModifyRefuses: what a VolumeAttributesClass cannot set, or sets to
// nonsense, is InvalidArgument naming the parameter, and changes nothing.
func TestModifyRefuses(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	thin := e.createVolume(t, "thin", 16<<20, rwCap(volume.ModeFilesystem, "ext4"), nil)
	thick := e.createVolume(t, "thick", 16<<20, rwCap(volume.ModeFilesystem, "ext4"), map[string]string{ParamProvisioning: "thick"})
	block := e.createVolume(t, "blk", 16<<20, rwCap(volume.ModeBlock, ""), nil)
	for _, tc := range []struct {
		name   string
		id     string
		params map[string]string
		code   codes.Code
		names  string // the message names this
	}{
		{"unknown", thin.VolumeId, map[string]string{"XXX_FakeKey": "x"}, codes.InvalidArgument, "XXX_FakeKey"},
		{"fsType is fixed", thin.VolumeId, map[string]string{ParamFSType: "xfs"}, codes.InvalidArgument, ParamFSType},
		{"mkfsOptions are fixed", thin.VolumeId, map[string]string{ParamWriteIOPS: "5", ParamMkfsOptions: "-K"}, codes.InvalidArgument, ParamMkfsOptions},
		{"negative IOPS", thin.VolumeId, map[string]string{ParamReadIOPS: "-1"}, codes.InvalidArgument, ParamReadIOPS},
		{"zero IOPS", thin.VolumeId, map[string]string{ParamWriteIOPS: "0"}, codes.InvalidArgument, ParamWriteIOPS},
		{"IOPS overflow", thin.VolumeId, map[string]string{ParamWriteIOPS: "18446744073709551616"}, codes.InvalidArgument, ParamWriteIOPS},
		{"bytes garbage", thin.VolumeId, map[string]string{ParamWriteBPS: "10 MB/s"}, codes.InvalidArgument, ParamWriteBPS},
		{"bytes overflow", thin.VolumeId, map[string]string{ParamReadBPS: "99999999P"}, codes.InvalidArgument, ParamReadBPS},
		{"bad directIO", thin.VolumeId, map[string]string{ParamDirectIO: "yes please"}, codes.InvalidArgument, ParamDirectIO},
		{"thick to thin", thick.VolumeId, map[string]string{ParamProvisioning: "thin"}, codes.InvalidArgument, ParamProvisioning},
		{"bad provisioning", thin.VolumeId, map[string]string{ParamProvisioning: "fat"}, codes.InvalidArgument, ParamProvisioning},
		{"discard on thick", thick.VolumeId, map[string]string{ParamDiscard: "true"}, codes.InvalidArgument, ParamDiscard},
		{"discard on block", block.VolumeId, map[string]string{ParamDiscard: "true"}, codes.InvalidArgument, ParamDiscard},
		{"discard when made thick", thin.VolumeId, map[string]string{ParamDiscard: "true", ParamProvisioning: "thick"}, codes.InvalidArgument, ParamDiscard},
		{"no id", "", map[string]string{ParamDirectIO: "true"}, codes.InvalidArgument, "volume_id"},
		{"unknown id", volume.NewUUID(), map[string]string{ParamDirectIO: "true"}, codes.NotFound, ""},
		{"not an id", "non-existing-volume-id", nil, codes.NotFound, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before []byte
			if tc.id != "" {
				before, _ = os.ReadFile(filepath.Join(e.store.Root(), tc.id+".json"))
			}
			_, err := e.ctrl.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: tc.id, MutableParameters: tc.params})
			wantCode(t, err, tc.code)
			if !strings.Contains(status.Convert(err).Message(), tc.names) {
				t.Errorf("message %q does not name %q", status.Convert(err).Message(), tc.names)
			}
			if tc.id != "" {
				after, _ := os.ReadFile(filepath.Join(e.store.Root(), tc.id+".json"))
				if string(before) != string(after) {
					t.Errorf("a refused modify changed the metadata")
				}
			}
		})
	}
	t.Run("mutable parameters at create", func(t *testing.T) {
		_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "vac", VolumeCapabilities: []*csi.VolumeCapability{rwCap(volume.ModeBlock, "")},
			MutableParameters: map[string]string{ParamMkfsOptions: "-K"}})
		wantCode(t, err, codes.InvalidArgument)
		resp, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "vac", VolumeCapabilities: []*csi.VolumeCapability{rwCap(volume.ModeBlock, "")},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 8 << 20}, MutableParameters: map[string]string{ParamDirectIO: "true", ParamProvisioning: "thick"}})
		if err != nil {
			t.Fatal(err)
		}
		v, err := e.store.Get(resp.Volume.VolumeId)
		if err != nil || !v.DirectIO || !v.Preallocate {
			t.Errorf("created with a VolumeAttributesClass: %+v, %v; want direct I/O and thick", v, err)
		}
	})
	t.Run("not the driver's volume", func(t *testing.T) {
		v, err := e.store.Create(ctx, volume.CreateRequest{Name: "node-mode", SizeBytes: 8 << 20, Mode: volume.ModeBlock, NoPartition: true})
		if err != nil {
			t.Fatal(err)
		}
		_, err = e.ctrl.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: v.UUID, MutableParameters: map[string]string{ParamDirectIO: "true"}})
		wantCode(t, err, codes.FailedPrecondition)
	})
}

// TestModifyLive changes a staged filesystem volume: discard by remount,
// direct I/O on its device, thin to thick in place; and limits, which a
// host without cgroup v2's io controller refuses with FailedPrecondition.
func TestModifyLive(t *testing.T) {
	e := newTestEnv(t, envOptions{limits: privateLimits(t)})
	ctx := context.Background()
	c := rwCap(volume.ModeFilesystem, "ext4")
	vol := e.createVolume(t, "live", 32<<20, c, nil)
	p := e.stageAndPublish(t, vol.VolumeId, c)
	defer e.teardown(t, p)
	modify := func(params map[string]string) error {
		_, err := e.ctrl.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: vol.VolumeId, MutableParameters: params})
		return err
	}
	discardOn := func() bool {
		infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(p.staging))
		if err != nil || len(infos) != 1 {
			t.Fatalf("mount at %s: %v, %v", p.staging, infos, err)
		}
		return slices.Contains(strings.Split(infos[0].VFSOptions, ","), "discard")
	}
	for _, on := range []string{"true", "false", "true"} {
		if err := modify(map[string]string{ParamDiscard: on}); err != nil {
			t.Fatal(err)
		}
		if got := discardOn(); (on == "true") != got {
			t.Fatalf("discard=%s: the staged filesystem has discard %t", on, got)
		}
	}
	if err := modify(map[string]string{ParamDirectIO: "true"}); err != nil {
		t.Fatal(err)
	}
	st, err := e.store.Status(vol.VolumeId)
	if err != nil || !st.DirectIO || !st.DirectIOActive {
		t.Fatalf("after directIO=true: %+v, %v", st, err)
	}
	if err := modify(map[string]string{ParamDiscard: "false", ParamProvisioning: "thick"}); err != nil {
		t.Fatal(err)
	}
	var sb unix.Stat_t
	if err := unix.Stat(st.BackingFile, &sb); err != nil || sb.Blocks*512 < vol.CapacityBytes {
		t.Fatalf("after thick: %d of %d bytes allocated, %v", sb.Blocks*512, vol.CapacityBytes, err)
	}
	if v, _ := e.store.Get(vol.VolumeId); v.Labels[LabelProvisioning] != "thick" || v.Labels[LabelDiscard] != "" {
		t.Errorf("labels after thick: %v", v.Labels)
	}
	limits := map[string]string{ParamWriteBPS: "10Mi", ParamReadIOPS: "100"}
	err = modify(limits)
	if e.store.CheckLimits(volume.IOLimits{WriteIOPS: 1}) != nil {
		t.Logf("no cgroup v2 io controller here: %v", err)
		wantCode(t, err, codes.FailedPrecondition)
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := e.store.Get(vol.VolumeId); v.IOLimits != (volume.IOLimits{WriteBPS: 10 << 20, ReadIOPS: 100}) {
		t.Errorf("limits after modify: %+v", v.IOLimits)
	}
}

// privateLimits sends I/O limits to a cgroup of the test's own on a
// private cgroup v2 mount (without the io controller where the host binds
// it to cgroup v1 blkio), never to the node's pods' cgroup.
func privateLimits(t *testing.T) iolimit.Config {
	t.Helper()
	m := t.TempDir()
	if err := unix.Mount("none", m, "cgroup2", 0, ""); err != nil {
		t.Fatalf("mount cgroup2: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(m, unix.MNT_DETACH) })
	cfg := iolimit.Config{Mount: m, Cgroup: "sparsevol-test-" + filepath.Base(t.TempDir())}
	t.Cleanup(func() { os.Remove(filepath.Join(m, cfg.Cgroup)) })
	return cfg
}
