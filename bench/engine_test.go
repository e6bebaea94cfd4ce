// Package bench holds the project's benchmarks that compare the engine with
// the tools it replaces. Run with `make bench`; every figure is measured in
// the same run as its baseline.
package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// engineBinary builds cmd/sparsevol once per run, for measurements of the
// real process (peak RSS).
func engineBinary(b *testing.B) string {
	b.Helper()
	out := filepath.Join(b.TempDir(), "sparsevol")
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, "../cmd/sparsevol")
	if msg, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build: %v: %s", err, msg)
	}
	return out
}

func newStore(b *testing.B) *volume.Store {
	b.Helper()
	testutil.RequireRoot(b)
	s, err := volume.Open(b.TempDir(), volume.Options{})
	if err != nil {
		b.Fatal(err)
	}
	return s
}

// BenchmarkAttachDetach200 attaches and detaches 200 volumes through the
// engine — one call per volume (as 200 unit starts do, each scanning the
// bound devices), and batched (attach --all / detach --all, one scan) — and
// the same 200 files with `losetup --find --show` and `losetup -d`
// processes, in the same run, and reports the ratios.
func BenchmarkAttachDetach200(b *testing.B) {
	const n = 200
	ctx := context.Background()
	s := newStore(b)
	var uuids, files []string
	for i := range n {
		v, err := s.Create(ctx, volume.CreateRequest{Name: fmt.Sprintf("v%03d", i), SizeBytes: volume.MiB, Mode: volume.ModeBlock, NoPartition: true})
		if err != nil {
			b.Fatal(err)
		}
		uuids = append(uuids, v.UUID)
		files = append(files, v.BackingFile)
	}
	b.Cleanup(func() {
		s.DetachAll(volume.DetachOptions{})
		for _, u := range uuids {
			s.Delete(ctx, u, volume.DetachOptions{})
		}
	})
	timeIt := func(f func()) time.Duration {
		start := time.Now()
		f()
		return time.Since(start)
	}
	b.ResetTimer()
	for range b.N {
		var devs []string
		losetupAttach := timeIt(func() {
			for _, f := range files {
				out, err := exec.Command("losetup", "--find", "--show", f).Output()
				if err != nil {
					b.Fatal(err)
				}
				devs = append(devs, strings.TrimSpace(string(out)))
			}
		})
		losetupDetach := timeIt(func() {
			for _, d := range devs {
				if err := exec.Command("losetup", "-d", d).Run(); err != nil {
					b.Fatal(err)
				}
			}
		})
		callAttach := timeIt(func() {
			for _, u := range uuids {
				if _, err := s.Attach(ctx, u); err != nil {
					b.Fatal(err)
				}
			}
		})
		callDetach := timeIt(func() {
			for _, u := range uuids {
				if err := s.Detach(u, volume.DetachOptions{}); err != nil {
					b.Fatal(err)
				}
			}
		})
		batchAttach := timeIt(func() {
			if _, err := s.AttachAll(ctx); err != nil {
				b.Fatal(err)
			}
		})
		batchDetach := timeIt(func() {
			if err := s.DetachAll(volume.DetachOptions{}); err != nil {
				b.Fatal(err)
			}
		})
		ratio := func(a, b time.Duration) float64 { return float64(a) / float64(b) }
		b.ReportMetric(ratio(losetupAttach, callAttach), "per-call-attach-speedup")
		b.ReportMetric(ratio(losetupAttach, batchAttach), "batch-attach-speedup")
		b.ReportMetric(ratio(losetupAttach+losetupDetach, batchAttach+batchDetach), "batch-attach+detach-speedup")
		ms := func(d time.Duration) string { return d.Round(100 * time.Microsecond).String() }
		fmt.Printf("attach/detach of %d volumes (same run):\n", n)
		fmt.Printf("  losetup processes   attach %-9s detach %-9s\n", ms(losetupAttach), ms(losetupDetach))
		fmt.Printf("  engine, per call    attach %-9s detach %-9s  attach %.1fx, attach+detach %.1fx losetup's speed\n",
			ms(callAttach), ms(callDetach), ratio(losetupAttach, callAttach), ratio(losetupAttach+losetupDetach, callAttach+callDetach))
		fmt.Printf("  engine, batch       attach %-9s detach %-9s  attach %.1fx, attach+detach %.1fx losetup's speed\n",
			ms(batchAttach), ms(batchDetach), ratio(losetupAttach, batchAttach), ratio(losetupAttach+losetupDetach, batchAttach+batchDetach))
	}
}

// BenchmarkCreate1GiB times create (file, attach, mkfs, metadata) of a
// 1 GiB ext4 and a 1 GiB XFS volume; median of 5.
func BenchmarkCreate1GiB(b *testing.B) {
	ctx := context.Background()
	for _, fs := range []string{"ext4", "xfs"} {
		b.Run(fs, func(b *testing.B) {
			s := newStore(b)
			for range b.N {
				var times []time.Duration
				for i := range 5 {
					name := fmt.Sprintf("%s-%d", fs, i)
					start := time.Now()
					if _, err := s.Create(ctx, volume.CreateRequest{Name: name, SizeBytes: 1 << 30, FSType: fs}); err != nil {
						b.Fatal(err)
					}
					times = append(times, time.Since(start))
					if err := s.Delete(ctx, name, volume.DetachOptions{}); err != nil {
						b.Fatal(err)
					}
				}
				sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
				b.ReportMetric(float64(times[2].Milliseconds()), "ms/create")
				fmt.Printf("create 1 GiB %s: median %v of 5 (min %v, max %v)\n", fs, times[2].Round(time.Millisecond),
					times[0].Round(time.Millisecond), times[4].Round(time.Millisecond))
			}
		})
	}
}

// BenchmarkAttachAllRSS runs the real binary's `attach --all` over 200
// volumes and reports its wall time and peak RSS.
func BenchmarkAttachAllRSS(b *testing.B) {
	const n = 200
	ctx := context.Background()
	bin := engineBinary(b)
	s := newStore(b)
	for i := range n {
		if _, err := s.Create(ctx, volume.CreateRequest{Name: fmt.Sprintf("v%03d", i), SizeBytes: volume.MiB, Mode: volume.ModeBlock, NoPartition: true}); err != nil {
			b.Fatal(err)
		}
	}
	b.Cleanup(func() {
		vols, _ := s.List()
		for _, v := range vols {
			s.Delete(ctx, v.UUID, volume.DetachOptions{})
		}
	})
	for range b.N {
		start := time.Now()
		cmd := exec.Command(bin, "--root", s.Root(), "attach", "--all")
		cmd.Stdout, cmd.Stderr = nil, os.Stderr
		if err := cmd.Run(); err != nil {
			b.Fatal(err)
		}
		wall := time.Since(start)
		rss := cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss // KiB
		b.ReportMetric(float64(rss)/1024, "peak-RSS-MiB")
		b.ReportMetric(float64(wall.Milliseconds()), "attach-all-ms")
		devs, _ := loop.List()
		fmt.Printf("attach --all of %d volumes (process): %v, peak RSS %.1f MiB, %d loop devices bound\n", n, wall.Round(time.Millisecond), float64(rss)/1024, len(devs))
		if err := s.DetachAll(volume.DetachOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}
