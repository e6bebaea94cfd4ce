package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/volume"
)

func timeIt(f func() error) (time.Duration, error) {
	start := time.Now()
	err := f()
	return time.Since(start), err
}

// proc runs the binary and returns its wall time and resource usage
// (peak RSS in KiB, page faults).
func proc(ctx context.Context, bin string, args ...string) (time.Duration, *syscall.Rusage, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	start := time.Now()
	err := cmd.Run()
	wall := time.Since(start)
	if err != nil {
		return wall, nil, fmt.Errorf("%s %s: %w: %s", bin, strings.Join(args, " "), err, stderr.String())
	}
	return wall, cmd.ProcessState.SysUsage().(*syscall.Rusage), nil
}

// runAttach: attach and detach of c.volumes volumes, engine against one
// losetup process per volume on the same files; attach --all at "boot"
// (everything detached) as a process, with its peak RSS.
func runAttach(ctx context.Context, c *config, r *report) error {
	s, err := openStore(c, "attach-store")
	if err != nil {
		return err
	}
	var files []string
	var uuids []string
	defer func() {
		s.DetachAll(volume.DetachOptions{})
		for _, u := range uuids {
			s.Delete(ctx, u, volume.DetachOptions{})
		}
	}()
	createStart := time.Now()
	files, uuids = make([]string, c.volumes), make([]string, c.volumes)
	var wg sync.WaitGroup
	errs := make(chan error, c.volumes)
	next := make(chan int)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				v, err := s.Create(ctx, volume.CreateRequest{Name: fmt.Sprintf("v%04d", i), SizeBytes: volume.MiB, Mode: volume.ModeBlock, NoPartition: true})
				if err != nil {
					errs <- err
					continue
				}
				files[i], uuids[i] = v.BackingFile, v.UUID
			}
		}()
	}
	for i := range c.volumes {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	fmt.Printf("  (created %d volumes in %v)\n", c.volumes, time.Since(createStart).Round(time.Millisecond))
	n := c.volumes

	// Rounds of: losetup processes attach and detach all; one
	// `sparsevol attach --all` process at "boot" (everything detached)
	// and one `detach --all`. Medians of the times, highest peak RSS.
	var loA, loD, boots, detaches []time.Duration
	var rss, losetupRSS int64
	for round := range c.rounds {
		var devs []string
		d, err := timeIt(func() error {
			for _, f := range files {
				cmd := exec.CommandContext(ctx, "losetup", "--find", "--show", f)
				out, err := cmd.Output()
				if err != nil {
					return fmt.Errorf("losetup --find --show %s: %w", f, err)
				}
				losetupRSS = max(losetupRSS, cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss*1024)
				devs = append(devs, strings.TrimSpace(string(out)))
			}
			return nil
		})
		if err != nil {
			return err
		}
		loA = append(loA, d)
		d, err = timeIt(func() error {
			for _, dev := range devs {
				if err := exec.CommandContext(ctx, "losetup", "-d", dev).Run(); err != nil {
					return fmt.Errorf("losetup -d %s: %w", dev, err)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		loD = append(loD, d)

		d, ru, err := proc(ctx, c.bin, "--root", s.Root(), "attach", "--all")
		if err != nil {
			return err
		}
		boots, rss = append(boots, d), max(rss, ru.Maxrss*1024)
		if round == 0 {
			sts, err := s.Statuses()
			if err != nil {
				return err
			}
			bound := 0
			for _, st := range sts {
				if st.Attached {
					bound++
				}
			}
			if bound != n {
				return fmt.Errorf("attach --all bound %d of %d volumes", bound, n)
			}
		}
		d, _, err = proc(ctx, c.bin, "--root", s.Root(), "detach", "--all")
		if err != nil {
			return err
		}
		detaches = append(detaches, d)
	}
	// The engine, one call per volume (what n unit starts do, minus
	// the process start), in this process; once, it is slow. After the
	// rounds, so that the loop devices exist, as they do for losetup's
	// later rounds.
	callAttach, err := timeIt(func() error {
		for _, u := range uuids {
			if _, err := s.Attach(ctx, u); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	callDetach, err := timeIt(func() error {
		for _, u := range uuids {
			if err := s.Detach(u, volume.DetachOptions{}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}

	losetupAttach, losetupDetach := median(loA), median(loD)
	bootAttach, bootDetach := median(boots), median(detaches)
	r.note("attach/detach rounds: losetup attach %v, sparsevol attach --all %v, losetup -d %v, sparsevol detach --all %v. The loop devices exist unbound after a detach, as after any detach; a real boot also creates them.",
		roundMS(loA), roundMS(boots), roundMS(loD), roundMS(detaches))
	sec := fmt.Sprintf("attach and detach of %d volumes (ratio: losetup time / sparsevol time)", n)
	lo := func(d time.Duration) string { return fmt.Sprintf("losetup ×%d %s", n, ms(d)) }
	r.add(row{section: sec, name: "attach, one call per volume (in-process, one round)", value: ms(callAttach), baseline: lo(losetupAttach),
		ratio: losetupAttach.Seconds() / callAttach.Seconds()})
	r.add(row{section: sec, name: "detach, one call per volume (in-process, one round)", value: ms(callDetach), baseline: "losetup -d " + lo(losetupDetach)[8:],
		ratio: losetupDetach.Seconds() / callDetach.Seconds()})
	boot := bootAttach.Seconds()
	r.add(row{section: sec, name: "boot: `attach --all` process, per-volume rate (median)", value: fmt.Sprintf("%.0f volumes/s", float64(n)/boot),
		baseline: fmt.Sprintf("losetup %.0f volumes/s", float64(n)/losetupAttach.Seconds()), ratio: losetupAttach.Seconds() / boot,
		target: ">= 10", met: check(losetupAttach.Seconds()/boot >= 10)})
	r.add(row{section: sec, name: "boot: `attach --all` process, total time (median)", value: ms(bootAttach), baseline: "target 500 ms",
		ratio: 0.5 / boot, target: "< 0.5 s", met: check(boot < 0.5)})
	r.add(row{section: sec, name: "`detach --all` process (median)", value: ms(bootDetach), baseline: "losetup -d " + lo(losetupDetach)[8:],
		ratio: losetupDetach.Seconds() / bootDetach.Seconds()})
	r.add(row{section: "peak RSS (ratio: limit or baseline / ours)", name: fmt.Sprintf("`attach --all` of %d volumes (highest of the rounds)", n), value: human(float64(rss)),
		baseline: "limit 25 MiB", ratio: float64(25<<20) / float64(rss), target: "< 25 MiB", met: check(rss < 25<<20)})
	r.add(row{section: "peak RSS (ratio: limit or baseline / ours)", name: fmt.Sprintf("`attach --all` of %d volumes, against one `losetup --find --show` process (for scale)", n), value: human(float64(rss)),
		baseline: "losetup " + human(float64(losetupRSS)), ratio: float64(losetupRSS) / float64(rss)})
	return runPerCall(ctx, c, r, s, uuids)
}

// runCreate: create + format of 1 GiB ext4 and XFS volumes, median of
// c.creates, against the same steps by hand (truncate, losetup, mkfs,
// losetup -d as processes).
func runCreate(ctx context.Context, c *config, r *report) error {
	s, err := openStore(c, "create-store")
	if err != nil {
		return err
	}
	for _, fs := range []string{"ext4", "xfs"} {
		var ours, hand []time.Duration
		for i := range c.creates {
			name := fmt.Sprintf("%s-%d", fs, i)
			d, err := timeIt(func() error {
				_, err := s.Create(ctx, volume.CreateRequest{Name: name, SizeBytes: 1 << 30, FSType: fs})
				return err
			})
			if err != nil {
				return err
			}
			ours = append(ours, d)
			if err := s.Delete(ctx, name, volume.DetachOptions{}); err != nil {
				return err
			}
			img := filepath.Join(c.dir, "hand-"+name)
			d, err = timeIt(func() error { return handCreate(ctx, img, fs) })
			if err != nil {
				return err
			}
			hand = append(hand, d)
			os.Remove(img)
		}
		mo, mh := median(ours), median(hand)
		r.add(row{section: fmt.Sprintf("create + format of a 1 GiB volume, median of %d (ratio: by hand / sparsevol)", c.creates),
			name: fs, value: ms(mo), baseline: "truncate+losetup+mkfs+losetup -d " + ms(mh), ratio: mh.Seconds() / mo.Seconds()})
	}
	return nil
}

func handCreate(ctx context.Context, img, fs string) error {
	f, err := os.OpenFile(img, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(1 << 30)
	f.Close()
	if err != nil {
		return err
	}
	dev, err := run(ctx, "losetup", "--find", "--show", img)
	if err != nil {
		return err
	}
	if fs == "ext4" {
		_, err = run(ctx, "mkfs.ext4", "-q", "-F", dev)
	} else {
		_, err = run(ctx, "mkfs.xfs", "-q", "-f", dev)
	}
	if _, derr := run(ctx, "losetup", "-d", dev); err == nil {
		err = derr
	}
	return err
}

// median of v; of an even count, the mean of the two middle values.
func median[T ~int64 | ~float64](v []T) T {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}

// runSpace: write 1 GiB into a thin ext4 volume, delete it, trim; the
// backing file's allocation before the write, with the data, and after.
func runSpace(ctx context.Context, c *config, r *report) error {
	s, err := openStore(c, "space-store")
	if err != nil {
		return err
	}
	v, err := s.Create(ctx, volume.CreateRequest{Name: "space", SizeBytes: 4 << 30, KeepAttached: true})
	if err != nil {
		return err
	}
	defer func() { s.Detach(v.UUID, volume.DetachOptions{}); s.Delete(ctx, v.UUID, volume.DetachOptions{}) }()
	st, err := s.Status(v.UUID)
	if err != nil {
		return err
	}
	dir := filepath.Join(c.dir, "mnt-space")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(st.DataDevice, dir, "ext4", 0, ""); err != nil {
		return err
	}
	defer unix.Unmount(dir, 0)
	fresh := st.AllocatedBytes // formatted, mounted, nothing written yet
	const gib = 1 << 30
	if err := writeFile(filepath.Join(dir, "data"), gib); err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(dir, "data")); err != nil {
		return err
	}
	res, err := s.Trim(ctx, v.UUID)
	if err != nil {
		return err
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		return err
	}
	nonFree := v.SizeBytes - int64(sfs.Bfree)*sfs.Bsize
	sec := "space: write 1 GiB into a 4 GiB thin ext4 volume, delete it, `sparsevol trim`"
	r.add(row{section: sec, name: "given back by trim / written", value: human(float64(res.ReclaimedBytes())), baseline: "written " + human(gib),
		ratio: float64(res.ReclaimedBytes()) / gib})
	r.add(row{section: sec, name: "allocated after trim vs the fresh filesystem's", value: human(float64(res.AllocatedAfter)),
		baseline: "fresh filesystem " + human(float64(fresh)), ratio: float64(fresh) / float64(res.AllocatedAfter),
		target: "within 5%", met: check(float64(res.AllocatedAfter) <= 1.05*float64(fresh))})
	r.add(row{section: sec, name: "allocated after trim vs the filesystem's non-free blocks", value: human(float64(res.AllocatedAfter)),
		baseline: "non-free " + human(float64(nonFree)), ratio: float64(nonFree) / float64(res.AllocatedAfter)})
	r.note("space: allocated %s fresh, %s with 1 GiB written and deleted (before trim), %s after trim; the filesystem reports %s used (df) and %s of non-free blocks (journal and inode tables included; ext4 initialises inode tables lazily, with zeroing discards that keep them as holes).",
		human(float64(fresh)), human(float64(res.AllocatedBefore)), human(float64(res.AllocatedAfter)), human(float64(res.FilesystemUsedBytes)), human(float64(nonFree)))
	return nil
}

func writeFile(path string, size int) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := make([]byte, 4<<20)
	for i := range buf {
		buf[i] = byte(i*7 + i>>9)
	}
	for off := 0; off < size; off += len(buf) {
		buf[0]++
		if _, err := f.Write(buf); err != nil {
			return err
		}
	}
	return f.Sync()
}

func roundMS(ds []time.Duration) string {
	var parts []string
	for _, d := range ds {
		parts = append(parts, fmt.Sprintf("%.0f", float64(d)/float64(time.Millisecond)))
	}
	return "[" + strings.Join(parts, ", ") + "] ms"
}
