package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// fioTarget is one place the workload runs: a directory on some filesystem.
type fioTarget struct {
	name     string
	qd1Only  bool // measured on the queue-depth-1 random jobs only
	dir      string
	buffered bool   // a loop device without direct I/O: end_fsync=1, cold host cache
	backing  string // the loop device's backing file ("" for the ceiling)
}

type fioJob struct {
	name    string
	rw      string
	bs      string
	iodepth int
	seq     bool // report bandwidth, not IOPS
}

var fioJobs = []fioJob{
	{"seq write 1 MiB", "write", "1M", 8, true},
	{"seq read 1 MiB", "read", "1M", 8, true},
	{"rand write 4 KiB QD1", "randwrite", "4k", 1, false},
	{"rand read 4 KiB QD1", "randread", "4k", 1, false},
	{"rand write 4 KiB QD32", "randwrite", "4k", 32, false},
	{"rand read 4 KiB QD32", "randread", "4k", 32, false},
}

// runFio measures the ceiling (a file on the backing filesystem), the
// engine's default volume (direct I/O, loop block size from the store's
// alignment), the engine without direct I/O, and the best hand setup
// (losetup --direct-io=on --sector-size 4096), each with ext4 inside.
// Jobs run config by config for each workload, so drift in the machine's
// load spreads over all of them.
func runFio(ctx context.Context, c *config, r *report) error {
	s, err := openStore(c, "fio-store")
	if err != nil {
		return err
	}
	var cleanups []func()
	defer func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}()
	mount := func(dev, name string) (string, error) {
		dir := filepath.Join(c.dir, "mnt-"+name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return "", err
		}
		if err := unix.Mount(dev, dir, "ext4", 0, ""); err != nil {
			return "", fmt.Errorf("mount %s: %w", dev, err)
		}
		cleanups = append(cleanups, func() { unix.Unmount(dir, 0) })
		return dir, nil
	}

	ceiling := filepath.Join(c.dir, "ceiling")
	if err := os.Mkdir(ceiling, 0o755); err != nil {
		return err
	}
	targets := []*fioTarget{{name: "backing file (ceiling)", dir: ceiling}}

	off := false
	for _, spec := range []struct {
		name     string
		directIO *bool
	}{{"sparsevol", nil}, {"sparsevol, buffered", &off}} {
		v, err := s.Create(ctx, volume.CreateRequest{Name: fmt.Sprintf("fio-%d", len(targets)), SizeBytes: 2 << 30, DirectIO: spec.directIO, KeepAttached: true})
		if err != nil {
			return err
		}
		cleanups = append(cleanups, func() { s.Detach(v.UUID, volume.DetachOptions{}); s.Delete(ctx, v.UUID, volume.DetachOptions{}) })
		st, err := s.Status(v.UUID)
		if err != nil {
			return err
		}
		dir, err := mount(st.DataDevice, v.Name)
		if err != nil {
			return err
		}
		name := fmt.Sprintf("%s (dio=%v, %d-byte sectors)", spec.name, st.DirectIOActive, v.BlockSize)
		targets = append(targets, &fioTarget{name: name, dir: dir, buffered: !st.DirectIOActive, backing: v.BackingFile})
		if spec.directIO == nil && !st.DirectIOActive {
			r.note("the default volume runs without direct I/O here (the kernel refused it)")
		}
	}

	// By hand: the best setup a user could make (4096-byte sectors), and
	// the same with 512-byte sectors, which answers whether the sector
	// size matters (measured where it does: random I/O at QD1).
	for _, sectors := range []string{"512", "4096"} {
		hand := filepath.Join(c.dir, "hand"+sectors+".img")
		if err := os.WriteFile(hand, nil, 0o600); err != nil {
			return err
		}
		if err := os.Truncate(hand, 2<<30); err != nil {
			return err
		}
		dev, err := run(ctx, "losetup", "--find", "--show", "--direct-io=on", "--sector-size", sectors, hand)
		if err != nil {
			return err
		}
		cleanups = append(cleanups, func() { run(context.Background(), "losetup", "-d", dev) })
		if _, err := run(ctx, "mkfs.ext4", "-q", "-F", dev); err != nil {
			return err
		}
		handDir, err := mount(dev, "hand"+sectors)
		if err != nil {
			return err
		}
		targets = append(targets, &fioTarget{name: "losetup --direct-io=on --sector-size " + sectors, dir: handDir, backing: hand, qd1Only: sectors == "512"})
	}

	// Lay the files out for real (no fallocate: reads of unwritten
	// extents never reach the disk).
	for _, t := range targets {
		if _, err := fio(ctx, c, t, fioJob{"prefill", "write", "1M", 8, true}, false); err != nil {
			return err
		}
	}
	r.note("fio: %s file per target, %v per job after 1 s of ramp, median of %d rounds.", c.fileSize, c.runtime, c.rounds)
	r.note("fio: rows of the buffered loop device can exceed 1.00 on reads: fio's direct=1 bypasses the volume's page cache, but the loop device then reads the backing file through the host's page cache (the double caching direct I/O removes), which the ceiling row never uses; its page cache is dropped before each job, not during it.")
	for _, j := range fioJobs {
		// Rounds over all targets, the median per target: load from
		// other work on the machine hits every target alike.
		samples := make([][]float64, len(targets))
		qd1 := !j.seq && j.iodepth == 1
		for round := range c.rounds {
			// Each round starts one target later: no target always runs
			// right after the same neighbour (say, the buffered device's
			// writeback), so order does not bias the medians.
			for k := range targets {
				i := (k + round) % len(targets)
				t := targets[i]
				if t.qd1Only && !qd1 {
					continue
				}
				v, err := fio(ctx, c, t, j, true)
				if err != nil {
					return err
				}
				samples[i] = append(samples[i], v)
			}
		}
		results := make([]float64, len(targets))
		for i := range samples {
			if len(samples[i]) > 0 {
				results[i] = median(samples[i])
			}
		}
		unit := func(v float64) string {
			if j.seq {
				return human(v) + "/s"
			}
			return fmt.Sprintf("%.0f IOPS", v)
		}
		ceil := results[0]
		for i, t := range targets[1:] {
			if results[i+1] == 0 {
				continue
			}
			rw := row{section: "fio through an ext4 volume (ratio to the backing file)",
				name:  j.name + ": " + t.name,
				value: unit(results[i+1]), baseline: "backing file " + unit(ceil), ratio: results[i+1] / ceil}
			if i == 0 && j.seq {
				rw.target = ">= 0.90"
				rw.met = check(rw.ratio >= 0.90)
			}
			r.add(rw)
		}
		hand := results[len(results)-1]
		rw := row{section: "fio: sparsevol default against the best hand setup (losetup --direct-io=on --sector-size 4096)",
			name:  j.name,
			value: unit(results[1]), baseline: "losetup " + unit(hand), ratio: results[1] / hand}
		if j.iodepth == 32 {
			rw.target, rw.met = ">= 0.95", check(results[1]/hand >= 0.95)
			r.note("fio %s: sparsevol reaches %.2f of the ceiling and the hand setup %.2f. What caps both is the kernel's loop driver, not their settings: every request goes to the device's worker thread, which resubmits it to the backing file, one device queue at a time.",
				j.name, results[1]/ceil, hand/ceil)
		}
		r.add(rw)
		if qd1 {
			h512 := results[len(results)-2]
			r.add(row{section: "fio: does the loop sector size matter? (losetup, direct I/O, ratio 4096 / 512)",
				name: j.name, value: unit(hand), baseline: "512-byte sectors " + unit(h512), ratio: hand / h512})
		}
	}
	return nil
}

// fio runs one job on t and returns bandwidth (bytes/s) for sequential
// jobs, IOPS otherwise.
func fio(ctx context.Context, c *config, t *fioTarget, j fioJob, timed bool) (float64, error) {
	args := []string{"--output-format=json", "--name=" + j.rw,
		"--filename=" + filepath.Join(t.dir, "fio.dat"), "--size=" + c.fileSize,
		"--direct=1", "--ioengine=libaio", "--rw=" + j.rw, "--bs=" + j.bs,
		"--iodepth=" + strconv.Itoa(j.iodepth), "--fallocate=none", "--randrepeat=0"}
	if timed {
		args = append(args, "--time_based", "--ramp_time=1",
			"--runtime="+strconv.Itoa(int(c.runtime.Seconds())))
	}
	if t.buffered {
		args = append(args, "--end_fsync=1")
		if t.backing != "" {
			dropCache(t.backing)
		}
	}
	out, err := run(ctx, "fio", args...)
	if err != nil {
		return 0, err
	}
	v, err := parseFio([]byte(out), j)
	if err != nil {
		return 0, fmt.Errorf("fio %s on %s: %w", j.name, t.name, err)
	}
	return v, nil
}

type fioOutput struct {
	Jobs []struct {
		Read  fioStats `json:"read"`
		Write fioStats `json:"write"`
	} `json:"jobs"`
}

type fioStats struct {
	BwBytes float64 `json:"bw_bytes"`
	IOPS    float64 `json:"iops"`
}

func parseFio(out []byte, j fioJob) (float64, error) {
	// fio may print warnings before the JSON document.
	if i := bytes.IndexByte(out, '{'); i > 0 {
		out = out[i:]
	}
	var o fioOutput
	if err := json.Unmarshal(out, &o); err != nil {
		return 0, fmt.Errorf("parse fio json: %w", err)
	}
	if len(o.Jobs) == 0 {
		return 0, fmt.Errorf("fio json has no jobs")
	}
	st := o.Jobs[0].Read
	if j.rw == "write" || j.rw == "randwrite" {
		st = o.Jobs[0].Write
	}
	if j.seq {
		return st.BwBytes, nil
	}
	return st.IOPS, nil
}

// dropCache evicts a backing file from the host page cache, so a buffered
// loop device reads from the disk like the others do.
func dropCache(path string) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	unix.Fdatasync(int(f.Fd()))
	unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
}
