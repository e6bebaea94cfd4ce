//go:build e2e

package vm

import (
	"bytes"
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
)

//go:embed guest
var guestFiles embed.FS

type config struct {
	cache       string        // image cache root
	mirror      string        // Debian mirror for debootstrap
	work        string        // per-run directory (empty: a new one under /var/tmp)
	keep        bool          // keep the run directory even when everything passed
	memMiB      int           // guest memory
	cpus        int           // guest CPUs
	bootTimeout time.Duration // one boot, from qemu start to its exit (0: from the steps' limits)
	only        map[string]bool
	scaleCount  int
	scaleSize   string
	scaleGuest  bool   // create the scale set in the guest instead of offline
	repo        string // repository root (where `make install` runs)
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
	t.Helper()
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	c := config{
		cache:       env("SPARSEVOL_E2E_CACHE", "/var/cache/sparsevol-e2e"),
		mirror:      env("SPARSEVOL_E2E_MIRROR", "http://deb.debian.org/debian"),
		work:        os.Getenv("SPARSEVOL_E2E_WORK"),
		keep:        os.Getenv("SPARSEVOL_E2E_KEEP") != "",
		memMiB:      envInt(t, "SPARSEVOL_E2E_MEM", 1024),
		cpus:        envInt(t, "SPARSEVOL_E2E_CPUS", 2),
		bootTimeout: time.Duration(envInt(t, "SPARSEVOL_E2E_BOOT_TIMEOUT", 0)) * time.Second,
		scaleCount:  envInt(t, "SPARSEVOL_E2E_SCALE", 100),
		scaleSize:   env("SPARSEVOL_E2E_SCALE_SIZE", "16M"),
		scaleGuest:  os.Getenv("SPARSEVOL_E2E_SCALE_IN_GUEST") != "",
		repo:        repo,
	}
	if only := os.Getenv("SPARSEVOL_E2E_ONLY"); only != "" {
		c.only = map[string]bool{}
		for _, s := range strings.Split(only, ",") {
			c.only[strings.TrimSpace(s)] = true
		}
	}
	return c
}

// logf logs to the test and to stdout at once, so figures show in a plain
// `go test` run as well as in -v output.
func logf(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	t.Log(msg)
	if !testing.Verbose() {
		fmt.Println(msg)
	}
}

func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	return tail(string(b), n)
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func runCmd(name string, args ...string) error {
	var out bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %s: %v\n%s", name, strings.Join(args, " "), err, tail(out.String(), 30))
	}
	return nil
}

func requireHost(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("the VM test needs root (debootstrap, loop mounts of the image)")
	}
	var missing []string
	for _, tool := range []string{"qemu-system-x86_64", "debootstrap", "mkfs.ext4", "mount", "umount", "make", "cp", "truncate"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if len(missing) > 0 {
		t.Fatalf("missing tools: %s (apt-get install qemu-system-x86 debootstrap e2fsprogs make)", strings.Join(missing, " "))
	}
}

// run is one execution of the test: a private copy of the base image with
// sparsevol installed, a disk for the store scenario, and the 9p share.
type run struct {
	cfg      config
	img      image
	dir      string
	root     string // root disk, a sparse copy of the base image
	store    string // second disk, for scenario 4
	share    string // exported to the guest as /e2e
	results  map[string]*bootResult
	order    []string
	figures  []string
	scale    *scaleSet
	scaleErr error
}

func newRun(t *testing.T, cfg config, img image, install bool) *run {
	t.Helper()
	dir := cfg.work
	var err error
	if dir == "" {
		dir, err = os.MkdirTemp("/var/tmp", "sparsevol-e2e-")
	} else {
		err = os.MkdirAll(dir, 0o755)
	}
	if err != nil {
		t.Fatal(err)
	}
	r := &run{
		cfg:     cfg,
		img:     img,
		dir:     dir,
		root:    filepath.Join(dir, "root.img"),
		store:   filepath.Join(dir, "store.img"),
		share:   filepath.Join(dir, "share"),
		results: map[string]*bootResult{},
	}
	logf(t, "run directory: %s", dir)
	for _, d := range []string{"boot", "state", "out"} {
		os.RemoveAll(filepath.Join(r.share, d))
		if err := os.MkdirAll(filepath.Join(r.share, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t0 := time.Now()
	if err := runCmd("cp", "--sparse=always", "--reflink=auto", img.Disk, r.root); err != nil {
		t.Fatal(err)
	}
	os.Remove(r.store)
	if err := runCmd("truncate", "-s", "2G", r.store); err != nil {
		t.Fatal(err)
	}
	if err := r.copyGuestScripts(); err != nil {
		t.Fatal(err)
	}
	if err := r.prepareRoot(t, install); err != nil {
		t.Fatal(err)
	}
	logf(t, "run: image copied and prepared in %s", time.Since(t0).Round(100*time.Millisecond))
	return r
}

// copyGuestScripts puts the driver and step scripts on the share; the guest
// runs them from there.
func (r *run) copyGuestScripts() error {
	dst := filepath.Join(r.share, "guest")
	os.RemoveAll(dst)
	return fs.WalkDir(guestFiles, "guest", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		target := filepath.Join(r.share, p)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		b, err := guestFiles.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(target, b, 0o755)
	})
}

// prepareRoot mounts the run's root disk on the host and installs into it
// what a user would install (`make install DESTDIR=...` from this checkout)
// plus the test's own units: the kubelet stand-in and the driver.
func (r *run) prepareRoot(t *testing.T, install bool) error {
	mnt := filepath.Join(r.dir, "mnt")
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return err
	}
	if err := runCmd("mount", "-o", "loop", r.root, mnt); err != nil {
		return err
	}
	defer func() {
		if err := runCmd("umount", mnt); err != nil {
			t.Errorf("unmount image: %v", err)
		}
	}()
	if install {
		t0 := time.Now()
		var out bytes.Buffer
		cmd := exec.Command("make", "-C", r.cfg.repo, "install", "DESTDIR="+mnt)
		cmd.Stdout = &out
		cmd.Stderr = &out
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("make install DESTDIR=%s: %v\n%s", mnt, err, tail(out.String(), 40))
		}
		os.WriteFile(filepath.Join(r.dir, "make-install.log"), out.Bytes(), 0o644)
		if _, err := os.Stat(filepath.Join(mnt, "usr/local/bin/sparsevol")); err != nil {
			return fmt.Errorf("make install did not install usr/local/bin/sparsevol: %v\n%s", err, tail(out.String(), 40))
		}
		units, _ := filepath.Glob(filepath.Join(mnt, "*/systemd/system/sparsevol@.service"))
		more, _ := filepath.Glob(filepath.Join(mnt, "usr/*/systemd/system/sparsevol@.service"))
		more2, _ := filepath.Glob(filepath.Join(mnt, "usr/local/lib/systemd/system/sparsevol@.service"))
		units = append(append(units, more...), more2...)
		if len(units) == 0 {
			return fmt.Errorf("make install did not install sparsevol@.service\n%s", tail(out.String(), 40))
		}
		logf(t, "run: make install DESTDIR=<image>: %s (unit %s)", time.Since(t0).Round(100*time.Millisecond),
			strings.TrimPrefix(units[0], mnt))
	}
	lib := filepath.Join(mnt, "usr/local/lib/sparsevol-e2e")
	if err := os.MkdirAll(lib, 0o755); err != nil {
		return err
	}
	for _, f := range []struct{ src, dst string }{
		{"guest/kubelet.sh", "usr/local/lib/sparsevol-e2e/kubelet.sh"},
		{"guest/boot.sh", "usr/local/lib/sparsevol-e2e/boot.sh"},
		{"guest/kubelet.service", "etc/systemd/system/kubelet.service"},
		{"guest/e2e-driver.service", "etc/systemd/system/e2e-driver.service"},
	} {
		b, err := guestFiles.ReadFile(f.src)
		if err != nil {
			return err
		}
		mode := os.FileMode(0o644)
		if strings.HasSuffix(f.src, ".sh") {
			mode = 0o755
		}
		if err := os.WriteFile(filepath.Join(mnt, f.dst), b, mode); err != nil {
			return err
		}
	}
	wants := filepath.Join(mnt, "etc/systemd/system/multi-user.target.wants")
	if err := os.MkdirAll(wants, 0o755); err != nil {
		return err
	}
	for _, u := range []string{"kubelet.service", "e2e-driver.service"} {
		link := filepath.Join(wants, u)
		os.Remove(link)
		if err := os.Symlink("/etc/systemd/system/"+u, link); err != nil {
			return err
		}
	}
	return nil
}

// bootSpec is one boot of the VM: the steps the guest driver runs, and what
// happens at the end.
type bootSpec struct {
	name  string
	steps []stepSpec
	next  string // reboot | poweroff | kill
	// after runs on the host once the boot ended, before the next one.
	after func(t *testing.T, r *run)
}

type stepSpec struct {
	name     string
	scenario string
	timeout  time.Duration
}

type bootResult struct {
	spec     bootSpec
	wall     time.Duration // qemu start to qemu exit
	hostLoad string        // host load average when the boot started
	killed   bool          // ended by SIGKILL after the guest reported ready
	err      error         // the boot itself failed (timeout, crash, driver never ran)
	console  string
	outDir   string
	facts    map[string]string            // all steps' facts, merged
	steps    map[string]int               // step exit codes
	units    map[string]map[string]string // `systemctl show 'sparsevol@*'`, by unit id
	mounts   map[string]map[string]string
	journals map[string][]string // journal lines per sparsevol unit
	kubelet  kubeletView
}

// boot runs one boot and collects what the guest wrote.
func (r *run) boot(t *testing.T, spec bootSpec) *bootResult {
	t.Helper()
	res := &bootResult{spec: spec, outDir: filepath.Join(r.share, "out", spec.name)}
	r.results[spec.name] = res
	r.order = append(r.order, spec.name)

	var steps strings.Builder
	for _, s := range spec.steps {
		fmt.Fprintf(&steps, "%s %d\n", s.name, int(s.timeout.Seconds()))
	}
	bootDir := filepath.Join(r.share, "boot")
	writes := map[string]string{
		"name":  spec.name + "\n",
		"steps": steps.String(),
		"next":  spec.next + "\n",
		"env":   fmt.Sprintf("S7_COUNT=%d\nS7_SIZE=%s\n", r.cfg.scaleCount, r.cfg.scaleSize),
	}
	for name, content := range writes {
		if err := os.WriteFile(filepath.Join(bootDir, name), []byte(content), 0o644); err != nil {
			res.err = err
			return res
		}
	}
	os.RemoveAll(res.outDir)

	res.console = filepath.Join(r.dir, "console-"+spec.name+".log")
	args := []string{
		"-accel", "tcg",
		"-nodefaults", "-no-user-config",
		"-display", "none",
		"-m", strconv.Itoa(r.cfg.memMiB),
		"-smp", strconv.Itoa(r.cfg.cpus),
		"-no-reboot",
		"-serial", "file:" + res.console,
		"-kernel", r.img.Kernel,
		"-initrd", r.img.Initrd,
		// No CPU-bug mitigations: they only slow the emulated CPU down.
		"-append", "root=/dev/vda rw console=ttyS0 panic=-1 mitigations=off",
		"-drive", "file=" + r.root + ",if=virtio,format=raw,cache=writeback",
		"-drive", "file=" + r.store + ",if=virtio,format=raw,cache=writeback",
		"-virtfs", "local,path=" + r.share + ",mount_tag=e2e,security_model=none,id=e2e",
	}
	qlog, err := os.Create(filepath.Join(r.dir, "qemu-"+spec.name+".log"))
	if err != nil {
		res.err = err
		return res
	}
	defer qlog.Close()
	cmd := exec.Command("qemu-system-x86_64", args...)
	cmd.Stdout = qlog
	cmd.Stderr = qlog
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		res.hostLoad = strings.Fields(string(b))[0]
	}
	logf(t, "boot %s: starting (steps: %s; then %s; host load %s)", spec.name, stepNames(spec.steps), spec.next, res.hostLoad)
	if err := cmd.Start(); err != nil {
		res.err = fmt.Errorf("qemu: %v", err)
		return res
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	killMarker := filepath.Join(res.outDir, "kill-me")
	timeout := r.cfg.bootTimeout
	if timeout == 0 {
		// Boot and shutdown, plus every step's own limit.
		timeout = 4 * time.Minute
		for _, s := range spec.steps {
			timeout += s.timeout
		}
	}
	deadline := time.After(timeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
wait:
	for {
		select {
		case err := <-exited:
			if err != nil {
				res.err = fmt.Errorf("qemu exited: %v (%s)", err, tailFile(qlog.Name(), 5))
			}
			break wait
		case <-tick.C:
			if spec.next == "kill" {
				if _, err := os.Stat(killMarker); err == nil {
					cmd.Process.Signal(syscall.SIGKILL)
					<-exited
					res.killed = true
					break wait
				}
			}
		case <-deadline:
			cmd.Process.Signal(syscall.SIGKILL)
			<-exited
			res.err = fmt.Errorf("boot %s timed out after %s", spec.name, timeout)
			break wait
		}
	}
	res.wall = time.Since(start)
	if res.err == nil {
		if _, err := os.Stat(filepath.Join(res.outDir, "done")); err != nil {
			res.err = fmt.Errorf("boot %s: the guest driver did not finish (no %s)", spec.name, filepath.Join(res.outDir, "done"))
		}
	}
	how := "exited"
	if res.killed {
		how = "killed (hard reset)"
	}
	logf(t, "boot %s: qemu %s after %s", spec.name, how, res.wall.Round(100*time.Millisecond))
	if res.err != nil {
		t.Errorf("%v\nlast console lines (%s):\n%s", res.err, res.console, tailFile(res.console, 60))
	}
	res.load()
	for _, s := range spec.steps {
		if ms, err := os.ReadFile(filepath.Join(res.outDir, s.name+".ms")); err == nil {
			logf(t, "boot %s: step %s: exit %d in %s ms", spec.name, s.name, res.stepExit(s.name), strings.TrimSpace(string(ms)))
		}
	}
	return res
}

func stepNames(steps []stepSpec) string {
	var names []string
	for _, s := range steps {
		names = append(names, s.name)
	}
	return strings.Join(names, " ")
}

// pruneCache removes images of other keys (older recipes or package lists)
// and unfinished builds, so the cache holds one image.
func pruneCache(t *testing.T, cfg config, keep string) {
	entries, err := os.ReadDir(cfg.cache)
	if err != nil {
		return
	}
	for _, e := range entries {
		name := strings.TrimSuffix(e.Name(), ".partial")
		if !e.IsDir() || filepath.Join(cfg.cache, e.Name()) == keep || len(name) != 16 || strings.Trim(name, "0123456789abcdef") != "" {
			continue
		}
		manifest, _ := os.ReadFile(filepath.Join(cfg.cache, e.Name(), "complete"))
		if !strings.HasSuffix(e.Name(), ".partial") && !strings.HasPrefix(string(manifest), "key ") {
			continue // not an image of this package
		}
		logf(t, "image: removing old cache entry %s", e.Name())
		os.RemoveAll(filepath.Join(cfg.cache, e.Name()))
	}
}
