package csi

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/sparsevol/sparsevol/internal/testutil"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/volume"
)

func capOf(mode volume.Mode, fsType string, access csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: access}}
	if mode == volume.ModeBlock {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}}
	}
	return c
}

func rwCap(mode volume.Mode, fsType string) *csi.VolumeCapability {
	return capOf(mode, fsType, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
}

// published is a volume staged and published by a test.
type published struct {
	id, staging, target string
	c                   *csi.VolumeCapability
}

func (e *testEnv) createVolume(t testing.TB, name string, size int64, c *csi.VolumeCapability, params map[string]string) *csi.Volume {
	t.Helper()
	resp, err := e.ctrl.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: params,
	})
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return resp.GetVolume()
}

func (e *testEnv) stageAndPublish(t testing.TB, id string, c *csi.VolumeCapability) published {
	t.Helper()
	p := published{id: id, c: c, staging: filepath.Join(e.kubelet, "staging-"+id), target: filepath.Join(e.kubelet, "pods", id, "target")}
	if err := os.MkdirAll(p.staging, 0o750); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: p.staging, VolumeCapability: c,
	}); err != nil {
		t.Fatalf("NodeStageVolume %s: %v", id, err)
	}
	e.publish(t, p)
	return p
}

func (e *testEnv) publish(t testing.TB, p published) {
	t.Helper()
	if _, err := e.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: p.id, StagingTargetPath: p.staging, TargetPath: p.target, VolumeCapability: p.c,
	}); err != nil {
		t.Fatalf("NodePublishVolume %s: %v", p.id, err)
	}
}

// teardown unpublishes, unstages and deletes, as the kubelet and the
// provisioner would.
func (e *testEnv) teardown(t testing.TB, p published) {
	t.Helper()
	ctx := context.Background()
	if _, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: p.id, TargetPath: p.target}); err != nil {
		t.Errorf("NodeUnpublishVolume: %v", err)
	}
	if _, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: p.id, StagingTargetPath: p.staging}); err != nil {
		t.Errorf("NodeUnstageVolume: %v", err)
	}
	if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: p.id}); err != nil {
		t.Errorf("DeleteVolume: %v", err)
	}
}

// devicesOf lists the loop devices bound to volume id, by tag.
func devicesOf(t testing.TB, id string) []string {
	t.Helper()
	devs, err := loop.List()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range devs {
		if d.Tag == "sparsevol:"+id {
			out = append(out, d.Path)
		}
	}
	return out
}

// mountCount counts mountinfo entries at path.
func mountCount(t testing.TB, path string) int {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == path {
			n++
		}
	}
	return n
}

func wantCode(t testing.TB, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v, want code %s", err, code)
	}
}

// TestSizeEnforcement fills volumes until the kernel refuses: the write
// fails with ENOSPC inside the volume, and the backing file never grows
// beyond the volume's logical size.
func TestSizeEnforcement(t *testing.T) {
	e := newTestEnv(t)
	tests := []struct {
		name   string
		mode   volume.Mode
		fsType string
		size   int64
		params map[string]string
	}{
		{"ext4-thin", volume.ModeFilesystem, "ext4", 64 << 20, nil},
		{"ext4-thick", volume.ModeFilesystem, "ext4", 32 << 20, map[string]string{ParamProvisioning: "thick"}},
		{"xfs-thin", volume.ModeFilesystem, "xfs", 300 << 20, nil},
		{"block-thin", volume.ModeBlock, "", 48 << 20, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := rwCap(tc.mode, tc.fsType)
			vol := e.createVolume(t, "size-"+tc.name, tc.size, c, tc.params)
			if vol.GetCapacityBytes() != tc.size {
				t.Fatalf("capacity %d, want %d", vol.GetCapacityBytes(), tc.size)
			}
			p := e.stageAndPublish(t, vol.GetVolumeId(), c)
			defer e.teardown(t, p)

			var f *os.File
			var err error
			if tc.mode == volume.ModeBlock {
				f, err = os.OpenFile(p.target, os.O_WRONLY, 0)
			} else {
				f, err = os.Create(filepath.Join(p.target, "fill"))
			}
			if err != nil {
				t.Fatal(err)
			}
			written, werr := fill(f, 4*tc.size)
			if werr == nil {
				werr = f.Sync()
			}
			f.Close()
			if !errors.Is(werr, syscall.ENOSPC) {
				t.Fatalf("writing %d bytes into a %d byte volume: got %v, want ENOSPC", written, tc.size, werr)
			}
			if written > tc.size {
				t.Errorf("wrote %d bytes into a volume of %d", written, tc.size)
			}
			v, err := e.store.Get(vol.GetVolumeId())
			if err != nil {
				t.Fatal(err)
			}
			var st unix.Stat_t
			if err := unix.Stat(v.BackingFile, &st); err != nil {
				t.Fatal(err)
			}
			if st.Size != tc.size {
				t.Errorf("backing file is %d bytes, want %d", st.Size, tc.size)
			}
			// st_blocks also counts the host filesystem's own index blocks
			// for the file (ext4 extent tree), a few KiB for a fully
			// allocated file; data blocks alone never exceed the size.
			if alloc := st.Blocks * 512; alloc > tc.size+indexSlack(tc.size) {
				t.Errorf("backing file occupies %d bytes (st_blocks %d), more than the volume's %d", alloc, st.Blocks, tc.size)
			}
			t.Logf("wrote %d MiB before ENOSPC; backing file occupies %d of %d MiB", written>>20, st.Blocks*512>>20, tc.size>>20)
		})
	}
}

// indexSlack bounds the host filesystem's index blocks for a file of size
// bytes: 64 KiB plus 1/4096 of the size.
func indexSlack(size int64) int64 { return 64<<10 + size/4096 }

// fill writes 1 MiB chunks until an error or limit bytes.
func fill(w io.Writer, limit int64) (int64, error) {
	buf := bytes.Repeat([]byte("sparsevol"), (1<<20)/9+1)[:1<<20]
	var n int64
	for n < limit {
		k, err := w.Write(buf)
		n += int64(k)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// TestOnlineExpansion grows a mounted volume while a writer appends to a
// file on it, and checks the filesystem grew and every record survived.
func TestOnlineExpansion(t *testing.T) {
	e := newTestEnv(t)
	tests := []struct {
		name, fsType string
		size, grown  int64
		// nodeOnly skips ControllerExpandVolume, as when the claim's
		// resize reached another node's controller: the node grows it all.
		nodeOnly bool
	}{
		{"xfs", "xfs", 300 << 20, 600 << 20, false},
		{"xfs-node-only", "xfs", 300 << 20, 400 << 20, true},
		{"ext4", "ext4", 64 << 20, 256 << 20, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.fsType == "ext4" && testutil.HostLacks(t, testutil.FeatureSysResource, testutil.CapSysResource()) {
				t.Skip(noResourceCapSkip)
			}
			ctx := context.Background()
			c := rwCap(volume.ModeFilesystem, tc.fsType)
			vol := e.createVolume(t, "grow-"+tc.name, tc.size, c, nil)
			p := e.stageAndPublish(t, vol.GetVolumeId(), c)
			defer e.teardown(t, p)
			before := totalBytes(t, e, p)

			path := filepath.Join(p.target, "log")
			stop := make(chan struct{})
			done := make(chan writerResult, 1)
			go appendRecords(path, stop, done)
			time.Sleep(200 * time.Millisecond)

			if !tc.nodeOnly {
				cresp, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
					VolumeId: p.id, CapacityRange: &csi.CapacityRange{RequiredBytes: tc.grown},
				})
				if err != nil {
					t.Fatalf("ControllerExpandVolume: %v", err)
				}
				if !cresp.GetNodeExpansionRequired() || cresp.GetCapacityBytes() != tc.grown {
					t.Fatalf("ControllerExpandVolume = %v", cresp)
				}
			}
			nresp, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{
				VolumeId: p.id, VolumePath: p.target, StagingTargetPath: p.staging,
				CapacityRange: &csi.CapacityRange{RequiredBytes: tc.grown}, VolumeCapability: c,
			})
			if err != nil {
				t.Fatalf("NodeExpandVolume: %v", err)
			}
			if nresp.GetCapacityBytes() != tc.grown {
				t.Errorf("NodeExpandVolume capacity %d, want %d", nresp.GetCapacityBytes(), tc.grown)
			}
			time.Sleep(200 * time.Millisecond)
			close(stop)
			res := <-done
			if res.err != nil {
				t.Fatalf("writer failed during expansion after %d records: %v", res.records, res.err)
			}
			after := totalBytes(t, e, p)
			if after-before < (tc.grown-tc.size)*9/10 {
				t.Errorf("filesystem grew from %d to %d bytes; want about %d more", before, after, tc.grown-tc.size)
			}
			if err := checkRecords(path, res.records); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s grew %d -> %d MiB online while %d records were appended", tc.fsType, before>>20, after>>20, res.records)
		})
	}
}

func totalBytes(t testing.TB, e *testEnv, p published) int64 {
	t.Helper()
	resp, err := e.node.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: p.id, VolumePath: p.target})
	if err != nil {
		t.Fatalf("NodeGetVolumeStats: %v", err)
	}
	for _, u := range resp.GetUsage() {
		if u.GetUnit() == csi.VolumeUsage_BYTES {
			return u.GetTotal()
		}
	}
	t.Fatalf("NodeGetVolumeStats reported no bytes: %v", resp)
	return 0
}

type writerResult struct {
	records int
	err     error
}

const recordSize = 4096

// appendRecords appends numbered 4 KiB records, syncing every 16, until
// stop is closed.
func appendRecords(path string, stop <-chan struct{}, done chan<- writerResult) {
	f, err := os.Create(path)
	if err != nil {
		done <- writerResult{err: err}
		return
	}
	defer f.Close()
	rec := make([]byte, recordSize)
	for n := 0; ; n++ {
		select {
		case <-stop:
			done <- writerResult{records: n, err: f.Sync()}
			return
		default:
		}
		binary.LittleEndian.PutUint64(rec, uint64(n))
		if _, err := f.Write(rec); err != nil {
			done <- writerResult{records: n, err: err}
			return
		}
		if n%16 == 15 {
			if err := f.Sync(); err != nil {
				done <- writerResult{records: n + 1, err: err}
				return
			}
		}
	}
}

func checkRecords(path string, n int) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if len(data) != n*recordSize {
		return fmt.Errorf("%s holds %d bytes, want %d records of %d", path, len(data), n, recordSize)
	}
	for i := range n {
		if got := binary.LittleEndian.Uint64(data[i*recordSize:]); got != uint64(i) {
			return fmt.Errorf("record %d reads %d", i, got)
		}
	}
	return nil
}

// TestRebootSelfHeal takes the device and the mounts away behind the
// driver's back, as a reboot does, and checks that NodePublishVolume alone
// brings the volume back with its data.
func TestRebootSelfHeal(t *testing.T) {
	e := newTestEnv(t)
	tests := []struct {
		name   string
		mode   volume.Mode
		fsType string
		size   int64
	}{
		{"ext4", volume.ModeFilesystem, "ext4", 32 << 20},
		{"xfs", volume.ModeFilesystem, "xfs", 300 << 20},
		{"block", volume.ModeBlock, "", 16 << 20},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			c := rwCap(tc.mode, tc.fsType)
			vol := e.createVolume(t, "heal-"+tc.name, tc.size, c, nil)
			p := e.stageAndPublish(t, vol.GetVolumeId(), c)
			defer e.teardown(t, p)
			payload := []byte("written before the reboot by " + t.Name())
			writeData(t, tc.mode, p.target, payload)

			// The "reboot": mounts and the loop device vanish.
			for _, m := range []string{p.target, p.staging} {
				if tc.mode == volume.ModeBlock && m == p.staging {
					continue // block staging is the attach alone
				}
				if err := unix.Unmount(m, 0); err != nil {
					t.Fatalf("unmount %s: %v", m, err)
				}
			}
			if err := e.store.Detach(p.id, volume.DetachOptions{}); err != nil {
				t.Fatalf("detach behind the driver's back: %v", err)
			}
			if devs := devicesOf(t, p.id); len(devs) != 0 {
				t.Fatalf("devices still attached: %v", devs)
			}
			hresp, err := e.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{
				VolumeId: p.id, VolumePublishPath: p.target, StagingTargetPath: p.staging,
			})
			if err != nil {
				t.Fatalf("NodeGetVolumeHealth: %v", err)
			}
			if h := hresp.GetVolumeHealth().GetHealthStatuses(); len(h) == 0 || h[0].GetStatus() != csi.VolumeHealthErrorType_INACCESSIBLE {
				t.Errorf("health after losing the device = %v, want INACCESSIBLE", h)
			}
			healsBefore := promtest.ToFloat64(e.metrics.restages)

			// The kubelet publishes without staging.
			e.publish(t, p)

			if got := readData(t, tc.mode, p.target, len(payload)); !bytes.Equal(got, payload) {
				t.Fatalf("after self-heal the volume reads %q, want %q", got, payload)
			}
			if n := promtest.ToFloat64(e.metrics.restages) - healsBefore; n != 1 {
				t.Errorf("restages counter grew by %v, want 1", n)
			}
			hresp, err = e.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{
				VolumeId: p.id, VolumePublishPath: p.target, StagingTargetPath: p.staging,
			})
			if err != nil || len(hresp.GetVolumeHealth().GetHealthStatuses()) != 0 {
				t.Errorf("health after self-heal = %v, %v; want no adverse status", hresp, err)
			}
			if devs := devicesOf(t, p.id); len(devs) != 1 {
				t.Errorf("devices after self-heal: %v, want one", devs)
			}
		})
	}
}

func writeData(t testing.TB, mode volume.Mode, target string, data []byte) {
	t.Helper()
	path := target
	flags := os.O_WRONLY
	if mode == volume.ModeFilesystem {
		path = filepath.Join(target, "data")
		flags |= os.O_CREATE | os.O_TRUNC
	}
	f, err := os.OpenFile(path, flags, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

func readData(t testing.TB, mode volume.Mode, target string, n int) []byte {
	t.Helper()
	path := target
	if mode == volume.ModeFilesystem {
		path = filepath.Join(target, "data")
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, n)
	if _, err := io.ReadFull(f, buf); err != nil {
		t.Fatal(err)
	}
	return buf
}

// TestConcurrentCreateAndStage fires 20 CreateVolume and then 20
// NodeStageVolume calls at once, on distinct and on equal names.
func TestConcurrentCreateAndStage(t *testing.T) {
	const n = 20
	c := rwCap(volume.ModeFilesystem, "ext4")
	ctx := context.Background()

	t.Run("distinct", func(t *testing.T) {
		e := newTestEnv(t)
		ids := make([]string, n)
		parallel(n, func(i int) error {
			resp, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name: fmt.Sprintf("conc-%02d", i), CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
				VolumeCapabilities: []*csi.VolumeCapability{c},
			})
			if err != nil {
				t.Errorf("CreateVolume %d: %v", i, err)
				return err
			}
			ids[i] = resp.GetVolume().GetVolumeId()
			return nil
		})
		if t.Failed() {
			return
		}
		staging := func(i int) string { return filepath.Join(e.kubelet, fmt.Sprintf("staging-%02d", i)) }
		parallel(n, func(i int) error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: ids[i], StagingTargetPath: staging(i), VolumeCapability: c})
			if err != nil {
				t.Errorf("NodeStageVolume %d: %v", i, err)
			}
			return err
		})
		for i, id := range ids {
			if devs := devicesOf(t, id); len(devs) != 1 {
				t.Errorf("volume %d: devices %v, want one", i, devs)
			}
			if m := mountCount(t, staging(i)); m != 1 {
				t.Errorf("volume %d: %d mounts at staging, want one", i, m)
			}
		}
		parallel(n, func(i int) error {
			_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: ids[i], StagingTargetPath: staging(i)})
			if err == nil {
				_, err = e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: ids[i]})
			}
			if err != nil {
				t.Errorf("unstage/delete %d: %v", i, err)
			}
			return err
		})
	})

	t.Run("equal", func(t *testing.T) {
		e := newTestEnv(t)
		req := &csi.CreateVolumeRequest{
			Name: "conc-same", CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{c},
		}
		ids := make([]string, n)
		errs := parallel(n, func(i int) error {
			resp, err := e.ctrl.CreateVolume(ctx, req)
			ids[i] = resp.GetVolume().GetVolumeId()
			return err
		})
		id, ok, aborted := tallyCalls(t, "CreateVolume", ids, errs)
		// Retries of the aborted calls, as the provisioner does, converge.
		for range aborted {
			resp, err := e.ctrl.CreateVolume(ctx, req)
			if err != nil || resp.GetVolume().GetVolumeId() != id {
				t.Fatalf("retried CreateVolume = %v, %v; want volume %s", resp, err, id)
			}
		}
		vols, err := e.store.List()
		if err != nil {
			t.Fatal(err)
		}
		if len(vols) != 1 || vols[0].UUID != id {
			t.Fatalf("store holds %d volumes, want exactly volume %s", len(vols), id)
		}
		t.Logf("CreateVolume x%d on one name: %d succeeded, %d aborted (in flight)", n, ok, aborted)

		staging := filepath.Join(e.kubelet, "staging")
		sreq := &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: c}
		errs = parallel(n, func(i int) error {
			_, err := e.node.NodeStageVolume(ctx, sreq)
			return err
		})
		for i := range ids {
			ids[i] = id
		}
		_, ok, aborted = tallyCalls(t, "NodeStageVolume", ids, errs)
		if _, err := e.node.NodeStageVolume(ctx, sreq); err != nil {
			t.Fatalf("NodeStageVolume after the storm: %v", err)
		}
		if devs := devicesOf(t, id); len(devs) != 1 {
			t.Errorf("devices %v, want one", devs)
		}
		if m := mountCount(t, staging); m != 1 {
			t.Errorf("%d mounts at staging, want one", m)
		}
		t.Logf("NodeStageVolume x%d on one volume: %d succeeded, %d aborted (in flight)", n, ok, aborted)
		if _, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatal(err)
		}
	})
}

// parallel runs fn(0..n-1) at once, released together, and returns errors.
func parallel(n int, fn func(i int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs[i] = fn(i)
		}()
	}
	close(start)
	wg.Wait()
	return errs
}

// tallyCalls checks that concurrent calls on one volume either succeeded
// with the same id or were refused with Aborted, and at least one succeeded.
func tallyCalls(t testing.TB, what string, ids []string, errs []error) (id string, ok, aborted int) {
	t.Helper()
	for i, err := range errs {
		switch status.Code(err) {
		case codes.OK:
			ok++
			if id == "" {
				id = ids[i]
			} else if ids[i] != id {
				t.Fatalf("%s returned volumes %s and %s for one name", what, id, ids[i])
			}
		case codes.Aborted:
			aborted++
		default:
			t.Fatalf("%s %d: %v", what, i, err)
		}
	}
	if ok == 0 {
		t.Fatalf("no %s call succeeded", what)
	}
	return id, ok, aborted
}
