package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// snapshotStores are the stores the snapshot rows run on, each with the cp
// that does what sparsevol does there.
var snapshotStores = []struct {
	fs, name, cpFlag string
}{
	{"xfs", "reflink store (XFS reflink=1)", "--reflink=always"},
	{"ext4", "copy store (ext4)", "--sparse=always"},
}

const (
	snapVolumeSize = 10 << 30
	snapData       = 1 << 30
)

// runSnapshot: `sparsevol snapshot create` of a 10 GiB volume holding
// 1 GiB of data on a reflink and a copy store, against cp of the same
// backing file in the same run; the freeze a mounted volume's snapshot
// costs; export | import against cp --sparse=always.
func runSnapshot(ctx context.Context, c *config, r *report) error {
	for _, st := range snapshotStores {
		root, cleanup, err := loopStore(ctx, c, st.fs)
		if err != nil {
			return err
		}
		err = snapshotRows(ctx, c, r, root, st.name, st.cpFlag)
		if err == nil && st.fs == "ext4" {
			err = streamRows(ctx, c, r, root)
		}
		if err == nil {
			err = freezeNote(ctx, c, r, root, st.name)
		}
		cleanup()
		if err != nil {
			return fmt.Errorf("%s: %w", st.name, err)
		}
	}
	return nil
}

// loopStore makes a store on a loop-mounted filesystem of fsType in the
// scratch directory; cleanup unmounts it and detaches the device. The
// device does direct I/O to its image, as a disk would: a buffered one
// caches every write twice (the store's page cache, then the image's)
// and turns each flush into writing the image's dirty pages, which is
// not what a store on a disk pays (and hides writeback that overlaps a
// copy).
func loopStore(ctx context.Context, c *config, fsType string) (string, func(), error) {
	img := filepath.Join(c.dir, "snap-"+fsType+".img")
	f, err := os.Create(img)
	if err != nil {
		return "", nil, err
	}
	err = f.Truncate(3 * snapVolumeSize)
	f.Close()
	if err != nil {
		return "", nil, err
	}
	mkfs := []string{"mkfs.ext4", "-q", img}
	if fsType == "xfs" {
		mkfs = []string{"mkfs.xfs", "-q", "-m", "reflink=1", img}
	}
	if _, err := run(ctx, mkfs[0], mkfs[1:]...); err != nil {
		return "", nil, err
	}
	dev, err := run(ctx, "losetup", "--find", "--show", "--direct-io=on", img)
	if err != nil {
		return "", nil, err
	}
	root := filepath.Join(c.dir, "snap-"+fsType)
	cleanup := func() {
		run(ctx, c.bin, "--root", root, "detach", "--all")
		unix.Unmount(root, 0)
		run(ctx, "losetup", "-d", dev)
		os.Remove(img)
	}
	if err := os.Mkdir(root, 0o700); err != nil {
		cleanup()
		return "", nil, err
	}
	if _, err := run(ctx, "mount", dev, root); err != nil {
		cleanup()
		return "", nil, err
	}
	return root, cleanup, os.Chmod(root, 0o700)
}

// dataVolume creates a whole-device raw volume of snapVolumeSize holding
// snapData bytes of data in 64 extents spread over it, and returns its
// backing file.
func dataVolume(ctx context.Context, c *config, root, name string) (string, error) {
	uuid, err := run(ctx, c.bin, "--root", root, "create", name, "--size", "10G", "--mode", "block", "--no-partition", "--no-start")
	if err != nil {
		return "", err
	}
	path := filepath.Join(root, uuid)
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	const extents = 64
	buf := make([]byte, snapData/extents)
	for i := range buf {
		buf[i] = byte(i*7 + i>>9)
	}
	for i := range extents {
		buf[0] = byte(i)
		if _, err := f.WriteAt(buf, int64(i)*(snapVolumeSize/extents)); err != nil {
			return "", err
		}
	}
	return path, f.Sync()
}

// cpTimes times `cp flag src dst` and, in the same round, `cp flag src
// dst && sync dst`: sparsevol's snapshot is durable when it returns (its
// data and metadata fsynced), cp's copy is not until synced.
func cpTimes(ctx context.Context, flag, src, dst string) (plain, synced time.Duration, err error) {
	settle(ctx, dst)
	plain, err = timeIt(func() error { _, err := run(ctx, "cp", flag, src, dst); return err })
	os.Remove(dst)
	if err != nil {
		return 0, 0, err
	}
	settle(ctx, dst)
	synced, err = timeIt(func() error {
		if _, err := run(ctx, "cp", flag, src, dst); err != nil {
			return err
		}
		_, err := run(ctx, "sync", dst)
		return err
	})
	os.Remove(dst)
	return plain, synced, err
}

// settle writes back what the store's filesystem holds dirty (the last
// round's deletes, XFS's deferred extent frees), so that no measurement
// pays for the one before.
func settle(ctx context.Context, path string) {
	run(ctx, "sync", "-f", filepath.Dir(path))
}

// addCopyRows adds the rows of one sparsevol measurement against cp and
// against cp + sync.
func addCopyRows(r *report, section, name, cpFlag string, ours, plain, synced []time.Duration, value func(time.Duration) string, target bool) {
	mo, mp, ms2 := median(ours), median(plain), median(synced)
	rw := row{section: section, name: name, value: value(mo), baseline: "cp " + cpFlag + " " + value(mp), ratio: mp.Seconds() / mo.Seconds()}
	if target {
		rw.target, rw.met = "within 10%", check(mo.Seconds() <= 1.1*mp.Seconds())
	}
	r.add(rw)
	r.add(row{section: section, name: name + " vs a durable cp", value: value(mo),
		baseline: "cp " + cpFlag + " && sync FILE " + value(ms2), ratio: ms2.Seconds() / mo.Seconds()})
}

// snapshotRounds: at least this many rounds of the snapshot rows on
// each store (a reflink round costs milliseconds; a copy round seconds),
// since the shared host makes single rounds swing by a factor of two.
var snapshotRounds = map[string]int{"--reflink=always": 15, "--sparse=always": 5}

// rotate runs the measurements of round i starting with the (i mod n)th,
// so that none always follows the same one (a delete, a copy's
// writeback) or always comes first after the settle.
func rotate(i int, steps []func() error) error {
	for k := range steps {
		if err := steps[(i+k)%len(steps)](); err != nil {
			return err
		}
	}
	return nil
}

// loadAvg is the 1-minute load average, for the notes.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Fields(string(b))[0]
}

// stepLog collects the step durations of the "snapshot created" log
// records of the in-process store: copy, flush, record.
type stepLog struct {
	mu    sync.Mutex
	steps map[string][]time.Duration
}

func (l *stepLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *stepLog) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *stepLog) WithGroup(string) slog.Handler            { return l }
func (l *stepLog) Handle(_ context.Context, rec slog.Record) error {
	if rec.Message != "snapshot created" {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	rec.Attrs(func(a slog.Attr) bool {
		if a.Value.Kind() == slog.KindDuration {
			l.steps[a.Key] = append(l.steps[a.Key], a.Value.Duration())
		}
		return true
	})
	return nil
}

func snapshotRows(ctx context.Context, c *config, r *report, root, store, cpFlag string) error {
	src, err := dataVolume(ctx, c, root, "v")
	if err != nil {
		return err
	}
	steps := &stepLog{steps: map[string][]time.Duration{}}
	s, err := volume.Open(root, volume.Options{Logger: slog.New(steps)})
	if err != nil {
		return err
	}
	var ours, inproc, plain, synced []time.Duration
	load := loadAvg()
	for i := range max(c.rounds, snapshotRounds[cpFlag]) {
		name := fmt.Sprintf("s%d", i)
		err := rotate(i, []func() error{
			func() error {
				settle(ctx, src)
				d, _, err := proc(ctx, c.bin, "--root", root, "snapshot", "create", "v", name)
				if err != nil {
					return err
				}
				ours = append(ours, d)
				_, err = run(ctx, c.bin, "--root", root, "snapshot", "delete", name)
				return err
			},
			func() error {
				// In the process that serves it, as the CSI plugin does.
				settle(ctx, src)
				d, err := timeIt(func() error { _, err := s.CreateSnapshot(ctx, "v", name, volume.SnapshotOptions{}); return err })
				if err != nil {
					return err
				}
				inproc = append(inproc, d)
				return s.DeleteSnapshot(ctx, name)
			},
			func() error {
				p, s, err := cpTimes(ctx, cpFlag, src, filepath.Join(root, "cp-copy"))
				plain, synced = append(plain, p), append(synced, s)
				return err
			},
		})
		if err != nil {
			return err
		}
	}
	section := "snapshot of a 10 GiB volume holding 1 GiB, median (ratio: cp / sparsevol)"
	addCopyRows(r, section, store+", `sparsevol snapshot create` process", cpFlag, ours, plain, synced, ms, true)
	addCopyRows(r, section, store+", Store.CreateSnapshot in process (CSI)", cpFlag, inproc, plain, synced, ms, true)
	r.note("snapshot, %s: %d rounds in rotating order, load average %s before and %s after; sparsevol %s, in process %s, cp %s %s, with sync %s",
		store, len(ours), load, loadAvg(), roundMS(ours), roundMS(inproc), cpFlag, roundMS(plain), roundMS(synced))
	st := steps.steps
	if len(st["copy"]) != len(inproc) || len(st["flush"]) != len(inproc) || len(st["record"]) != len(inproc) {
		r.note("snapshot, %s: the store logged no step durations (an older sparsevol)", store)
		return nil
	}
	var rest []time.Duration
	for i, d := range inproc {
		rest = append(rest, d-st["copy"][i]-st["flush"][i]-st["record"][i])
	}
	r.note("snapshot, %s, in process, medians per step: copy %s, flush of the copy %s, ready record (one fsync) %s, "+
		"the rest (locks, space check, creating record, opening and proving the files) %s; the whole call %s",
		store, ms(median(st["copy"])), ms(median(st["flush"])), ms(median(st["record"])), ms(median(rest)), ms(median(inproc)))
	return nil
}

// streamRows: export | import (two processes and a pipe) of the data
// volume into a new volume of the same store, against cp --sparse=always.
func streamRows(ctx context.Context, c *config, r *report, root string) error {
	src := ""
	out, err := run(ctx, c.bin, "--root", root, "status", "v", "-o", "json")
	if err != nil {
		return err
	}
	var st struct {
		BackingFile string `json:"backingFile"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return err
	}
	src = st.BackingFile
	var ours, plain, synced []time.Duration
	load := loadAvg()
	for i := range max(c.rounds, snapshotRounds["--sparse=always"]) {
		err := rotate(i, []func() error{
			func() error {
				settle(ctx, src)
				d, err := timeIt(func() error { return exportImport(ctx, c.bin, root, "v", "imported") })
				if err != nil {
					return err
				}
				ours = append(ours, d)
				_, err = run(ctx, c.bin, "--root", root, "delete", "imported")
				return err
			},
			func() error {
				p, s, err := cpTimes(ctx, "--sparse=always", src, filepath.Join(root, "cp-copy"))
				plain, synced = append(plain, p), append(synced, s)
				return err
			},
		})
		if err != nil {
			return err
		}
	}
	rate := func(d time.Duration) string { return fmt.Sprintf("%.0f MiB/s", float64(snapData)/(1<<20)/d.Seconds()) }
	addCopyRows(r, "export | import of a 10 GiB volume holding 1 GiB, ext4 store, median (ratio: throughput / cp)",
		"sparsevol export v | sparsevol import w", "--sparse=always", ours, plain, synced, rate, false)
	r.note("export | import: %d rounds in rotating order, load average %s before and %s after; sparsevol %s, cp --sparse=always %s, with sync %s",
		len(ours), load, loadAvg(), roundMS(ours), roundMS(plain), roundMS(synced))
	return nil
}

// exportImport runs `sparsevol export ref | sparsevol import name`.
func exportImport(ctx context.Context, bin, root, ref, name string) error {
	exp := exec.CommandContext(ctx, bin, "--root", root, "export", ref)
	imp := exec.CommandContext(ctx, bin, "--root", root, "import", name, "--no-start")
	pr, pw, err := os.Pipe()
	if err != nil {
		return err
	}
	exp.Stdout, imp.Stdin = pw, pr
	var expErr, impErr strings.Builder
	exp.Stderr, imp.Stderr = &expErr, &impErr
	if err := imp.Start(); err != nil {
		return err
	}
	if err := exp.Start(); err != nil {
		return err
	}
	pr.Close()
	pw.Close()
	e1, e2 := exp.Wait(), imp.Wait()
	if e1 != nil || e2 != nil {
		return fmt.Errorf("export | import: %v %s / %v %s", e1, expErr.String(), e2, impErr.String())
	}
	return nil
}

var heldRE = regexp.MustCompile(`held=([0-9.]+[a-zµ]+)`)

// freezeNote: how long a snapshot of a mounted ext4 volume (10 GiB,
// 1 GiB of files) keeps it frozen, from the CLI's log.
func freezeNote(ctx context.Context, c *config, r *report, root, store string) error {
	uuid, err := run(ctx, c.bin, "--root", root, "create", "m", "--size", "10G")
	if err != nil {
		return err
	}
	dir := filepath.Join(c.dir, "mnt-freeze")
	os.Mkdir(dir, 0o700)
	if err := unix.Mount("/dev/sparsevol/"+uuid, dir, "ext4", 0, ""); err != nil {
		return err
	}
	defer unix.Unmount(dir, 0)
	if err := writeFile(filepath.Join(dir, "data"), snapData); err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, c.bin, "--root", root, "-v", "snapshot", "create", "m", "frozen")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	start := time.Now()
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("snapshot of a mounted volume: %w: %s", err, stderr.String())
	}
	total := time.Since(start)
	held := "?"
	if m := heldRE.FindStringSubmatch(stderr.String()); m != nil {
		held = m[1]
	}
	r.note("freeze, %s: a snapshot of a mounted 10 GiB ext4 volume holding 1 GiB kept it frozen for %s (the whole snapshot took %s)", store, held, ms(total))
	return nil
}
