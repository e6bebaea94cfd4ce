package csi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

const (
	mib = int64(1) << 20
	gib = int64(1) << 30
)

func TestSizeFor(t *testing.T) {
	tests := []struct {
		name     string
		req, lim int64
		fsType   string
		want     int64
		code     codes.Code
	}{
		{"nothing asked: default", 0, 0, "ext4", gib, codes.OK},
		{"tiny ext4 raised to minimum", 1, 0, "ext4", 4 * mib, codes.OK},
		{"tiny xfs raised to minimum", 1, 0, "xfs", 300 * mib, codes.OK},
		{"tiny block raised to a MiB", 1, 0, "", mib, codes.OK},
		{"rounded up to a MiB", 5*mib + 1, 0, "ext4", 6 * mib, codes.OK},
		{"exact", 512 * mib, 512 * mib, "ext4", 512 * mib, codes.OK},
		{"limit only, below default", 0, 100 * mib, "ext4", 100 * mib, codes.OK},
		{"limit only, above default", 0, 10 * gib, "ext4", gib, codes.OK},
		{"limit below fs minimum", 1, 2 * mib, "ext4", 0, codes.OutOfRange},
		{"xfs limit below minimum", 0, 100 * mib, "xfs", 0, codes.OutOfRange},
		{"rounding passes limit", 5*mib + 1, 5*mib + 2, "ext4", 0, codes.OutOfRange},
		{"limit only, not a whole MiB", 0, 100*mib + 512, "ext4", 100 * mib, codes.OK},
		{"limit only, not a whole MiB, below minimum", 0, 4*mib - 1, "ext4", 0, codes.OutOfRange},
		{"limit only, under a MiB", 0, mib - 1, "", 0, codes.OutOfRange},
		{"required over limit", 10 * mib, 5 * mib, "ext4", 0, codes.InvalidArgument},
		{"negative", -1, 0, "ext4", 0, codes.InvalidArgument},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := sizeFor(&csi.CapacityRange{RequiredBytes: tc.req, LimitBytes: tc.lim}, tc.fsType)
			if status.Code(err) != tc.code {
				t.Fatalf("sizeFor(%d, %d, %q) error %v, want code %s", tc.req, tc.lim, tc.fsType, err, tc.code)
			}
			if got != tc.want {
				t.Errorf("sizeFor(%d, %d, %q) = %d, want %d", tc.req, tc.lim, tc.fsType, got, tc.want)
			}
		})
	}
}

func TestParseRequest(t *testing.T) {
	mount := func(fs string) *csi.VolumeCapability { return rwCap(volume.ModeFilesystem, fs) }
	block := rwCap(volume.ModeBlock, "")
	multi := capOf(volume.ModeFilesystem, "", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	tests := []struct {
		name   string
		caps   []*csi.VolumeCapability
		params map[string]string
		code   codes.Code
		check  func(*spec) error
	}{
		{name: "defaults", caps: []*csi.VolumeCapability{mount("")}, check: func(s *spec) error {
			if s.req.Mode != volume.ModeFilesystem || s.req.FSType != "ext4" || s.req.Preallocate || s.req.DirectIO != nil {
				return fmt.Errorf("got %+v", s)
			}
			return nil
		}},
		{name: "every parameter", caps: []*csi.VolumeCapability{mount("")},
			params: map[string]string{ParamFSType: "xfs", ParamProvisioning: "thick", ParamDirectIO: "false", ParamMkfsOptions: "-b size=4096  -K",
				"csi.storage.k8s.io/pvc/name": "data"},
			check: func(s *spec) error {
				if s.req.FSType != "xfs" || !s.req.Preallocate || s.req.DirectIO == nil || *s.req.DirectIO || strings.Join(s.req.MkfsOptions, "|") != "-b|size=4096|-K" {
					return fmt.Errorf("got %+v", s)
				}
				return nil
			}},
		{name: "fs from capability", caps: []*csi.VolumeCapability{mount("xfs")}, check: func(s *spec) error {
			if s.req.FSType != "xfs" {
				return fmt.Errorf("fs %q", s.req.FSType)
			}
			return nil
		}},
		{name: "block", caps: []*csi.VolumeCapability{block}, check: func(s *spec) error {
			if s.req.Mode != volume.ModeBlock || s.req.FSType != "" {
				return fmt.Errorf("got %+v", s)
			}
			return nil
		}},
		{name: "no capabilities", code: codes.InvalidArgument},
		{name: "multi-node access", caps: []*csi.VolumeCapability{multi}, code: codes.InvalidArgument},
		{name: "block and mount", caps: []*csi.VolumeCapability{mount(""), block}, code: codes.InvalidArgument},
		{name: "two filesystems", caps: []*csi.VolumeCapability{mount("ext4"), mount("xfs")}, code: codes.InvalidArgument},
		{name: "parameter contradicts capability", caps: []*csi.VolumeCapability{mount("ext4")}, params: map[string]string{ParamFSType: "xfs"}, code: codes.InvalidArgument},
		{name: "unsupported filesystem", caps: []*csi.VolumeCapability{mount("btrfs")}, code: codes.InvalidArgument},
		{name: "unknown parameter", caps: []*csi.VolumeCapability{mount("")}, params: map[string]string{"provisionning": "thin"}, code: codes.InvalidArgument},
		{name: "bad provisioning", caps: []*csi.VolumeCapability{mount("")}, params: map[string]string{ParamProvisioning: "fat"}, code: codes.InvalidArgument},
		{name: "bad directIO", caps: []*csi.VolumeCapability{mount("")}, params: map[string]string{ParamDirectIO: "maybe"}, code: codes.InvalidArgument},
		{name: "block with fsType", caps: []*csi.VolumeCapability{block}, params: map[string]string{ParamFSType: "ext4"}, code: codes.InvalidArgument},
		{name: "block with mkfsOptions", caps: []*csi.VolumeCapability{block}, params: map[string]string{ParamMkfsOptions: "-K"}, code: codes.InvalidArgument},
		{name: "no access type", caps: []*csi.VolumeCapability{{AccessMode: block.AccessMode}}, code: codes.InvalidArgument},
		{name: "block is a whole device", caps: []*csi.VolumeCapability{block}, check: func(s *spec) error {
			if !s.req.NoPartition {
				return fmt.Errorf("block volumes are whole devices: %+v", s.req)
			}
			return nil
		}},
		{name: "mkfs log on a host file", caps: []*csi.VolumeCapability{mount("xfs")}, params: map[string]string{ParamMkfsOptions: "-l logdev=/some/file,size=64m"}, code: codes.InvalidArgument},
		{name: "mkfs log on a device name", caps: []*csi.VolumeCapability{mount("xfs")}, params: map[string]string{ParamMkfsOptions: "-l logdev=vdb,size=64m"}, code: codes.InvalidArgument},
		{name: "mkfs copies a host directory", caps: []*csi.VolumeCapability{mount("")}, params: map[string]string{ParamMkfsOptions: "-d /etc"}, code: codes.InvalidArgument},
		{name: "mkfs data on a host file", caps: []*csi.VolumeCapability{mount("xfs")}, params: map[string]string{ParamMkfsOptions: "-d name=/etc/shadow"}, code: codes.InvalidArgument},
		{name: "mkfs realtime device", caps: []*csi.VolumeCapability{mount("xfs")}, params: map[string]string{ParamMkfsOptions: "-r rtdev=/dev/vdb"}, code: codes.InvalidArgument},
		{name: "mkfs protofile", caps: []*csi.VolumeCapability{mount("xfs")}, params: map[string]string{ParamMkfsOptions: "-p /etc/proto"}, code: codes.InvalidArgument},
		{name: "mkfs random uuid", caps: []*csi.VolumeCapability{mount("")}, params: map[string]string{ParamMkfsOptions: "-Urandom"}, code: codes.InvalidArgument},
		{name: "mkfs xfs uuid", caps: []*csi.VolumeCapability{mount("xfs")}, params: map[string]string{ParamMkfsOptions: "-muuid=11111111-1111-1111-1111-111111111111"}, code: codes.InvalidArgument},
		{name: "mkfs dry run", caps: []*csi.VolumeCapability{mount("")}, params: map[string]string{ParamMkfsOptions: "-n"}, code: codes.InvalidArgument},
		{name: "mkfs xfs dry run", caps: []*csi.VolumeCapability{mount("xfs")}, params: map[string]string{ParamMkfsOptions: "-N"}, code: codes.InvalidArgument},
		{name: "mkfs errors=panic", caps: []*csi.VolumeCapability{mount("")}, params: map[string]string{ParamMkfsOptions: "-e panic"}, code: codes.InvalidArgument},
		{name: "I/O limits", caps: []*csi.VolumeCapability{block},
			params: map[string]string{ParamReadIOPS: "300", ParamWriteIOPS: "max", ParamReadBPS: "1.5Mi", ParamWriteBPS: "10M"},
			check: func(s *spec) error {
				if s.req.IOLimits != (volume.IOLimits{ReadIOPS: 300, ReadBPS: 3 << 19, WriteBPS: 10 << 20}) {
					return fmt.Errorf("limits %+v", s.req.IOLimits)
				}
				return nil
			}},
		{name: "negative limit", caps: []*csi.VolumeCapability{block}, params: map[string]string{ParamWriteBPS: "-1"}, code: codes.InvalidArgument},
		{name: "IOPS beyond 32 bits", caps: []*csi.VolumeCapability{block}, params: map[string]string{ParamReadIOPS: "4294967296"}, code: codes.InvalidArgument},
		{name: "limit garbage", caps: []*csi.VolumeCapability{block}, params: map[string]string{ParamWriteIOPS: "fast"}, code: codes.InvalidArgument},
		{name: "mkfs options tokenised", caps: []*csi.VolumeCapability{mount("")}, params: map[string]string{ParamMkfsOptions: " -b 4096\t-L data "},
			check: func(s *spec) error {
				if strings.Join(s.req.MkfsOptions, "|") != "-b|4096|-L|data" {
					return fmt.Errorf("mkfs options %q", s.req.MkfsOptions)
				}
				return nil
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := parseRequest(tc.caps, tc.params, &csi.CapacityRange{RequiredBytes: 512 * mib})
			if status.Code(err) != tc.code {
				t.Fatalf("error %v, want code %s", err, tc.code)
			}
			if tc.check != nil {
				if err := tc.check(s); err != nil {
					t.Error(err)
				}
			}
		})
	}
}

func TestParseEndpoint(t *testing.T) {
	tests := []struct {
		in, want string
		ok       bool
	}{
		{"unix:///csi/csi.sock", "/csi/csi.sock", true},
		{"unix:/csi/csi.sock", "/csi/csi.sock", true},
		{"/var/lib/kubelet/plugins/x/csi.sock", "/var/lib/kubelet/plugins/x/csi.sock", true},
		{"tcp://127.0.0.1:10000", "", false},
		{"unix://relative.sock", "", false},
		{"csi.sock", "", false},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseEndpoint(tc.in)
			if (err == nil) != tc.ok || got != tc.want {
				t.Errorf("ParseEndpoint(%q) = %q, %v; want %q, ok=%t", tc.in, got, err, tc.want, tc.ok)
			}
		})
	}
}

func TestToStatus(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("create x: %w", err) }
	tests := []struct {
		err  error
		code codes.Code
	}{
		{wrap(volume.ErrInvalid), codes.InvalidArgument},
		{wrap(volume.ErrNotFound), codes.NotFound},
		{wrap(volume.ErrExists), codes.AlreadyExists},
		{wrap(volume.ErrNoSpace), codes.ResourceExhausted},
		{wrap(volume.ErrBusy), codes.FailedPrecondition},
		{wrap(volume.ErrNotReady), codes.Unavailable},
		{wrap(volume.ErrNotSupported), codes.FailedPrecondition},
		{wrap(volume.ErrNewer), codes.FailedPrecondition},
		{wrap(context.DeadlineExceeded), codes.DeadlineExceeded},
		{wrap(errFrozen), codes.Aborted},
		{errors.Join(wrap(volume.ErrNoRoom), wrap(errFrozen)), codes.ResourceExhausted},
		{errors.New("mkfs exploded"), codes.Internal},
		{status.Error(codes.Aborted, "busy"), codes.Aborted},
	}
	for _, tc := range tests {
		if got := status.Code(toStatus(tc.err)); got != tc.code {
			t.Errorf("toStatus(%v) = %s, want %s", tc.err, got, tc.code)
		}
	}
	if toStatus(nil) != nil {
		t.Error("toStatus(nil) is not nil")
	}
	// Want of room is ResourceExhausted with the advice that fits, naming
	// the store: a midway failure (ErrNoRoom alone) as well as a refusal.
	for _, tc := range []struct {
		err    *volume.SpaceError
		advice string
	}{
		{&volume.SpaceError{Store: "/s", Err: wrap(volume.ErrNoSpace)}, "raise the plugin's --overcommit-ratio"},
		{&volume.SpaceError{Store: "/s", Err: errors.New("mkfs.xfs: write failed: No space left on device"), NoRoom: true}, "has no room left"},
	} {
		err := toStatus(fmt.Errorf("create x: %w", tc.err))
		if msg := status.Convert(err).Message(); status.Code(err) != codes.ResourceExhausted || !strings.Contains(msg, tc.advice) || !strings.Contains(msg, "/s") {
			t.Errorf("toStatus(%v) = %v; want ResourceExhausted saying %q about /s", tc.err, err, tc.advice)
		}
	}
}

func TestInflight(t *testing.T) {
	f := inflight{keys: map[busyKey]struct{}{}}
	release, err := f.acquire(volumeKey("a"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.acquire(volumeKey("a")); status.Code(err) != codes.Aborted {
		t.Fatalf("second acquire: %v, want Aborted", err)
	}
	other, err := f.acquire(volumeKey("b"))
	if err != nil {
		t.Fatalf("other key: %v", err)
	}
	other()
	release()
	if r, err := f.acquire(volumeKey("a")); err != nil {
		t.Fatalf("after release: %v", err)
	} else {
		r()
	}
	// A client's string names one kind of key: a volume id spelled like
	// another kind's key is not that key.
	for _, pair := range [][2]busyKey{
		{pathKey("/var/lib/kubelet/x"), volumeKey("path /var/lib/kubelet/x")},
		{volumeNameKey("pvc-1"), volumeKey("name pvc-1")},
		{volumeNameKey("pvc-1"), volumeKey("pvc-1")},
		{snapshotNameKey("s"), volumeKey("snapshot name s")},
		{snapshotKey("u"), volumeKey("u")},
	} {
		held, err := f.acquire(pair[0])
		if err != nil {
			t.Fatal(err)
		}
		if r, err := f.acquire(pair[1]); err != nil {
			t.Errorf("%v held: %v refused: %v", pair[0], pair[1], err)
		} else {
			r()
		}
		held()
	}
}

// TestControllerRules drives the controller and node through the cases
// sanity does not reach, on a store of its own tmpfs so that capacity is
// exact.
func TestControllerRules(t *testing.T) {
	e := newTestEnv(t, envOptions{tmpfsBytes: 256 << 20})
	ctx := context.Background()
	mountRW := rwCap(volume.ModeFilesystem, "ext4")
	block := rwCap(volume.ModeBlock, "")

	// A node-mode volume in the same store: the CSI driver must not take it.
	nodeVol, err := e.store.Create(ctx, volume.CreateRequest{Name: "node-mode", SizeBytes: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}

	t.Run("name of a node-mode volume", func(t *testing.T) {
		_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "node-mode", VolumeCapabilities: []*csi.VolumeCapability{mountRW},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 8 << 20}})
		wantCode(t, err, codes.AlreadyExists)
	})
	t.Run("delete a node-mode volume", func(t *testing.T) {
		_, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: nodeVol.UUID})
		wantCode(t, err, codes.FailedPrecondition)
	})
	t.Run("other node's topology", func(t *testing.T) {
		_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "elsewhere", VolumeCapabilities: []*csi.VolumeCapability{mountRW},
			AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{TopologyKey: "other-node"}}}}})
		wantCode(t, err, codes.ResourceExhausted)
	})
	t.Run("clone of a node-mode volume", func(t *testing.T) {
		_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "clone", VolumeCapabilities: []*csi.VolumeCapability{mountRW},
			VolumeContentSource: volSource(nodeVol.UUID)})
		wantCode(t, err, codes.FailedPrecondition)
	})

	t.Run("capacity follows the overcommit policy", func(t *testing.T) {
		cresp, err := e.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{})
		if err != nil {
			t.Fatal(err)
		}
		sp, err := e.store.Space()
		if err != nil {
			t.Fatal(err)
		}
		if got, want := cresp.GetAvailableCapacity(), sp.CapacityBytes/mib*mib; got != want {
			t.Fatalf("GetCapacity %d, store says %d", got, want)
		}
		if cresp.GetAvailableCapacity() < 100<<20 {
			t.Fatalf("tmpfs store offers only %d bytes", cresp.GetAvailableCapacity())
		}
		_, err = e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "too-big", VolumeCapabilities: []*csi.VolumeCapability{block},
			CapacityRange: &csi.CapacityRange{RequiredBytes: cresp.GetAvailableCapacity() + mib}})
		wantCode(t, err, codes.ResourceExhausted)
		vol := e.createVolume(t, "all-of-it", cresp.GetAvailableCapacity(), block, nil)
		after, err := e.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if after.GetAvailableCapacity() != 0 {
			t.Errorf("capacity after promising all of it: %d, want 0", after.GetAvailableCapacity())
		}
		_, err = e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(),
			CapacityRange: &csi.CapacityRange{RequiredBytes: vol.GetCapacityBytes() + mib}})
		wantCode(t, err, codes.ResourceExhausted)
		if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
			t.Fatal(err)
		}
		other, err := e.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{AccessibleTopology: &csi.Topology{Segments: map[string]string{TopologyKey: "other-node"}}})
		if err != nil || other.GetAvailableCapacity() != 0 {
			t.Errorf("capacity of another node = %v, %v; want 0", other, err)
		}
	})

	t.Run("expand", func(t *testing.T) {
		vol := e.createVolume(t, "expand", 8*mib, block, nil)
		resp, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(),
			CapacityRange: &csi.CapacityRange{RequiredBytes: 4 * mib}})
		if err != nil || resp.GetCapacityBytes() != 8*mib || resp.GetNodeExpansionRequired() {
			t.Errorf("expand to a smaller size = %v, %v; want the current 8 MiB, no node step for block", resp, err)
		}
		_, err = e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(),
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16*mib + 1, LimitBytes: 16*mib + 2}})
		wantCode(t, err, codes.OutOfRange)
		for _, cr := range []*csi.CapacityRange{
			{RequiredBytes: -mib},
			{RequiredBytes: 16 * mib, LimitBytes: -1},
			{LimitBytes: -16 * mib},
			{RequiredBytes: 32 * mib, LimitBytes: 16 * mib},
		} {
			_, err = e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(), CapacityRange: cr})
			wantCode(t, err, codes.InvalidArgument)
		}
		if v, err := e.store.Get(vol.GetVolumeId()); err != nil || v.SizeBytes != 8*mib || v.ExpandingTo != 0 {
			t.Errorf("after refused expansions: %+v, %v; want 8 MiB, nothing pending", v, err)
		}
		_, err = e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: volume.NewUUID(),
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}})
		wantCode(t, err, codes.NotFound)
		if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("list pages", func(t *testing.T) {
		want := map[string]bool{}
		for i := range 5 {
			want[e.createVolume(t, fmt.Sprintf("list-%d", i), 4*mib, mountRW, nil).GetVolumeId()] = true
		}
		// No max_entries: pages of defaultListPage, not every volume at once.
		defer func(n int) { defaultListPage = n }(defaultListPage)
		defaultListPage = 3
		for _, max := range []int32{2, 0} {
			page := int(max)
			if max == 0 {
				page = defaultListPage
			}
			seen := map[string]int{}
			token := ""
			for pages := 0; ; pages++ {
				resp, err := e.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: max, StartingToken: token})
				if err != nil {
					t.Fatal(err)
				}
				if len(resp.GetEntries()) > page {
					t.Fatalf("max_entries %d: page of %d entries, want %d at most", max, len(resp.GetEntries()), page)
				}
				for _, en := range resp.GetEntries() {
					seen[en.GetVolume().GetVolumeId()]++
				}
				if token = resp.GetNextToken(); token == "" || pages > 10 {
					break
				}
			}
			for id := range want {
				if seen[id] != 1 {
					t.Errorf("max_entries %d: volume %s listed %d times", max, id, seen[id])
				}
			}
			if seen[nodeVol.UUID] != 0 {
				t.Error("ListVolumes lists a node-mode volume")
			}
		}
		for id := range want {
			if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("staged volume", func(t *testing.T) {
		vol := e.createVolume(t, "staged", 8*mib, mountRW, nil)
		id := vol.GetVolumeId()
		staging := filepath.Join(e.kubelet, "staged-staging")
		_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: block})
		wantCode(t, err, codes.InvalidArgument) // a filesystem volume is not a block device
		if _, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountRW}); err != nil {
			t.Fatal(err)
		}
		_, err = e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
		wantCode(t, err, codes.FailedPrecondition)

		single := capOf(volume.ModeFilesystem, "ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
		ro := published{id: id, staging: staging, target: filepath.Join(e.kubelet, "ro-target"), c: single}
		if _, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			TargetPath: ro.target, VolumeCapability: single, Readonly: true}); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(ro.target, "x"), []byte("x"), 0o600); !errors.Is(err, syscall.EROFS) {
			t.Errorf("write into a read-only publication: %v, want EROFS", err)
		}
		_, err = e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			TargetPath: filepath.Join(e.kubelet, "second-target"), VolumeCapability: single})
		wantCode(t, err, codes.FailedPrecondition)

		_, err = e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		wantCode(t, err, codes.FailedPrecondition) // still published

		// Unpublish and unstage are idempotent.
		for range 2 {
			if _, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: ro.target}); err != nil {
				t.Error(err)
			}
			if _, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
				t.Error(err)
			}
		}
		if _, err := os.Stat(ro.target); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("target path left behind: %v", err)
		}
		if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatal(err)
		}
		// A volume that is gone has nothing at any path: NotFound.
		_, err = e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: ro.target})
		wantCode(t, err, codes.NotFound)
		_, err = e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		wantCode(t, err, codes.NotFound)
	})

	t.Run("probe, info and metrics", func(t *testing.T) {
		p, err := e.ident.Probe(ctx, &csi.ProbeRequest{})
		if err != nil || !p.GetReady().GetValue() {
			t.Fatalf("Probe = %v, %v", p, err)
		}
		info, err := e.node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		if err != nil || info.GetNodeId() != testNodeID || info.GetAccessibleTopology().GetSegments()[TopologyKey] != testNodeID || info.GetMaxVolumesPerNode() != 100 {
			t.Fatalf("NodeGetInfo = %v, %v", info, err)
		}
		srv := httptest.NewServer(promhttp.HandlerFor(e.metrics.Registry, promhttp.HandlerOpts{}))
		defer srv.Close()
		resp, err := srv.Client().Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, want := range []string{
			`sparsevol_volumes{fs_type="ext4",managed_by="node",mode="filesystem"} 1`,
			`sparsevol_volume_logical_bytes{name="node-mode",volume_id="` + nodeVol.UUID + `"} 8.388608e+06`,
			`sparsevol_volume_allocated_bytes{name="node-mode"`,
			`sparsevol_store_capacity_bytes `,
			`sparsevol_csi_operations_total{code="OK",method="CreateVolume"}`,
			`sparsevol_csi_operation_errors_total{code="ResourceExhausted",method="CreateVolume"} 2`,
			`sparsevol_csi_operation_duration_seconds_count{method="NodeStageVolume"}`,
		} {
			if !strings.Contains(string(body), want) {
				t.Errorf("metrics lack %q", want)
			}
		}
		if t.Failed() {
			t.Logf("metrics:\n%s", body)
		}
	})
	if err := e.store.Delete(ctx, nodeVol.UUID, volume.DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestCapacityThinAndThick: with overcommit, thin volumes may promise more
// than is free, thick ones never (they allocate everything at once).
func TestCapacityThinAndThick(t *testing.T) {
	e := newTestEnv(t, envOptions{tmpfsBytes: 128 << 20, overcommit: 3})
	ctx := context.Background()
	mountRW := rwCap(volume.ModeFilesystem, "ext4")
	sp, err := e.store.Space()
	if err != nil {
		t.Fatal(err)
	}
	capacity := func(provisioning string) int64 {
		t.Helper()
		resp, err := e.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{
			VolumeCapabilities: []*csi.VolumeCapability{mountRW},
			Parameters:         map[string]string{ParamProvisioning: provisioning},
		})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetAvailableCapacity()
	}
	thin, thick := capacity("thin"), capacity("thick")
	if thin <= sp.FreeBytes || thick > sp.FreeBytes {
		t.Fatalf("free %d: thin capacity %d (want more), thick %d (want at most free)", sp.FreeBytes, thin, thick)
	}
	_, err = e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "thick-too-big", VolumeCapabilities: []*csi.VolumeCapability{mountRW},
		Parameters:    map[string]string{ParamProvisioning: "thick"},
		CapacityRange: &csi.CapacityRange{RequiredBytes: thick + 8*mib}})
	wantCode(t, err, codes.ResourceExhausted)
	if vols, _ := e.store.List(); len(vols) != 0 {
		t.Fatalf("a refused thick volume left %d volumes", len(vols))
	}
	vol := e.createVolume(t, "thin-beyond-free", sp.FreeBytes+16*mib, mountRW, nil)
	if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
}

// TestRefusalsEchoShort: a refused value from the CO, however long, is
// shown in the error (and so in the log) as a short prefix only.
func TestRefusalsEchoShort(t *testing.T) {
	long := strings.Repeat("9", 1<<20)
	word := strings.Repeat("x", 1<<20)
	block := rwCap(volume.ModeBlock, "")
	mountCap := func(fs string, flags ...string) *csi.VolumeCapability {
		c := rwCap(volume.ModeFilesystem, fs)
		c.GetMount().MountFlags = flags
		return c
	}
	create := func(c *csi.VolumeCapability, params map[string]string) func() error {
		return func() error {
			_, err := parseRequest([]*csi.VolumeCapability{c}, params, &csi.CapacityRange{RequiredBytes: 512 * mib})
			return err
		}
	}
	modify := func(params map[string]string) func() error {
		return func() error {
			if err := checkMutable(params); err != nil {
				return err
			}
			_, _, err := changeFor(&volume.Volume{Mode: volume.ModeFilesystem, FSType: "ext4"}, params)
			return err
		}
	}
	d := &Driver{}
	tests := []struct {
		name  string
		call  func() error
		names string // the message names this
	}{
		{"create bytes per second", create(block, map[string]string{ParamReadBPS: long}), ParamReadBPS},
		{"create bytes per second, fraction", create(block, map[string]string{ParamWriteBPS: "1." + long}), ParamWriteBPS},
		{"create IOPS", create(block, map[string]string{ParamReadIOPS: long}), ParamReadIOPS},
		{"create directIO", create(block, map[string]string{ParamDirectIO: word}), ParamDirectIO},
		{"create discard", create(block, map[string]string{ParamDiscard: word}), ParamDiscard},
		{"create provisioning", create(block, map[string]string{ParamProvisioning: word}), ParamProvisioning},
		{"create unknown parameter", create(block, map[string]string{word: "x"}), "unknown parameter"},
		{"create fsType", create(mountCap(""), map[string]string{ParamFSType: word}), "filesystem"},
		{"create fsType against capability", create(mountCap("ext4"), map[string]string{ParamFSType: word}), ParamFSType},
		{"create mkfsOptions", create(mountCap(""), map[string]string{ParamMkfsOptions: word}), "mkfs option"},
		{"create mkfsOptions value", create(mountCap(""), map[string]string{ParamMkfsOptions: "-L " + word}), "mkfs option"},
		{"create mount flag", create(mountCap("", word), nil), "mount option"},
		{"modify bytes per second", modify(map[string]string{ParamWriteBPS: long}), ParamWriteBPS},
		{"modify IOPS", modify(map[string]string{ParamWriteIOPS: word}), ParamWriteIOPS},
		{"modify directIO", modify(map[string]string{ParamDirectIO: word}), ParamDirectIO},
		{"modify provisioning", modify(map[string]string{ParamProvisioning: word}), ParamProvisioning},
		{"modify unknown parameter", modify(map[string]string{word: "x"}), "cannot be changed"},
		{"snapshot parameter", func() error { return checkSnapshotParameters(map[string]string{word: "x"}) }, "snapshot parameter"},
		{"volume id", func() error { _, err := d.lookup(word); return err }, "volume id"},
		{"node path", func() error { return checkNodePath(DefaultKubeletDir, "target_path", "/"+word) }, "target_path"},
		{"relative node path", func() error { return checkNodePath(DefaultKubeletDir, "target_path", word[:4000]) }, "target_path"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if err == nil {
				t.Fatal("accepted")
			}
			msg := status.Convert(toStatus(err)).Message()
			if len(msg) > 512 {
				t.Errorf("message of %d bytes echoes the value: %.160s...", len(msg), msg)
			}
			if !strings.Contains(msg, tc.names) {
				t.Errorf("message %.300q does not name %q", msg, tc.names)
			}
		})
	}
}

// TestControllerRefusalsEchoShort: a hostile id or list of ids a
// controller or group RPC refuses is echoed quoted and cut, over the
// plugin's socket, and the refusal changes nothing.
func TestControllerRefusalsEchoShort(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	fs := rwCap(volume.ModeFilesystem, "ext4")
	vol := e.createVolume(t, "echo-vol", 16*mib, fs, nil)
	if _, err := e.group.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "echo-grp", SourceVolumeIds: []string{vol.VolumeId}}); err != nil {
		t.Fatal(err)
	}
	word := "\x1b[31m\nforged\u202e" + strings.Repeat("x", 1<<20)
	many := make([]string, 10000)
	for i := range many {
		many[i] = fmt.Sprintf("id-%d\n", i)
	}
	tests := []struct {
		name  string
		call  func() error
		code  codes.Code
		names string // the message names this
	}{
		{"group naming an id twice", func() error {
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{word, word}})
			return err
		}, codes.InvalidArgument, "twice"},
		{"get group by a long id", func() error {
			_, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "echo-grp", SnapshotIds: []string{word}})
			return err
		}, codes.InvalidArgument, "snapshot_ids"},
		{"get group by many ids", func() error {
			_, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "echo-grp", SnapshotIds: many})
			return err
		}, codes.InvalidArgument, "10000 in all"},
		{"delete group by a long id", func() error {
			_, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "echo-grp", SnapshotIds: []string{word}})
			return err
		}, codes.InvalidArgument, "snapshot_ids"},
		{"delete group by many ids", func() error {
			_, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "echo-grp", SnapshotIds: many})
			return err
		}, codes.InvalidArgument, "10000 in all"},
		{"expand with a long fs_type", func() error {
			_, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
				VolumeId: vol.VolumeId, CapacityRange: &csi.CapacityRange{RequiredBytes: 32 * mib}, VolumeCapability: rwCap(volume.ModeFilesystem, word),
			})
			return err
		}, codes.InvalidArgument, "filesystem"},
		{"delete a long id while it is busy", func() error {
			release, err := e.drv.busy.acquire(snapshotKey(word))
			if err != nil {
				return err
			}
			defer release()
			_, err = e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: word})
			return err
		}, codes.Aborted, "in progress"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := storeState(t, e)
			err := tc.call()
			if status.Code(err) != tc.code {
				t.Fatalf("got %.200v, want code %s", err, tc.code)
			}
			msg := status.Convert(err).Message()
			if len(msg) > 512 {
				t.Errorf("message of %d bytes echoes the value: %.160q...", len(msg), msg)
			}
			if i := strings.IndexFunc(msg, func(r rune) bool { return r < ' ' || r > '~' }); i >= 0 {
				t.Errorf("message holds %q unescaped: %.160q", msg[i:i+1], msg)
			}
			if !strings.Contains(msg, tc.names) {
				t.Errorf("message %.300q does not name %q", msg, tc.names)
			}
			if after := storeState(t, e); after != before {
				t.Errorf("the store changed:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

// TestCapacityWithLimits: a StorageClass with I/O limits has capacity on
// a node only where CreateVolume can make its volumes: on a host that
// cannot enforce limits (no cgroup v2 io controller), GetCapacity reports
// none, as CreateVolume refuses them; elsewhere what any class has.
func TestCapacityWithLimits(t *testing.T) {
	e := newTestEnv(t, envOptions{limits: privateLimits(t)})
	ctx := context.Background()
	mountRW := rwCap(volume.ModeFilesystem, "ext4")
	capacity := func(params map[string]string) int64 {
		t.Helper()
		resp, err := e.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{VolumeCapabilities: []*csi.VolumeCapability{mountRW}, Parameters: params})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetAvailableCapacity()
	}
	plain := capacity(nil)
	if plain == 0 {
		t.Fatal("no capacity without limits")
	}
	limited := map[string]string{ParamWriteIOPS: "100"}
	got := capacity(limited)
	if !testutil.HostLacks(t, testutil.FeatureIOLimits, e.store.CheckLimits(volume.IOLimits{WriteIOPS: 1})) {
		if got != plain {
			t.Errorf("capacity with limits %d, without %d", got, plain)
		}
		return
	}
	_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "limited", VolumeCapabilities: []*csi.VolumeCapability{mountRW}, Parameters: limited})
	wantCode(t, err, codes.FailedPrecondition)
	if got != 0 {
		t.Errorf("GetCapacity for a class with limits = %d on a host that refuses to make its volumes, want 0", got)
	}
	if got := capacity(map[string]string{ParamWriteIOPS: "max"}); got != plain {
		t.Errorf("capacity with no limit given as max = %d, want %d", got, plain)
	}
}
