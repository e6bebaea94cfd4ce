package vmrun

import (
	"bytes"
	"embed"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The guest side every suite shares: the boot hook, the driver, the step
// runner and the step library. See guest/lib.sh for what a step is.
//
//go:embed guest
var guestLib embed.FS

// Disk is an extra virtio disk of a run (/dev/vdb, /dev/vdc ... in order),
// a sparse file of Size made anew by NewRun.
type Disk struct {
	Name string // file name in the run directory
	Size string // truncate(1) size
}

// Suite is what a suite of scenarios adds to a run.
type Suite struct {
	Name string // run directories are /var/tmp/sparsevol-<Name>-*
	// Guest holds the suite's guest files under guest/: lib.sh, the
	// helpers its steps share, and anything else the steps read. The guest
	// sees them under /e2e/suite/.
	Guest fs.FS
	Disks []Disk
	// Install installs this checkout as a node would: its .deb (make
	// packages), with dpkg -i in a chroot of the root image.
	Install bool
	// Prepare writes the suite's own files into the mounted root image.
	Prepare func(t testing.TB, root string) error
	// Journals are the units whose journals the driver saves at the end of
	// every boot (out/<boot>/journal/<unit>.log, '*' written as "all");
	// the first is the one a failed step's message quotes.
	Journals []string
}

// Run is one execution of a suite: a private copy of the image with this
// checkout installed, the extra disks, and the 9p share (/e2e in the guest).
type Run struct {
	Cfg     Config
	Image   Image
	Suite   Suite
	Dir     string
	Root    string            // root disk, a sparse copy of the image
	Disks   map[string]string // extra disk name -> path
	Share   string            // exported to the guest as /e2e
	Results map[string]*Result
	Order   []string // boots in the order they ran
	Deb     string   // the .deb installed into the image (Suite.Install)
}

// NewRun prepares a run: the run directory, the share with the guest
// scripts (they run from there, so they change without an image rebuild),
// the root disk with this checkout and the suite's files installed.
func NewRun(t testing.TB, cfg Config, img Image, s Suite) *Run {
	t.Helper()
	dir := cfg.Work
	var err error
	if dir == "" {
		dir, err = os.MkdirTemp("/var/tmp", "sparsevol-"+s.Name+"-")
	} else {
		err = os.MkdirAll(dir, 0o755)
	}
	if err != nil {
		t.Fatal(err)
	}
	r := &Run{Cfg: cfg, Image: img, Suite: s, Dir: dir, Root: filepath.Join(dir, "root.img"),
		Disks: map[string]string{}, Share: filepath.Join(dir, "share"), Results: map[string]*Result{}}
	Logf(t, "run directory: %s", dir)
	for _, d := range []string{"boot", "state", "out", "lib", "suite"} {
		os.RemoveAll(filepath.Join(r.Share, d))
		if err := os.MkdirAll(filepath.Join(r.Share, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t0 := time.Now()
	if err := RunCmd("cp", "--sparse=always", "--reflink=auto", img.Disk, r.Root); err != nil {
		t.Fatal(err)
	}
	for _, d := range s.Disks {
		p := filepath.Join(dir, d.Name)
		os.Remove(p)
		if err := RunCmd("truncate", "-s", d.Size, p); err != nil {
			t.Fatal(err)
		}
		r.Disks[d.Name] = p
	}
	if err := copyTree(guestLib, "guest", filepath.Join(r.Share, "lib")); err != nil {
		t.Fatal(err)
	}
	if s.Guest != nil {
		if err := copyTree(s.Guest, "guest", filepath.Join(r.Share, "suite")); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.prepareRoot(t); err != nil {
		t.Fatal(err)
	}
	Logf(t, "run: image copied and prepared in %s", time.Since(t0).Round(100*time.Millisecond))
	return r
}

// copyTree copies dir of fsys to dst, every file executable.
func copyTree(fsys fs.FS, dir, dst string) error {
	return fs.WalkDir(fsys, dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(fsys, p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		return WriteFile(filepath.Join(dst, rel), b, 0o755)
	})
}

// Close removes the run directory after a pass unless asked to keep it,
// and says where it is otherwise.
func (r *Run) Close(t testing.TB) {
	t.Helper()
	if !t.Failed() && !r.Cfg.Keep && r.Cfg.Work == "" {
		os.RemoveAll(r.Dir)
		return
	}
	Logf(t, "run directory kept: %s (consoles; per boot under share/out/: step logs, facts, journals)", r.Dir)
}

// WithRoot mounts the run's root disk (with chroot mounts when asked) for
// fn, between two boots.
func (r *Run) WithRoot(chroot bool, fn func(root string) error) (err error) {
	unmount, err := MountImage(r.Root, filepath.Join(r.Dir, "mnt"), chroot)
	if err != nil {
		return err
	}
	defer func() {
		if uerr := unmount(); err == nil {
			err = uerr
		}
	}()
	return fn(filepath.Join(r.Dir, "mnt"))
}

// prepareRoot installs what a user would install (this checkout's .deb),
// the boot hook of the driver and the suite's files.
func (r *Run) prepareRoot(t testing.TB) error {
	return r.WithRoot(r.Suite.Install, func(mnt string) error {
		if r.Suite.Install {
			if err := r.install(t, mnt); err != nil {
				return err
			}
		}
		if err := InstallFiles(guestLib, mnt,
			File{Src: "guest/boot.sh", Dst: "usr/local/lib/sparsevol-e2e/boot.sh", Mode: 0o755},
			File{Src: "guest/e2e-driver.service", Dst: "etc/systemd/system/e2e-driver.service", Mode: 0o644},
		); err != nil {
			return err
		}
		if err := EnableUnits(mnt, "e2e-driver.service"); err != nil {
			return err
		}
		if r.Suite.Prepare != nil {
			return r.Suite.Prepare(t, mnt)
		}
		return nil
	})
}

func (r *Run) install(t testing.TB, mnt string) error {
	t0 := time.Now()
	deb, err := BuildDeb(r.Cfg.Repo, filepath.Join(r.Dir, "packages"), "")
	if err != nil {
		return err
	}
	Logf(t, "run: make packages: %s", time.Since(t0).Round(100*time.Millisecond))
	t0 = time.Now()
	var out bytes.Buffer
	err = InstallDeb(mnt, deb, &out)
	os.WriteFile(filepath.Join(r.Dir, "dpkg-install.log"), out.Bytes(), 0o644)
	if err != nil {
		return err
	}
	for _, f := range []string{"usr/bin/sparsevol", "usr/lib/systemd/system/sparsevol@.service"} {
		if _, err := os.Stat(filepath.Join(mnt, f)); err != nil {
			return fmt.Errorf("dpkg -i %s did not install %s: %v\n%s", filepath.Base(deb), f, err, Tail(out.String(), 40))
		}
	}
	Logf(t, "run: dpkg -i %s in the image: %s", filepath.Base(deb), time.Since(t0).Round(100*time.Millisecond))
	r.Deb = deb
	return nil
}

// File is a file of an fs.FS to install at Dst in a mounted image.
type File struct {
	Src, Dst string
	Mode     os.FileMode
}

// InstallFiles copies files of fsys into the image mounted at root.
func InstallFiles(fsys fs.FS, root string, files ...File) error {
	for _, f := range files {
		b, err := fs.ReadFile(fsys, f.Src)
		if err != nil {
			return err
		}
		if err := WriteFile(filepath.Join(root, f.Dst), b, f.Mode); err != nil {
			return err
		}
	}
	return nil
}

// EnableUnits enables units of /etc/systemd/system in a mounted image for
// multi-user.target, as `systemctl enable` would.
func EnableUnits(root string, units ...string) error {
	wants := filepath.Join(root, "etc/systemd/system/multi-user.target.wants")
	if err := os.MkdirAll(wants, 0o755); err != nil {
		return err
	}
	for _, u := range units {
		link := filepath.Join(wants, u)
		os.Remove(link)
		if err := os.Symlink("/etc/systemd/system/"+u, link); err != nil {
			return err
		}
	}
	return nil
}

// What the guest driver does once a boot's steps ran.
const (
	Reboot   = "reboot"   // systemctl reboot: qemu exits, the next Boot boots the same disk
	Poweroff = "poweroff" // the last boot
	Kill     = "kill"     // hard reset: qemu is killed right after the last step
)

// Step is one guest step of a boot, killed after Timeout. Script is its
// body, written in the suite's Go file: bash, run as a function (local and
// return work) with the shared library (guest/lib.sh) and the suite's
// guest/lib.sh sourced.
type Step struct {
	Name    string
	Timeout time.Duration
	Script  string
}

// BootSpec is one boot: the steps the guest driver runs, in order, and
// what happens at the end.
type BootSpec struct {
	Name  string
	Steps []Step
	Next  string            // Reboot, Poweroff or Kill
	Env   map[string]string // variables of every step (/e2e/boot/env)
}

// Boot runs one boot of the run's disk and collects what the guest wrote.
// The boot fails (Result.Err, reported on t) when qemu fails, when it
// outlives the boot timeout (then it is killed), or when the driver did
// not finish; a step's verdict is the suite's to draw from its facts.
func (r *Run) Boot(t testing.TB, spec BootSpec) *Result {
	t.Helper()
	res := &Result{Spec: spec, OutDir: filepath.Join(r.Share, "out", spec.Name), Journal0: first(r.Suite.Journals)}
	r.Results[spec.Name] = res
	r.Order = append(r.Order, spec.Name)

	if err := writeScripts(filepath.Join(r.Share, "boot", "steps.d"), spec.Steps); err != nil {
		res.Err = err
		t.Errorf("boot %s: %v", spec.Name, err)
		return res
	}
	var steps, env strings.Builder
	for _, s := range spec.Steps {
		fmt.Fprintf(&steps, "%s %d\n", s.Name, int(s.Timeout.Seconds()))
	}
	keys := make([]string, 0, len(spec.Env))
	for k := range spec.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&env, "%s=%s\n", k, strconv.Quote(spec.Env[k]))
	}
	for name, content := range map[string]string{
		"name":     spec.Name + "\n",
		"steps":    steps.String(),
		"next":     spec.Next + "\n",
		"env":      env.String(),
		"journals": strings.Join(r.Suite.Journals, "\n") + "\n",
	} {
		if err := os.WriteFile(filepath.Join(r.Share, "boot", name), []byte(content), 0o644); err != nil {
			res.Err = err
			t.Errorf("boot %s: %v", spec.Name, err)
			return res
		}
	}
	os.RemoveAll(res.OutDir)

	res.Console = filepath.Join(r.Dir, "console-"+spec.Name+".log")
	args := []string{
		"-accel", "tcg",
		"-nodefaults", "-no-user-config", "-display", "none",
		"-m", strconv.Itoa(r.Cfg.MemMiB), "-smp", strconv.Itoa(r.Cfg.CPUs),
		"-no-reboot", "-nic", "none",
		"-serial", "file:" + res.Console,
		"-kernel", r.Image.Kernel, "-initrd", r.Image.Initrd,
		// No CPU-bug mitigations: they only slow the emulated CPU down.
		"-append", "root=/dev/vda rw console=ttyS0 panic=-1 mitigations=off",
		"-drive", "file=" + r.Root + ",if=virtio,format=raw,cache=writeback",
	}
	for _, d := range r.Suite.Disks {
		args = append(args, "-drive", "file="+r.Disks[d.Name]+",if=virtio,format=raw,cache=writeback")
	}
	args = append(args, "-virtfs", "local,path="+r.Share+",mount_tag=e2e,security_model=none,id=e2e")
	qlog, err := os.Create(filepath.Join(r.Dir, "qemu-"+spec.Name+".log"))
	if err != nil {
		res.Err = err
		t.Errorf("boot %s: %v", spec.Name, err)
		return res
	}
	defer qlog.Close()
	cmd := exec.Command("qemu-system-x86_64", args...)
	cmd.Stdout, cmd.Stderr = qlog, qlog
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		res.HostLoad = strings.Fields(string(b))[0]
	}
	timeout := r.Cfg.BootTimeout
	if timeout == 0 {
		// Boot and shutdown, plus every step's own limit.
		timeout = 4 * time.Minute
		for _, s := range spec.Steps {
			timeout += s.Timeout
		}
	}
	Logf(t, "boot %s: starting (steps: %s; then %s; host load %s; timeout %s)", spec.Name, stepNames(spec.Steps), spec.Next, res.HostLoad, timeout)
	start := time.Now()
	if err := cmd.Start(); err != nil {
		res.Err = fmt.Errorf("qemu: %v", err)
		t.Errorf("boot %s: %v", spec.Name, res.Err)
		return res
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	killMarker := filepath.Join(res.OutDir, "kill-me")
	deadline := time.After(timeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
wait:
	for {
		select {
		case err := <-exited:
			if err != nil {
				res.Err = fmt.Errorf("qemu exited: %v (%s)", err, TailFile(qlog.Name(), 5))
			}
			break wait
		case <-tick.C:
			if spec.Next == Kill {
				if _, err := os.Stat(killMarker); err == nil {
					cmd.Process.Signal(syscall.SIGKILL)
					<-exited
					res.Killed = true
					break wait
				}
			}
		case <-deadline:
			cmd.Process.Signal(syscall.SIGKILL)
			<-exited
			res.Err = fmt.Errorf("boot %s timed out after %s", spec.Name, timeout)
			break wait
		}
	}
	res.Wall = time.Since(start)
	if res.Err == nil {
		if _, err := os.Stat(filepath.Join(res.OutDir, "done")); err != nil {
			res.Err = fmt.Errorf("boot %s: the guest driver did not finish (no %s)", spec.Name, filepath.Join(res.OutDir, "done"))
		}
	}
	how := "exited"
	if res.Killed {
		how = "killed (hard reset)"
	}
	Logf(t, "boot %s: qemu %s after %s", spec.Name, how, res.Wall.Round(100*time.Millisecond))
	if res.Err != nil {
		t.Errorf("%v\nlast console lines (%s):\n%s", res.Err, res.Console, TailFile(res.Console, 60))
	}
	res.load()
	for _, s := range spec.Steps {
		if st := res.Steps[s.Name]; st.Exit != -1 {
			Logf(t, "boot %s: step %s: exit %d in %d ms, %d facts, %d failures", spec.Name, s.Name, st.Exit, st.Ms, len(st.Facts), len(st.Failures))
		}
	}
	return res
}

// writeScripts writes each step's Script to dir/<name>.sh as the body of
// the function step_main, which the guest's step.sh sources and runs; dir
// holds only this boot's steps.
func writeScripts(dir string, steps []Step) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, s := range steps {
		if strings.ContainsAny(s.Name, "/ \n") || s.Name == "" {
			return fmt.Errorf("step name %q: want a word", s.Name)
		}
		if strings.TrimSpace(s.Script) == "" {
			return fmt.Errorf("step %s has no Script", s.Name)
		}
		body := "step_main() {\n" + strings.TrimRight(s.Script, "\n") + "\n}\n"
		if err := os.WriteFile(filepath.Join(dir, s.Name+".sh"), []byte(body), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func first(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}

func stepNames(steps []Step) string {
	var names []string
	for _, s := range steps {
		names = append(names, s.Name)
	}
	return strings.Join(names, " ")
}
