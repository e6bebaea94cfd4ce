// Command report runs the benchmark suite of issue 5 on this machine and
// writes bench/REPORT.md and bench/report.svg. Every row is a ratio against
// a baseline measured in the same run, because the machine is shared and
// absolute figures drift from run to run. Needs root, fio, losetup, mkfs.
//
//	go run ./bench/report -out bench
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/sparsevol/sparsevol/internal/volume"
)

type config struct {
	dir      string // scratch directory on the store's filesystem
	out      string // where REPORT.md and report.svg go
	bin      string // the sparsevol binary
	plugin   string // the sparsevol-csi binary
	runtime  time.Duration
	fileSize string
	volumes  int
	creates  int
	steps    string
	rounds   int
}

func main() {
	var c config
	flag.StringVar(&c.dir, "dir", "/var/tmp", "scratch directory; its filesystem is the backing filesystem measured")
	flag.StringVar(&c.out, "out", "bench", "directory for REPORT.md and report.svg")
	flag.StringVar(&c.bin, "bin", "bin/sparsevol", "sparsevol binary (for the process measurements)")
	flag.StringVar(&c.plugin, "plugin", "", "sparsevol-csi binary (for the CSI section; default: sparsevol-csi beside -bin)")
	flag.DurationVar(&c.runtime, "fio-runtime", 2*time.Second, "fio runtime per job and round")
	flag.IntVar(&c.rounds, "rounds", 3, "rounds of every fio job and of the attach/detach measurements (medians are reported)")
	flag.StringVar(&c.fileSize, "fio-size", "512M", "fio file size")
	flag.IntVar(&c.volumes, "volumes", 1000, "volumes for the attach/detach rows")
	flag.IntVar(&c.creates, "creates", 10, "creates per filesystem for the latency median")
	flag.StringVar(&c.steps, "steps", "fio,attach,create,space,snapshot,csi", "steps to run, comma separated")
	flag.Parse()
	log.SetFlags(0)
	if os.Geteuid() != 0 {
		log.Fatal("report: needs root (loop devices, mkfs, mount)")
	}
	for _, tool := range []string{"fio", "losetup", "mkfs.ext4", "mkfs.xfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			log.Fatalf("report: %s not found: %v", tool, err)
		}
	}
	bin, err := filepath.Abs(c.bin)
	if err != nil {
		log.Fatal(err)
	}
	c.bin = bin
	if c.plugin == "" {
		c.plugin = filepath.Join(filepath.Dir(c.bin), "sparsevol-csi")
	}
	if c.plugin, err = filepath.Abs(c.plugin); err != nil {
		log.Fatal(err)
	}
	scratch, err := os.MkdirTemp(c.dir, "sparsevol-bench-")
	if err != nil {
		log.Fatal(err)
	}
	if err := os.Chmod(scratch, 0o700); err != nil {
		log.Fatal(err)
	}
	c.dir = scratch
	code := measure(&c)
	os.RemoveAll(scratch) // not deferred: os.Exit skips defers
	os.Exit(code)
}

// measure runs the chosen steps and writes the report; it returns the exit
// code.
func measure(c *config) int {
	ctx := context.Background()
	r := &report{started: time.Now(), host: hostInfo(c.dir)}
	steps := []step{
		{"fio", runFio},
		{"attach", runAttach},
		{"create", runCreate},
		{"space", runSpace},
		{"snapshot", runSnapshot},
		{"csi", runCSI},
	}
	wanted := strings.Split(c.steps, ",")
	for _, name := range wanted {
		if !slices.ContainsFunc(steps, func(s step) bool { return s.name == name }) {
			log.Printf("report: unknown step %q (steps: fio, attach, create, space, snapshot, csi)", name)
			return 2
		}
	}
	failed := false
	for _, s := range steps {
		if !slices.Contains(wanted, s.name) {
			continue
		}
		log.Printf("== %s", s.name)
		if err := s.run(ctx, c, r); err != nil {
			log.Printf("%s: %v", s.name, err)
			failed = true
			r.notes = append(r.notes, fmt.Sprintf("%s failed in this run: %v", s.name, err))
		}
	}
	r.duration = time.Since(r.started)
	if err := r.write(c.out); err != nil {
		log.Print(err)
		return 1
	}
	fmt.Print(r.table())
	log.Printf("wrote %s and %s (%s)", filepath.Join(c.out, "REPORT.md"), filepath.Join(c.out, "report.svg"), r.duration.Round(time.Second))
	if failed {
		return 1
	}
	return 0
}

type step struct {
	name string
	run  func(context.Context, *config, *report) error
}

// openStore makes a store directory for one step under the scratch
// directory and opens it.
func openStore(c *config, name string) (*volume.Store, error) {
	root := filepath.Join(c.dir, name)
	if err := os.Mkdir(root, 0o700); err != nil {
		return nil, err
	}
	return volume.Open(root, volume.Options{})
}

func hostInfo(dir string) string {
	kernel, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	fsType := "?"
	if out, err := exec.Command("findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", dir).Output(); err == nil {
		fsType = strings.Join(strings.Fields(string(out)), " on ")
	}
	fioVersion, _ := exec.Command("fio", "--version").Output()
	return fmt.Sprintf("Linux %s, %d CPUs, backing filesystem %s, %s", strings.TrimSpace(string(kernel)),
		runtime.NumCPU(), fsType, strings.TrimSpace(string(fioVersion)))
}

// run executes a program without a shell and returns its trimmed stdout.
func run(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimSpace(string(out)), nil
}
