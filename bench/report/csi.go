package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// csiRuns is how many pod starts each CSI row takes the median of.
const csiRuns = 15

// csiIdle is how long the plugin has nothing to do before each timed
// sequence (a pod start, or the floor's calls): kubelet and the
// provisioner find a driver idle, and waking an idle process costs more
// than calling a busy one, so both are timed from the same idle state.
const csiIdle = 20 * time.Millisecond

// csiBench is a running sparsevol-csi and a client of its socket.
type csiBench struct {
	kubelet string
	store   string // the plugin's store directory
	conn    *grpc.ClientConn
	ident   csi.IdentityClient
	ctrl    csi.ControllerClient
	node    csi.NodeClient
	stop    func()
}

// startPlugin runs the real binary's CSI plugin on a store of its own and
// connects to its socket.
func startPlugin(ctx context.Context, c *config) (*csiBench, error) {
	root := filepath.Join(c.dir, "csi-store")
	kubelet := filepath.Join(c.dir, "kubelet")
	for _, d := range []string{root, kubelet} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return nil, err
		}
	}
	// Socket paths are limited to 108 bytes: a short directory of its own.
	sockDir, err := os.MkdirTemp("/tmp", "svbench-")
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(sockDir, "csi.sock")
	cmd := exec.Command(c.plugin, "--root", root, "--unit-dir", filepath.Join(c.dir, "units"),
		"--endpoint", "unix://"+sock, "--node-id", "bench", "--kubelet-dir", kubelet, "--log-level", "warn")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		os.RemoveAll(sockDir)
		return nil, err
	}
	b := &csiBench{kubelet: kubelet, store: root}
	b.stop = func() {
		if b.conn != nil {
			b.conn.Close()
		}
		cmd.Process.Signal(os.Interrupt)
		cmd.Wait()
		os.RemoveAll(sockDir)
	}
	for start := time.Now(); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Since(start) > 10*time.Second {
			b.stop()
			return nil, fmt.Errorf("the plugin made no socket within 10 s")
		}
	}
	if b.conn, err = grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		b.stop()
		return nil, err
	}
	b.ident, b.ctrl, b.node = csi.NewIdentityClient(b.conn), csi.NewControllerClient(b.conn), csi.NewNodeClient(b.conn)
	// The first call sets up the connection: not part of any pod start.
	if _, err := b.ident.Probe(ctx, &csi.ProbeRequest{}); err != nil {
		b.stop()
		return nil, err
	}
	return b, nil
}

func capability(fsType string) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	if fsType == "" {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}}
	}
	return c
}

// podStart is the three calls a pod start on a new volume waits for,
// timed apart.
type podStart struct{ create, stage, publish time.Duration }

func (p podStart) sum() time.Duration { return p.create + p.stage + p.publish }

// podStart creates a volume of size bytes (fsType "" for a block volume),
// stages and publishes it, as kubelet and the provisioner do, after the
// plugin has been idle for csiIdle, then
// removes it again (not timed).
func (b *csiBench) podStart(ctx context.Context, name, fsType string, size int64) (podStart, error) {
	var p podStart
	c := capability(fsType)
	time.Sleep(csiIdle)
	start := time.Now()
	cr, err := b.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{c}})
	p.create = time.Since(start)
	if err != nil {
		return p, fmt.Errorf("CreateVolume %s: %w", name, err)
	}
	id := cr.GetVolume().GetVolumeId()
	staging := filepath.Join(b.kubelet, "plugins/kubernetes.io/csi/sparsevol.csi.io", name, "globalmount")
	target := filepath.Join(b.kubelet, "pods", name, "volumes/kubernetes.io~csi/pv/mount")
	// kubelet makes the parent directories of both paths, and writes its
	// vol_data.json there, before it calls the driver: not the driver's
	// time.
	for _, p := range []string{staging, target} {
		if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
			return podStart{}, err
		}
	}
	start = time.Now()
	_, err = b.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: c})
	p.stage = time.Since(start)
	if err == nil {
		start = time.Now()
		_, err = b.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: c})
		p.publish = time.Since(start)
	}
	// Teardown, as kubelet and the provisioner do it after the pod.
	_, uerr := b.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
	_, serr := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
	_, derr := b.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
	for _, e := range []error{err, uerr, serr, derr} {
		if e != nil {
			return p, fmt.Errorf("volume %s: %w", name, e)
		}
	}
	return p, nil
}

// floor is what any driver's pod start costs here before it does any
// work: three calls that do nothing (Probe) over the same connection, one
// for each call of a pod start, and the one flush a durable create needs
// (a small file written and fsynced in the plugin's store), timed after
// the same idle as a pod start.
func (b *csiBench) floor(ctx context.Context) (time.Duration, error) {
	time.Sleep(csiIdle)
	start := time.Now()
	for range 3 {
		if _, err := b.ident.Probe(ctx, &csi.ProbeRequest{}); err != nil {
			return 0, fmt.Errorf("Probe: %w", err)
		}
	}
	f, err := os.CreateTemp(b.store, ".bench-floor-")
	if err != nil {
		return 0, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if _, err := f.Write(make([]byte, 512)); err != nil {
		return 0, err
	}
	if err := f.Sync(); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// hostPathState is the record csi-driver-host-path keeps of its volumes,
// written whole on every change.
type hostPathState struct {
	Volumes []hostPathVolume `json:"volumes"`
}

type hostPathVolume struct {
	VolName, VolID, VolPath, VolAccessType string
	VolSize                                int64
	NodeID                                 string
}

// hostPathStart is what csi-driver-host-path does for the same three
// calls on a block volume, step by step as it does them: CreateVolume
// runs `fallocate` and writes its state file; NodePublish (it does no
// staging) runs `losetup --find --show` on the file and bind-mounts the
// device onto the target with `mount`. Each external step is a process,
// as there. durable adds `sync` of the state file and the volume's file
// to the create, which host-path does not do: what its create costs when
// it promises what sparsevol's does, that the volume survives a power
// cut. Removes it all again (not timed).
func hostPathStart(ctx context.Context, dir, name string, size int64, st *hostPathState, durable bool) (podStart, error) {
	var p podStart
	file := filepath.Join(dir, name)
	state := filepath.Join(dir, "state.json")
	target := filepath.Join(dir, "pods", name, "mount")
	var dev string
	start := time.Now()
	_, err := run(ctx, "fallocate", "--length", fmt.Sprint(size), file)
	if err == nil {
		st.Volumes = append(st.Volumes, hostPathVolume{VolName: name, VolID: name, VolPath: file, VolAccessType: "block", VolSize: size, NodeID: "bench"})
		var data []byte
		if data, err = json.Marshal(st); err == nil {
			err = os.WriteFile(state, data, 0o600)
		}
		if err == nil && durable {
			_, err = run(ctx, "sync", file, state)
		}
	}
	p.create = time.Since(start)
	if err == nil {
		start = time.Now()
		if dev, err = run(ctx, "losetup", "--find", "--show", file); err == nil {
			if err = os.MkdirAll(filepath.Dir(target), 0o750); err == nil {
				var f *os.File
				if f, err = os.OpenFile(target, os.O_CREATE|os.O_RDONLY, 0o600); err == nil {
					f.Close()
					_, err = run(ctx, "mount", "--bind", dev, target)
				}
			}
		}
		p.publish = time.Since(start)
	}
	if dev != "" {
		run(ctx, "umount", target)
		run(ctx, "losetup", "-d", dev)
	}
	st.Volumes = st.Volumes[:len(st.Volumes)-1]
	os.Remove(file)
	return p, err
}

// startHog runs what a busy neighbour does beside the measurements: one
// process spinning on each CPU, and one writing 64 MiB to the scratch
// filesystem and flushing it, over and over. The returned function stops
// them.
func startHog(dir string) (func(), error) {
	var cmds []*exec.Cmd
	stop := func() {
		for _, c := range cmds {
			c.Process.Kill()
			c.Wait()
		}
		os.Remove(filepath.Join(dir, "hog"))
	}
	scripts := []string{fmt.Sprintf("while :; do dd if=/dev/zero of=%s bs=1M count=64 conv=fdatasync status=none; done", filepath.Join(dir, "hog"))}
	for range runtime.NumCPU() {
		scripts = append(scripts, "while :; do :; done")
	}
	for _, s := range scripts {
		c := exec.Command("sh", "-c", s)
		if err := c.Start(); err != nil {
			stop()
			return nil, err
		}
		cmds = append(cmds, c)
	}
	time.Sleep(time.Second) // let the writer fill the page cache
	return stop, nil
}

// runCSI: the CSI calls a pod start on a new volume waits for, through
// the plugin's real socket, against csi-driver-host-path's steps done by
// hand in the same run, idle and beside a CPU and disk hog; and
// filesystem volumes against mkfs of the same size alone.
func runCSI(ctx context.Context, c *config, r *report) error {
	b, err := startPlugin(ctx, c)
	if err != nil {
		return err
	}
	defer b.stop()
	hand := filepath.Join(c.dir, "hostpath")
	if err := os.Mkdir(hand, 0o700); err != nil {
		return err
	}
	const blockSize = 64 << 20
	sec := fmt.Sprintf("CSI: CreateVolume + NodeStage + NodePublish of a %s block volume, median of %d (ratio: host-path by hand / sparsevol)", human(blockSize), csiRuns)
	for _, pass := range []struct {
		name string
		hog  bool
		goal float64
	}{{"idle", false, 5}, {"beside a CPU and disk hog", true, 3}} {
		stopHog := func() {}
		if pass.hog {
			if stopHog, err = startHog(c.dir); err != nil {
				return err
			}
		}
		var ours, theirs, durable []podStart
		var floors []time.Duration
		st := &hostPathState{}
		for i := range csiRuns {
			p, err := b.podStart(ctx, fmt.Sprintf("pvc-%s-%d", strings.Fields(pass.name)[0], i), "", blockSize)
			if err == nil {
				var f time.Duration
				f, err = b.floor(ctx)
				floors = append(floors, f)
			}
			if err == nil {
				ours = append(ours, p)
				p, err = hostPathStart(ctx, hand, fmt.Sprintf("hp-%d", i), blockSize, st, false)
				theirs = append(theirs, p)
			}
			if err == nil {
				p, err = hostPathStart(ctx, hand, fmt.Sprintf("hp-%d", i), blockSize, st, true)
				durable = append(durable, p)
			}
			if err != nil {
				stopHog()
				return err
			}
		}
		stopHog()
		o, osum := medianStart(ours)
		t, tsum := medianStart(theirs)
		ratio := tsum.Seconds() / osum.Seconds()
		r.add(row{section: sec, name: "sum, " + pass.name, value: msp(osum), baseline: "host-path steps " + msp(tsum),
			ratio: ratio, target: fmt.Sprintf(">= %g", pass.goal), met: check(ratio >= pass.goal)})
		r.add(row{section: sec, name: "CreateVolume, " + pass.name, value: msp(o.create), baseline: "fallocate + state file " + msp(t.create),
			ratio: t.create.Seconds() / o.create.Seconds()})
		_, dsum := medianStart(durable)
		r.add(row{section: sec, name: "sum, " + pass.name + ", vs durable host-path steps", value: msp(osum),
			baseline: "host-path steps + `sync` of file and state " + msp(dsum), ratio: dsum.Seconds() / osum.Seconds()})
		f := median(floors)
		r.add(row{section: sec, name: "floor, " + pass.name + ": 3 empty gRPC calls + 1 flush (what a driver doing nothing else would reach)",
			value: msp(f), baseline: "host-path steps " + msp(tsum), ratio: tsum.Seconds() / f.Seconds()})
		r.note("CSI %s, medians: sparsevol CreateVolume %s, NodeStage %s, NodePublish %s; host-path by hand CreateVolume (fallocate, state file) %s, NodePublish (losetup, mount --bind) %s.",
			pass.name, msp(o.create), msp(o.stage), msp(o.publish), msp(t.create), msp(t.publish))
	}
	fsSec := fmt.Sprintf("CSI: CreateVolume + NodeStage + NodePublish of a filesystem volume, median of %d (ratio: mkfs alone / sparsevol)", csiRuns)
	for _, fs := range []struct {
		name string
		size int64
		mkfs []string
	}{{"ext4", 64 << 20, []string{"mkfs.ext4", "-q", "-F"}}, {"xfs", 300 << 20, []string{"mkfs.xfs", "-q", "-f"}}} {
		var ours []podStart
		var mkfs, floors []time.Duration
		for i := range csiRuns {
			p, err := b.podStart(ctx, fmt.Sprintf("pvc-%s-%d", fs.name, i), fs.name, fs.size)
			if err != nil {
				return err
			}
			ours = append(ours, p)
			f, err := b.floor(ctx)
			if err != nil {
				return err
			}
			floors = append(floors, f)
			img := filepath.Join(hand, "mkfs-"+fs.name)
			if err := os.WriteFile(img, nil, 0o600); err != nil {
				return err
			}
			if err := os.Truncate(img, fs.size); err != nil {
				return err
			}
			d, err := timeIt(func() error { _, err := run(ctx, fs.mkfs[0], append(fs.mkfs[1:], img)...); return err })
			if err != nil {
				return err
			}
			mkfs = append(mkfs, d)
			os.Remove(img)
		}
		o, osum := medianStart(ours)
		m := median(mkfs)
		r.add(row{section: fsSec, name: fmt.Sprintf("%s, %s", fs.name, human(float64(fs.size))), value: msp(osum),
			baseline: fmt.Sprintf("`%s` of a %s file %s", fs.mkfs[0], human(float64(fs.size)), msp(m)),
			ratio:    m.Seconds() / osum.Seconds(), target: ">= 0.83 (within 1.2x)", met: check(osum.Seconds() <= 1.2*m.Seconds())})
		// The least any driver could reach: the three calls and the flush
		// of the floor, and the format; nothing mounted yet.
		least := median(floors) + m
		r.add(row{section: fsSec, name: fmt.Sprintf("%s, floor + mkfs: 3 empty gRPC calls + 1 flush + `%s` (what a driver that only formats would reach)", fs.name, fs.mkfs[0]),
			value: msp(least), baseline: fmt.Sprintf("`%s` alone %s", fs.mkfs[0], msp(m)), ratio: m.Seconds() / least.Seconds()})
		r.note("CSI %s, medians: CreateVolume %s, NodeStage %s, NodePublish %s; %s alone %s; floor %s.", fs.name, msp(o.create), msp(o.stage), msp(o.publish), fs.mkfs[0], msp(m), msp(median(floors)))
	}
	return nil
}

// medianStart is the median of each call's times, and of their sums.
func medianStart(ps []podStart) (podStart, time.Duration) {
	var c, s, p, sum []time.Duration
	for _, x := range ps {
		c, s, p, sum = append(c, x.create), append(s, x.stage), append(p, x.publish), append(sum, x.sum())
	}
	return podStart{create: median(c), stage: median(s), publish: median(p)}, median(sum)
}
