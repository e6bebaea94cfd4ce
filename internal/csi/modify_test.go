package csi

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/iolimit"
	"github.com/sparsevol/sparsevol/internal/testutil"
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
	if testutil.HostLacks(t, testutil.FeatureIOLimits, e.store.CheckLimits(volume.IOLimits{WriteIOPS: 1})) {
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
	m, cg := testutil.PrivateCgroup2(t)
	return iolimit.Config{Mount: m, Cgroup: cg}
}

// TestModifyDiscardOnlyItsOwn changes discard of a staged volume whose
// staging path has someone else's ext4 (its own loop device) mounted over
// it, and of a staged XFS, which keeps discard while mounted. The foreign
// filesystem is never reconfigured; the volume's takes the setting through
// a mount of its own (its publish bind) or, having none on top, the call is
// refused; and a refused change is not recorded.
func TestModifyDiscardOnlyItsOwn(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		fs      string
		publish bool // besides staging, so the volume has a mount on top
		foreign bool // an ext4 of its own mounted over the staging path
		code    codes.Code
	}{
		{"foreign over staging", "ext4", false, true, codes.FailedPrecondition},
		{"foreign over staging and published", "ext4", true, true, codes.OK},
		{"xfs keeps it while mounted", "xfs", true, false, codes.FailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := rwCap(volume.ModeFilesystem, tc.fs)
			vol := e.createVolume(t, "discard-"+strings.ReplaceAll(tc.name, " ", "-"), 300<<20, c, nil)
			id := vol.GetVolumeId()
			p := published{id: id, c: c, staging: filepath.Join(e.kubelet, "staging-"+id), target: filepath.Join(e.kubelet, "pods", id, "target")}
			t.Cleanup(func() { e.teardown(t, p) })
			if _, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: p.staging, VolumeCapability: c}); err != nil {
				t.Fatal(err)
			}
			if tc.publish {
				e.publish(t, p)
			}
			st, err := e.store.Status(id)
			if err != nil {
				t.Fatal(err)
			}
			foreign := ""
			if tc.foreign {
				foreign = mountForeignExt4(t, p.staging)
			}
			meta := filepath.Join(e.store.Root(), id+".json")
			before, err := os.ReadFile(meta)
			if err != nil {
				t.Fatal(err)
			}
			_, err = e.ctrl.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: id, MutableParameters: map[string]string{ParamDiscard: "true"}})
			if status.Code(err) != tc.code {
				t.Errorf("got %v, want code %s", err, tc.code) // and see what else it did
			}
			if foreign != "" && superOption(t, foreign, "discard") {
				t.Errorf("the foreign filesystem over the staging path was given discard")
			}
			if got := superOption(t, st.DataDevice, "discard"); got != (tc.code == codes.OK) {
				t.Errorf("the volume's filesystem has discard %t", got)
			}
			after, _ := os.ReadFile(meta)
			if tc.code != codes.OK && string(after) != string(before) {
				t.Errorf("a refused modify changed the metadata")
			}
			if v, _ := e.store.Get(id); (v.Labels[LabelDiscard] == "true") != (tc.code == codes.OK) {
				t.Errorf("labels after modify: %v", v.Labels)
			}
		})
	}
	t.Run("record refused, filesystem put back", func(t *testing.T) {
		e := newTestEnv(t, envOptions{tmpfsBytes: 48 << 20, overcommit: 4})
		c := rwCap(volume.ModeFilesystem, "ext4")
		vol := e.createVolume(t, "discard-put-back", 96<<20, c, map[string]string{ParamDiscard: "true"})
		p := e.stageAndPublish(t, vol.GetVolumeId(), c)
		t.Cleanup(func() { e.teardown(t, p) })
		st, err := e.store.Status(p.id)
		if err != nil || !superOption(t, st.DataDevice, "discard") {
			t.Fatalf("staged with discard=true: discard %t, %v", err == nil && superOption(t, st.DataDevice, "discard"), err)
		}
		meta := filepath.Join(e.store.Root(), p.id+".json")
		before, _ := os.ReadFile(meta)
		_, err = e.ctrl.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: p.id,
			MutableParameters: map[string]string{ParamDiscard: "false", ParamProvisioning: "thick"}})
		wantCode(t, err, codes.ResourceExhausted)
		if !superOption(t, st.DataDevice, "discard") {
			t.Errorf("discard was left off after the store refused the change")
		}
		if after, _ := os.ReadFile(meta); string(after) != string(before) {
			t.Errorf("a refused modify changed the metadata")
		}
	})
}

// mountForeignExt4 mounts an ext4 of its own (an image in a temporary
// directory, on a loop device of its own) at dir, over whatever is there,
// and returns its device. Cleanup unmounts it.
func mountForeignExt4(t testing.TB, dir string) string {
	t.Helper()
	img := filepath.Join(t.TempDir(), "foreign.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	dev := testutil.Losetup(t, img)
	if err := unix.Mount(dev, dir, "ext4", 0, ""); err != nil {
		t.Fatalf("mount %s at %s: %v", dev, dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, 0); err != nil {
			t.Errorf("cleanup: unmount %s: %v", dir, err)
		}
	})
	return dev
}

// superOption reports whether the filesystem on the block device dev has
// the superblock option opt, as the mount table shows it.
func superOption(t testing.TB, dev, opt string) bool {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		t.Fatal(err)
	}
	n := devNumOf(st.Rdev)
	infos, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) { return !n.of(m), false })
	if err != nil || len(infos) == 0 {
		t.Fatalf("mounts of %s: %v, %v", dev, infos, err)
	}
	return slices.Contains(strings.Split(infos[0].VFSOptions, ","), opt)
}

// TestModifyDiscardWhileFrozen changes discard of a staged volume while
// its filesystem is frozen, as a snapshot's copy holds it (FIFREEZE on
// the staging mount point): the kernel refuses the reconfigure, and the
// call is Aborted, saying a snapshot holds the filesystem frozen and to
// retry, with neither the filesystem nor the record changed. Once thawed,
// the same call works.
func TestModifyDiscardWhileFrozen(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	c := rwCap(volume.ModeFilesystem, "ext4")
	vol := e.createVolume(t, "discard-frozen", 32<<20, c, nil)
	p := e.stageAndPublish(t, vol.GetVolumeId(), c)
	t.Cleanup(func() { e.teardown(t, p) })
	st, err := e.store.Status(p.id)
	if err != nil {
		t.Fatal(err)
	}
	meta := filepath.Join(e.store.Root(), p.id+".json")
	before, err := os.ReadFile(meta)
	if err != nil {
		t.Fatal(err)
	}
	thaw := freezeAt(t, p.staging)
	modify := &csi.ControllerModifyVolumeRequest{VolumeId: p.id, MutableParameters: map[string]string{ParamDiscard: "true"}}
	_, err = e.ctrl.ControllerModifyVolume(ctx, modify)
	wantCode(t, err, codes.Aborted)
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "snapshot") || !strings.Contains(msg, "frozen") || !strings.Contains(msg, "retry") {
		t.Errorf("message %q does not say a snapshot holds the filesystem frozen and to retry", msg)
	}
	thaw()
	if superOption(t, st.DataDevice, "discard") {
		t.Errorf("the frozen filesystem was given discard")
	}
	if after, _ := os.ReadFile(meta); string(after) != string(before) {
		t.Errorf("a refused modify changed the metadata")
	}
	if _, err := e.ctrl.ControllerModifyVolume(ctx, modify); err != nil {
		t.Fatalf("retry after the thaw: %v", err)
	}
	if !superOption(t, st.DataDevice, "discard") {
		t.Errorf("after the retry the filesystem has no discard")
	}
	if v, _ := e.store.Get(p.id); v.Labels[LabelDiscard] != "true" {
		t.Errorf("labels after the retry: %v", v.Labels)
	}
}

// The freeze ioctls, _IOWR('X', 119, int) and _IOWR('X', 120, int), as
// the store's freeze (internal/volume/freeze.go) issues them.
const (
	ioctlFIFREEZE = 0xc0045877
	ioctlFITHAW   = 0xc0045878
)

// freezeAt freezes the filesystem mounted at dir (FIFREEZE on the mount
// point, as a snapshot's quiesce does) and returns its thaw, which
// Cleanup also runs; a second thaw is no error.
func freezeAt(t testing.TB, dir string) (thaw func()) {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.IoctlSetInt(fd, ioctlFIFREEZE, 0); err != nil {
		unix.Close(fd)
		t.Fatalf("FIFREEZE %s: %v", dir, err)
	}
	var once sync.Once
	thaw = func() {
		once.Do(func() {
			if err := unix.IoctlSetInt(fd, ioctlFITHAW, 0); err != nil && !errors.Is(err, unix.EINVAL) {
				t.Errorf("FITHAW %s: %v", dir, err)
			}
			unix.Close(fd)
		})
	}
	t.Cleanup(thaw)
	return thaw
}
