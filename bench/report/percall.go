package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// perCallSamples is how many attach and detach calls each per-call
// measurement takes in one round; the rows are medians over the rounds.
const perCallSamples = 21

// callTimes are the times of one volume's attach and detach calls.
type callTimes struct{ attaches, detaches []time.Duration }

func (t callTimes) attach() time.Duration { return median(t.attaches) }
func (t callTimes) detach() time.Duration { return median(t.detaches) }

// timeCalls attaches and detaches the volumes refs in turn, perCallSamples
// times, with attach and detach timed apart, and adds the times to t: the
// number of bound devices stays what it was around each call.
func (t *callTimes) timeCalls(refs []string, attach, detach func(ref string) error) error {
	for i := range perCallSamples {
		ref := refs[i%len(refs)]
		d, err := timeIt(func() error { return attach(ref) })
		if err != nil {
			return err
		}
		t.attaches = append(t.attaches, d)
		if d, err = timeIt(func() error { return detach(ref) }); err != nil {
			return err
		}
		t.detaches = append(t.detaches, d)
	}
	return nil
}

// engineCalls is timeCalls through the engine, in this process.
func (t *callTimes) engineCalls(ctx context.Context, s *volume.Store, refs []string) error {
	return t.timeCalls(refs,
		func(ref string) error { _, err := s.Attach(ctx, ref); return err },
		func(ref string) error { return s.Detach(ref, volume.DetachOptions{}) })
}

// processCalls is timeCalls through `sparsevol attach UUID` and `detach
// UUID` processes: what a unit start and stop run.
func (t *callTimes) processCalls(ctx context.Context, c *config, s *volume.Store, refs []string) error {
	sv := func(op string) func(string) error {
		return func(ref string) error {
			_, _, err := proc(ctx, c.bin, "--root", s.Root(), op, ref)
			return err
		}
	}
	return t.timeCalls(refs, sv("attach"), sv("detach"))
}

// losetupCalls is timeCalls through `losetup --find --show FILE` and
// `losetup -d DEVICE` processes on the files.
func (t *callTimes) losetupCalls(ctx context.Context, files []string) error {
	devs := map[string]string{}
	return t.timeCalls(files,
		func(f string) error {
			out, err := run(ctx, "losetup", "--find", "--show", f)
			devs[f] = out
			return err
		},
		func(f string) error { _, err := run(ctx, "losetup", "-d", devs[f]); return err })
}

// runPerCall measures one volume's attach and detach call, in this process
// and as a process, against losetup's, with the store's other volumes
// bound and not, and against a store of ten volumes: every per-volume
// call should cost the same whatever the number of bound devices and
// volumes. s holds the volumes uuids; none is attached.
func runPerCall(ctx context.Context, c *config, r *report, s *volume.Store, uuids []string) error {
	const small = 10
	samples := uuids[:5]
	others := uuids[5:]
	scratch := filepath.Join(c.dir, "losetup-files")
	if err := os.Mkdir(scratch, 0o700); err != nil {
		return err
	}
	var files []string
	for i := range len(samples) {
		f := filepath.Join(scratch, fmt.Sprint(i))
		if err := os.WriteFile(f, make([]byte, volume.MiB), 0o600); err != nil {
			return err
		}
		files = append(files, f)
	}
	type config struct {
		name          string
		store         *volume.Store
		samples       []string
		bind          []string // bound around the calls
		inStore, nBnd int
	}
	smallStore, err := openStore(c, "small-store")
	if err != nil {
		return err
	}
	var smallUUIDs []string
	defer func() {
		smallStore.DetachAll(volume.DetachOptions{})
		for _, u := range smallUUIDs {
			smallStore.Delete(ctx, u, volume.DetachOptions{})
		}
	}()
	for i := range small {
		v, err := smallStore.Create(ctx, volume.CreateRequest{Name: fmt.Sprintf("s%02d", i), SizeBytes: volume.MiB, Mode: volume.ModeBlock, NoPartition: true})
		if err != nil {
			return err
		}
		smallUUIDs = append(smallUUIDs, v.UUID)
	}
	n := len(uuids)
	configs := []config{
		{"few bound", s, samples, others[:small-1], n, small},
		{"all bound", s, samples, others, n, n},
		{"small store", smallStore, smallUUIDs[:1], smallUUIDs[1:], small, small},
	}
	engine, procs := map[string]*callTimes{}, map[string]*callTimes{}
	lo := &callTimes{}
	// Rounds of every configuration in turn, so that a busy moment of
	// the machine spreads over all of them.
	for range c.rounds {
		for _, cf := range configs {
			if engine[cf.name] == nil {
				engine[cf.name], procs[cf.name] = &callTimes{}, &callTimes{}
			}
			if _, err := cf.store.AttachMany(ctx, cf.bind); err != nil {
				return fmt.Errorf("%s: bind the others: %w", cf.name, err)
			}
			if err := engine[cf.name].engineCalls(ctx, cf.store, cf.samples); err != nil {
				return fmt.Errorf("%s: %w", cf.name, err)
			}
			if err := procs[cf.name].processCalls(ctx, c, cf.store, cf.samples); err != nil {
				return fmt.Errorf("%s: %w", cf.name, err)
			}
			if cf.name == "all bound" {
				if err := lo.losetupCalls(ctx, files); err != nil {
					return err
				}
			}
			if err := cf.store.DetachAll(volume.DetachOptions{}); err != nil {
				return fmt.Errorf("%s: detach the others: %w", cf.name, err)
			}
		}
	}
	for _, cf := range configs {
		r.note("per call, %s (%d volumes in the store, %d bound): engine attach %s detach %s; process attach %s detach %s.",
			cf.name, cf.inStore, cf.nBnd, msp(engine[cf.name].attach()), msp(engine[cf.name].detach()), msp(procs[cf.name].attach()), msp(procs[cf.name].detach()))
	}
	sec := fmt.Sprintf("one volume's attach and detach call, %d volumes in the store and bound, median of %d (ratio: baseline time / ours)", n, perCallSamples*c.rounds)
	ratio := func(base, ours time.Duration) float64 { return base.Seconds() / ours.Seconds() }
	all := "all bound"
	for _, op := range []struct {
		name      string
		get       func(*callTimes) time.Duration
		losetup   string
		goal, pgo float64
	}{
		{"attach", (*callTimes).attach, "losetup --find --show", 1.5, 0.5},
		{"detach", (*callTimes).detach, "losetup -d", 1.5, 0.5},
	} {
		e, p, l := op.get(engine[all]), op.get(procs[all]), op.get(lo)
		r.add(row{section: sec, name: op.name + ", in-process", value: msp(e), baseline: op.losetup + " " + msp(l),
			ratio: ratio(l, e), target: fmt.Sprintf(">= %g", op.goal), met: check(ratio(l, e) >= op.goal)})
		r.add(row{section: sec, name: op.name + ", as a process (`sparsevol " + op.name + " UUID`)", value: msp(p), baseline: op.losetup + " " + msp(l),
			ratio: ratio(l, p), target: fmt.Sprintf(">= %g", op.pgo), met: check(ratio(l, p) >= op.pgo)})
	}
	flat := fmt.Sprintf("flat: one call with %d bound vs %d, with %d volumes in the store vs %d (ratio: the small case's time / the large one's)", n, small, n, small)
	for _, op := range []struct {
		name string
		get  func(*callTimes) time.Duration
	}{
		{"attach", (*callTimes).attach},
		{"detach", (*callTimes).detach},
	} {
		for _, kind := range []struct {
			name string
			t    map[string]*callTimes
		}{{"in-process", engine}, {"process", procs}} {
			few, big, sm := op.get(kind.t["few bound"]), op.get(kind.t[all]), op.get(kind.t["small store"])
			r.add(row{section: flat, name: fmt.Sprintf("%s, %s: %d bound", op.name, kind.name, n), value: msp(big),
				baseline: fmt.Sprintf("%d bound %s", small, msp(few)), ratio: ratio(few, big), target: ">= 0.83 (within 20%)", met: check(big.Seconds() <= 1.2*few.Seconds())})
			r.add(row{section: flat, name: fmt.Sprintf("%s, %s: %d volumes in the store (%d bound)", op.name, kind.name, n, small), value: msp(few),
				baseline: fmt.Sprintf("store of %d %s", small, msp(sm)), ratio: ratio(sm, few), target: ">= 0.83 (within 20%)", met: check(few.Seconds() <= 1.2*sm.Seconds())})
		}
	}
	return startTime(ctx, c, r, lo.attach())
}

// startTime compares `sparsevol --help` (and the plugin's, which starts
// once per node) with an empty Go program, all started as processes:
// what package initialisation costs every call. It also puts the empty
// Go program beside `/bin/true` and beside losetupAttach (the per-call
// rows' `losetup --find --show`): what any Go process costs on this host,
// and the ratio a Go command doing no work at all would reach in those
// rows. Minor page faults per start go to the notes: on a host where a
// fault is dear, they are most of a start.
func startTime(ctx context.Context, c *config, r *report, losetupAttach time.Duration) error {
	dir := filepath.Join(c.dir, "empty-go")
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte("package main\n\nfunc main() {}\n"), 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module empty\n"), 0o600); err != nil {
		return err
	}
	empty := filepath.Join(dir, "empty")
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", empty, ".")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build an empty Go program: %w: %s", err, strings.TrimSpace(string(out)))
	}
	const starts = 101
	progs := []struct {
		name string
		argv []string
		ds   []time.Duration
		flt  []int64
	}{
		{name: "`sparsevol --help`", argv: []string{c.bin, "--help"}},
		{name: "`sparsevol-csi --help` (the plugin)", argv: []string{c.plugin, "--help"}},
		{name: "empty Go program", argv: []string{empty}},
		{name: "`/bin/true`", argv: []string{"/bin/true"}},
	}
	for range starts {
		for i := range progs {
			p := &progs[i]
			d, ru, err := proc(ctx, p.argv[0], p.argv[1:]...)
			if err != nil {
				return err
			}
			p.ds, p.flt = append(p.ds, d), append(p.flt, ru.Minflt)
		}
	}
	sec := "process start, median of 101"
	base := median(progs[2].ds)
	for _, p := range progs[:2] {
		r.add(row{section: sec, name: p.name, value: msp(median(p.ds)),
			baseline: "empty Go program " + msp(base), ratio: base.Seconds() / median(p.ds).Seconds()})
	}
	r.add(row{section: sec, name: "empty Go program", value: msp(base),
		baseline: "`/bin/true` " + msp(median(progs[3].ds)), ratio: median(progs[3].ds).Seconds() / base.Seconds()})
	r.add(row{section: sec, name: "empty Go program, against one attach (what a Go command doing nothing would reach)", value: msp(base),
		baseline: "losetup --find --show " + msp(losetupAttach), ratio: losetupAttach.Seconds() / base.Seconds()})
	var faults []string
	for _, p := range progs {
		faults = append(faults, fmt.Sprintf("%s %d", p.name, median(p.flt)))
	}
	r.note("minor page faults per start (median): %s.", strings.Join(faults, ", "))
	return nil
}

// msp is ms with the precision of a single call's time.
func msp(d time.Duration) string {
	return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
}
