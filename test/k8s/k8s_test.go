//go:build e2e

// Package k8s proves sparsevol with a real Kubernetes node: kubelet,
// kube-apiserver, controller-manager, scheduler and etcd (built from their Go
// modules, see bins), containerd from Debian, in a qemu VM made from
// test/vm's image. The node reboots; pods must come back with their data.
// Run it with `make e2e-k8s`; see README.md here.
package k8s

import (
	"bufio"
	"bytes"
	"context"
	"embed"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/test/k8s/bins"
)

//go:embed guest
var guestFiles embed.FS

type config struct {
	cache       string // node image cache (the binaries' cache root too)
	work        string
	keep        bool
	memMiB      int
	cpus        int
	bootTimeout time.Duration
	repo        string
	goCmd       string
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, v, err)
	}
	return n
}

func loadConfig(t *testing.T) config {
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	goCmd := "go"
	if _, err := exec.LookPath("go"); err != nil {
		goCmd = "/usr/local/go/bin/go"
	}
	return config{
		cache:       bins.DefaultCache(),
		work:        os.Getenv("SPARSEVOL_K8S_WORK"),
		keep:        os.Getenv("SPARSEVOL_K8S_KEEP") != "",
		memMiB:      envInt(t, "SPARSEVOL_K8S_MEM", 4096),
		cpus:        envInt(t, "SPARSEVOL_K8S_CPUS", 2),
		bootTimeout: time.Duration(envInt(t, "SPARSEVOL_K8S_BOOT_TIMEOUT", 3000)) * time.Second,
		repo:        repo,
		goCmd:       goCmd,
	}
}

func logf(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	t.Log(msg)
	if !testing.Verbose() {
		fmt.Println(msg)
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	return tail(string(b), n)
}

func runCmd(name string, args ...string) error {
	var out bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %s: %v\n%s", name, strings.Join(args, " "), err, tail(out.String(), 30))
	}
	return nil
}

type step struct {
	name    string
	timeout time.Duration
}

type boot struct {
	name  string
	steps []step
	next  string // reboot | poweroff
}

type bootResult struct {
	boot
	err    error
	wall   time.Duration
	outDir string
}

type run struct {
	cfg     config
	img     nodeImage
	dir     string
	root    string
	share   string
	results map[string]*bootResult
}

func TestKubernetes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("the k8s VM test needs root (image build, loop mounts)")
	}
	for _, tool := range []string{"qemu-system-x86_64", "debootstrap", "mount", "chroot", "make"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("missing %s (apt-get install qemu-system-x86 debootstrap)", tool)
		}
	}
	total := time.Now()
	cfg := loadConfig(t)
	var figures []string
	fig := func(format string, args ...any) { figures = append(figures, fmt.Sprintf(format, args...)) }

	// 1. Node image (cached).
	img := buildNodeImage(t, cfg)
	if img.Built > 0 {
		fig("node image: built in %s", img.Built.Round(time.Second))
	}
	// 2. Binaries (cached).
	res, err := bins.Ensure(context.Background(), bins.Options{Cache: cfg.cache, Go: cfg.goCmd, Nice: 19, Log: testWriter{t}})
	if err != nil {
		t.Fatalf("binaries: %v", err)
	}
	if res.Cached {
		fig("binaries: cached in %s", res.Dir)
	} else {
		fig("binaries: built in %s (%s)", res.Elapsed.Round(time.Second), res.Dir)
	}
	// 3. This run's root disk.
	r := newRun(t, cfg, img, filepath.Join(res.Dir, "bin"))
	passed := false
	defer func() {
		if passed && !cfg.keep && cfg.work == "" {
			os.RemoveAll(r.dir)
		} else {
			logf(t, "run directory kept: %s (consoles, step logs, journals under share/out/)", r.dir)
		}
	}()

	const (
		short = 600 * time.Second
		long  = 900 * time.Second
	)
	plan := []boot{
		{name: "b1-setup", next: "reboot", steps: []step{
			{"cluster", long}, {"s1-setup", short}, {"s2-setup", short}, {"s3-setup", short}, {"s4-capacity", short},
		}},
		{name: "b2-after-reboot", next: "poweroff", steps: []step{
			{"cluster", long}, {"s2-check", short}, {"s3-check", short}, {"s1-check", short},
			{"s3-expand", short}, {"s5-cleanup", short},
		}},
	}
	for _, b := range plan {
		if br := r.boot(t, b); br.err != nil {
			break
		}
	}

	b1, b2 := r.results["b1-setup"], r.results["b2-after-reboot"]
	for _, b := range []*bootResult{b1, b2} {
		if b == nil || b.err != nil {
			continue
		}
		f := b.facts("cluster")
		fig("%s: apiserver ready at %ss, node Ready at %ss, plugin registered (CSINode) at %ss after boot; qemu run %s",
			b.name, f["apiserver_ready_uptime"], f["node_ready_uptime"], f["csinode_registered_uptime"], b.wall.Round(time.Second))
	}

	t.Run("0-cluster", func(t *testing.T) {
		r.needStep(t, b1, "cluster")
		r.needStep(t, b2, "cluster")
	})
	t.Run("1-seed-failure-reproduced", func(t *testing.T) {
		r.needStep(t, b1, "s1-setup")
		r.needStep(t, b2, "s1-check")
		if t.Failed() {
			return
		}
		f := b2.facts("s1-check")
		logf(t, "scenario 1: unit %s; after the reboot pod-s1 is %s/%s; kubelet at %ss: %s",
			b1.facts("s1-setup")["unit_enabled"], f["phase"], f["waiting_reason"], f["event_uptime"], f["event"])
	})
	t.Run("2-node-mode-fix", func(t *testing.T) {
		r.needStep(t, b1, "s2-setup")
		r.needStep(t, b2, "s2-check")
		if t.Failed() {
			return
		}
		f := b2.facts("s2-check")
		fig("scenario 2 (node mode, unit enabled): pod Ready %ss after boot (container started at %ss), data %s; unit %s",
			f["pod_ready_uptime"], f["started_uptime"], f["data"], f["unit_state"])
	})
	t.Run("3-csi-mode", func(t *testing.T) {
		r.needStep(t, b1, "s3-setup")
		r.needStep(t, b2, "s3-check")
		if t.Failed() {
			return
		}
		f := b2.facts("s3-check")
		fig("scenario 3 (CSI): filesystem pod Ready %ss after boot (data %s), block pod Ready %ss (data %s)",
			f["fs_ready_uptime"], f["fs_data"], f["block_ready_uptime"], f["block_data"])
	})
	t.Run("3b-csi-node-expansion", func(t *testing.T) {
		r.needStep(t, b2, "s3-expand")
		if t.Failed() {
			return
		}
		f := b2.facts("s3-expand")
		fig("scenario 3b (NodeExpandVolume, the test as resizer): ext4 %s KiB -> %s KiB, PVC capacity %s",
			f["size_before_kib"], f["size_after_kib"], f["pvc_capacity"])
	})
	t.Run("4-capacity", func(t *testing.T) {
		r.needStep(t, b1, "s4-capacity")
		if t.Failed() {
			return
		}
		f := b1.facts("s4-capacity")
		fig("scenario 4 (capacity): %s CSIStorageCapacity object(s), capacity %s, topology %s; 100Ti claim %s, pod %s: %q; store unchanged: %s",
			f["capacity_objects"], f["capacity"], f["capacity_topology"], f["pvc_phase"], f["pod_phase"], f["event"], f["store_unchanged"])
	})
	t.Run("5-cleanup", func(t *testing.T) {
		r.needStep(t, b2, "s5-cleanup")
	})
	fig("total: %s", time.Since(total).Round(time.Second))
	for _, f := range figures {
		logf(t, "figure: %s", f)
	}
	passed = !t.Failed()
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	logf(w.t, "%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func newRun(t *testing.T, cfg config, img nodeImage, binDir string) *run {
	t.Helper()
	dir := cfg.work
	var err error
	if dir == "" {
		dir, err = os.MkdirTemp("/var/tmp", "sparsevol-k8s-")
	} else {
		err = os.MkdirAll(dir, 0o755)
	}
	if err != nil {
		t.Fatal(err)
	}
	r := &run{cfg: cfg, img: img, dir: dir, root: filepath.Join(dir, "root.img"), share: filepath.Join(dir, "share"), results: map[string]*bootResult{}}
	logf(t, "run directory: %s", dir)
	for _, d := range []string{"boot", "state", "out", "guest", "deploy"} {
		os.RemoveAll(filepath.Join(r.share, d))
		if err := os.MkdirAll(filepath.Join(r.share, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t0 := time.Now()
	if err := runCmd("cp", "--sparse=always", "--reflink=auto", img.Disk, r.root); err != nil {
		t.Fatal(err)
	}
	// Guest scripts run from the share, so they change without an image
	// rebuild.
	err = fs.WalkDir(guestFiles, "guest", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, _ := guestFiles.ReadFile(p)
		return writeFile(filepath.Join(r.share, p), b, 0o755)
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{"csidriver.yaml", "storageclasses.yaml"} {
		if err := copyFile(filepath.Join(cfg.repo, "deploy/kubernetes", m), filepath.Join(r.share, "deploy", m), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	mnt := filepath.Join(dir, "mnt")
	os.MkdirAll(mnt, 0o755)
	if err := runCmd("mount", "-o", "loop", r.root, mnt); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmd := exec.Command("make", "-C", cfg.repo, "install", "DESTDIR="+mnt)
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	if err == nil {
		err = installNode(mnt, binDir)
	} else {
		err = fmt.Errorf("make install DESTDIR=%s: %v\n%s", mnt, err, tail(out.String(), 30))
	}
	if uerr := runCmd("umount", mnt); uerr != nil && err == nil {
		err = uerr
	}
	if err != nil {
		t.Fatal(err)
	}
	logf(t, "run: image copied, sparsevol and the node installed in %s", time.Since(t0).Round(100*time.Millisecond))
	return r
}

func (r *run) boot(t *testing.T, b boot) *bootResult {
	t.Helper()
	res := &bootResult{boot: b, outDir: filepath.Join(r.share, "out", b.name)}
	r.results[b.name] = res
	var steps strings.Builder
	for _, s := range b.steps {
		fmt.Fprintf(&steps, "%s %d\n", s.name, int(s.timeout.Seconds()))
	}
	for name, content := range map[string]string{"name": b.name + "\n", "steps": steps.String(), "next": b.next + "\n"} {
		if err := os.WriteFile(filepath.Join(r.share, "boot", name), []byte(content), 0o644); err != nil {
			res.err = err
			return res
		}
	}
	os.RemoveAll(res.outDir)
	console := filepath.Join(r.dir, "console-"+b.name+".log")
	args := []string{
		"-accel", "tcg", "-nodefaults", "-no-user-config", "-display", "none",
		"-m", strconv.Itoa(r.cfg.memMiB), "-smp", strconv.Itoa(r.cfg.cpus),
		"-no-reboot", "-nic", "none",
		"-serial", "file:" + console,
		"-kernel", r.img.Kernel, "-initrd", r.img.Initrd,
		"-append", "root=/dev/vda rw console=ttyS0 panic=-1",
		"-drive", "file=" + r.root + ",if=virtio,format=raw,cache=writeback",
		"-virtfs", "local,path=" + r.share + ",mount_tag=e2e,security_model=none,id=e2e",
	}
	cmd := exec.Command("qemu-system-x86_64", args...)
	qlog, _ := os.Create(filepath.Join(r.dir, "qemu-"+b.name+".log"))
	defer qlog.Close()
	cmd.Stdout, cmd.Stderr = qlog, qlog
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	logf(t, "boot %s: starting (steps: %s; then %s)", b.name, strings.TrimSpace(strings.ReplaceAll(steps.String(), "\n", ",")), b.next)
	if err := cmd.Start(); err != nil {
		res.err = err
		t.Errorf("qemu: %v", err)
		return res
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		if err != nil {
			res.err = fmt.Errorf("qemu exited: %v (%s)", err, tailFile(qlog.Name(), 5))
		}
	case <-time.After(r.cfg.bootTimeout):
		cmd.Process.Kill()
		<-exited
		res.err = fmt.Errorf("boot %s timed out after %s", b.name, r.cfg.bootTimeout)
	}
	res.wall = time.Since(start)
	if res.err == nil {
		if _, err := os.Stat(filepath.Join(res.outDir, "done")); err != nil {
			res.err = fmt.Errorf("boot %s: the guest driver did not finish", b.name)
		}
	}
	logf(t, "boot %s: qemu exited after %s", b.name, res.wall.Round(100*time.Millisecond))
	for _, s := range b.steps {
		ms, _ := os.ReadFile(filepath.Join(res.outDir, s.name+".ms"))
		rc, _ := os.ReadFile(filepath.Join(res.outDir, s.name+".rc"))
		logf(t, "boot %s: step %s: exit %s in %s ms", b.name, s.name, strings.TrimSpace(string(rc)), strings.TrimSpace(string(ms)))
	}
	if res.err != nil {
		t.Errorf("%v\nlast console lines (%s):\n%s", res.err, console, tailFile(console, 60))
	}
	return res
}

func (b *bootResult) facts(step string) map[string]string {
	f := map[string]string{}
	data, err := os.ReadFile(filepath.Join(b.outDir, step+".facts"))
	if err != nil {
		return f
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			f[k] = v
		}
	}
	return f
}

// needStep fails t unless the step ran and exited 0; on failure it prints
// the step's log (which holds the pod's events and the plugin's log) and
// the end of the plugin's journal.
func (r *run) needStep(t *testing.T, b *bootResult, step string) {
	t.Helper()
	if b == nil {
		t.Errorf("step %s: its boot did not run (an earlier boot failed)", step)
		return
	}
	if b.err != nil {
		t.Errorf("step %s: boot %s failed: %v", step, b.name, b.err)
		return
	}
	rc, err := os.ReadFile(filepath.Join(b.outDir, step+".rc"))
	if err != nil {
		t.Errorf("boot %s: step %s did not run", b.name, step)
		return
	}
	if strings.TrimSpace(string(rc)) != "0" {
		t.Errorf("boot %s: step %s exited %s; its log:\n%s\n---- plugin journal (sparsevol-csi, last 30 lines):\n%s",
			b.name, step, strings.TrimSpace(string(rc)),
			tailFile(filepath.Join(b.outDir, step+".log"), 80),
			tailFile(filepath.Join(b.outDir, "journal", "sparsevol-csi.log"), 30))
	}
}
