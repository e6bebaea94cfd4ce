package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestKilledCLILeavesNoChild: a CLI killed with SIGKILL while mkfs runs
// takes mkfs with it, and the volume it was creating can be deleted.
func TestKilledCLILeavesNoChild(t *testing.T) {
	root := newRoot(t)
	bin := t.TempDir()
	pidFile := filepath.Join(bin, "pid")
	// A slow mkfs that holds the device, as a real one does.
	script := "#!/bin/sh\nfor a; do last=$a; done\nexec 3<\"$last\"\necho $$ > " + pidFile + "\nexec sleep 300\n"
	if err := os.WriteFile(filepath.Join(bin, "mkfs.ext4"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "--root", root, "create", "v", "--size", "8M", "--no-start")
	cmd.Env = append(os.Environ(), asCLI+"=1", "PATH="+bin+":"+os.Getenv("PATH"))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := 0
	for deadline := time.Now().Add(20 * time.Second); pid == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatal("the fake mkfs never started")
		}
		if b, err := os.ReadFile(pidFile); err == nil && strings.HasSuffix(string(b), "\n") {
			pid, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		}
	}
	cmd.Process.Kill()
	cmd.Wait()
	if !processGone(pid, 5*time.Second) {
		exec.Command("kill", "-9", strconv.Itoa(pid)).Run()
		processGone(pid, 5*time.Second)
		t.Fatalf("mkfs (pid %d) still runs after its CLI was killed", pid)
	}
	mustRun(t, root, "delete", "v")
}

// processGone waits up to d for pid to exit (gone, or a zombie nobody
// reaped yet) and reports whether it did.
func processGone(pid int, d time.Duration) bool {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			return true
		}
		// pid (comm) S ...: the state follows the last ')'.
		if i := strings.LastIndexByte(string(stat), ')'); i > 0 && strings.HasPrefix(string(stat[i+1:]), " Z") {
			return true
		}
	}
	return false
}

// TestOpenTidiesStore: every command opens the store, and opening makes a
// lax store private (saying so on stderr); a listing removes the temporary
// metadata that killed writers left.
func TestOpenTidiesStore(t *testing.T) {
	const stale = ".tmp-5e6f7a8b-9c0d-4e1f-a2b3-c4d5e6f7a8b9.json-2630577581"
	tests := []struct {
		name  string
		setup func(t *testing.T, root string)
		check func(t *testing.T, root string, r result)
	}{
		{"world-writable store", func(t *testing.T, root string) {
			os.Chmod(root, 0o777)
		}, func(t *testing.T, root string, r result) {
			if fi, _ := os.Stat(root); fi.Mode().Perm() != 0o700 {
				t.Errorf("store mode %04o, want 0700", fi.Mode().Perm())
			}
			if !strings.Contains(r.stderr, "made it private") || !strings.Contains(r.stderr, "0777") {
				t.Errorf("stderr does not say the store was made private: %q", r.stderr)
			}
		}},
		{"stale temporary metadata", func(t *testing.T, root string) {
			os.WriteFile(filepath.Join(root, stale), []byte("{"), 0o600)
		}, func(t *testing.T, root string, r result) {
			if _, err := os.Lstat(filepath.Join(root, stale)); err == nil {
				t.Errorf("%s left in the store", stale)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := newRoot(t)
			tt.setup(t, root)
			r := sparsevol(t, root, nil, "list")
			if r.code != 0 {
				t.Fatalf("list: exit %d: %s", r.code, r.stderr)
			}
			tt.check(t, root, r)
		})
	}
}

// TestPVRefusesInvalidNames: pv prints no manifest Kubernetes would
// reject; bad names are input errors.
func TestPVRefusesInvalidNames(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "v", "--size", "8M", "--no-start")
	tests := []struct {
		name string
		args []string
	}{
		{"name with capitals and punctuation", []string{"--name", "Bad_Name!"}},
		{"storage class with a space", []string{"--storage-class", "a b"}},
		{"both", []string{"--name", "Bad_Name!", "--storage-class", "a b"}},
		{"name too long", []string{"--name", strings.Repeat("a", 254)}},
		{"storage class with a slash", []string{"--storage-class", "a/b"}},
		{"node with a space", []string{"--node", "node 1"}},
		{"node too long for a label value", []string{"--node", strings.Repeat("n", 64)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := sparsevol(t, root, nil, append([]string{"pv", "v"}, tt.args...)...)
			if r.code != 2 || r.stdout != "" {
				t.Fatalf("exit %d, want 2 and no manifest; stdout:\n%s\nstderr: %s", r.code, r.stdout, r.stderr)
			}
		})
	}
	mustRun(t, root, "delete", "v")
}

// TestPVRefusesUnreadyVolumes: pv prints no manifest for a volume whose
// record is broken (its fields unchecked) or unfinished (no filesystem
// yet): kubelet would be sent to a path that is not the volume's, or
// format one. It exits 1 and prints nothing.
func TestPVRefusesUnreadyVolumes(t *testing.T) {
	tests := []struct {
		name   string
		record func(data []byte) []byte
	}{
		{"broken", func(data []byte) []byte { return data[:10] }},
		{"creating", func(data []byte) []byte {
			return []byte(strings.Replace(string(data), `"state": "ready"`, `"state": "creating"`, 1))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := newRoot(t)
			uuid := strings.TrimSpace(mustRun(t, root, "create", "v", "--size", "8M", "--no-start"))
			meta := filepath.Join(root, uuid+".json")
			data, err := os.ReadFile(meta)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(meta, tt.record(data), 0o600); err != nil {
				t.Fatal(err)
			}
			r := sparsevol(t, root, nil, "pv", uuid, "--node", "node-1")
			mustRun(t, root, "delete", uuid)
			if r.code != 1 || r.stdout != "" || !strings.Contains(r.stderr, "state "+tt.name) {
				t.Fatalf("pv of a %s volume: exit %d, want 1, no manifest and the state named; stdout:\n%s\nstderr: %s", tt.name, r.code, r.stdout, r.stderr)
			}
		})
	}
}

// TestDoctorStoreFilesystem: doctor fails when the store's filesystem is
// full or nearly so.
func TestDoctorStoreFilesystem(t *testing.T) {
	tests := []struct {
		name  string
		leave int64 // bytes to leave available; 0: fill until ENOSPC
		want  string
	}{
		{"full", 0, "full: 0B of "},
		{"nearly full", 160 << 10, "nearly full: "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := newRoot(t)
			if err := unix.Mount("tmpfs", root, "tmpfs", 0, "size=16m,mode=0700"); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
			mustRun(t, root, "list")
			fill(t, filepath.Join(root, "fill"), tt.leave)
			r := sparsevol(t, root, nil, "doctor")
			if r.code != 1 || !strings.Contains(r.stdout, "[FAIL] filesystem: "+tt.want) {
				t.Fatalf("doctor: exit %d, want 1 and a filesystem failure %q:\n%s%s", r.code, tt.want, r.stdout, r.stderr)
			}
		})
	}
}

// fill writes path until its filesystem has about leave bytes available.
func fill(t *testing.T, path string, leave int64) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var st unix.Statfs_t
	if err := unix.Statfs(filepath.Dir(path), &st); err != nil {
		t.Fatal(err)
	}
	avail := int64(st.Bavail) * st.Bsize
	chunk := make([]byte, 64<<10)
	for n := int64(0); leave == 0 || n+int64(len(chunk)) <= avail-leave; n += int64(len(chunk)) {
		if _, err := f.Write(chunk); err != nil {
			if leave == 0 && errors.Is(err, unix.ENOSPC) {
				return
			}
			t.Fatal(err)
		}
	}
}

// TestDoctorScopesDevicesToStore: doctor advises detaching only devices of
// volumes this store lost, and counts other stores' devices in one line.
func TestDoctorScopesDevicesToStore(t *testing.T) {
	root, other := newRoot(t), newRoot(t)
	orphan := strings.TrimSpace(mustRun(t, root, "create", "lost", "--size", "8M"))
	foreign := strings.TrimSpace(mustRun(t, other, "create", "elsewhere", "--size", "8M"))
	// The store forgets "lost" while its device stays: an orphan here.
	meta := filepath.Join(root, orphan+".json")
	aside := filepath.Join(t.TempDir(), "meta")
	if err := os.Rename(meta, aside); err != nil {
		t.Fatal(err)
	}
	r := sparsevol(t, root, nil, "doctor")
	os.Rename(aside, meta)
	mustRun(t, root, "delete", "lost")
	mustRun(t, other, "delete", "elsewhere")
	orphanDev, foreignDev := "", ""
	for _, line := range strings.Split(r.stdout, "\n") {
		if strings.Contains(line, orphan) {
			orphanDev = line
		}
		if strings.Contains(line, foreign) || strings.Contains(line, other) {
			foreignDev = line
		}
	}
	if orphanDev == "" || !strings.Contains(r.stdout, "-> losetup -d /dev/loop") {
		t.Errorf("the orphan of this store (volume %s) is not reported with losetup -d", orphan)
	}
	if foreignDev != "" || strings.Count(r.stdout, "losetup -d") != 1 {
		t.Errorf("another store's device is reported or advised for detaching: %q", foreignDev)
	}
	if !strings.Contains(r.stdout, "loop device(s) of volumes of other stores") {
		t.Errorf("other stores' devices are not summarised")
	}
	if t.Failed() {
		t.Logf("doctor:\n%s%s", r.stdout, r.stderr)
	}
}

// TestDoctorQuotesHostileNames: a file name doctor reads from the store
// (a stray snapshot file) or from sysfs (the backing file of a device
// tagged for a volume the store lost) reaches its output only quoted,
// never as it is: no newline forges a line, no escape sequence reaches the
// terminal, and no command to paste holds the name.
func TestDoctorQuotesHostileNames(t *testing.T) {
	const hostile = "x$(id);`id`\n[OK  ] fine\x1b[2J"
	tests := []struct {
		name  string
		setup func(t *testing.T, root string) (undo func())
	}{
		{"stray snapshot file", func(t *testing.T, root string) func() {
			if err := os.MkdirAll(filepath.Join(root, ".snapshots"), 0o700); err != nil {
				t.Fatal(err)
			}
			stray := filepath.Join(root, ".snapshots", hostile)
			if err := os.WriteFile(stray, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			return func() { os.Remove(stray) }
		}},
		{"backing file of a lost volume's device", func(t *testing.T, root string) func() {
			uuid := strings.TrimSpace(mustRun(t, root, "create", "lost", "--size", "8M"))
			file, renamed := filepath.Join(root, uuid), filepath.Join(root, hostile)
			meta, aside := filepath.Join(root, uuid+".json"), filepath.Join(t.TempDir(), "meta")
			if err := os.Rename(file, renamed); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(meta, aside); err != nil {
				t.Fatal(err)
			}
			return func() {
				os.Rename(renamed, file)
				os.Rename(aside, meta)
				mustRun(t, root, "delete", "lost")
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := newRoot(t)
			undo := tt.setup(t, root)
			r := sparsevol(t, root, nil, "doctor")
			undo()
			quoted := strconv.QuoteToASCII(hostile)
			if !strings.Contains(r.stdout, quoted) {
				t.Errorf("doctor does not show the name quoted as %s", quoted)
			}
			for _, bad := range []string{"\n[OK  ] fine", "\x1b", "$(id)"} {
				if strings.Contains(strings.ReplaceAll(r.stdout, quoted, ""), bad) {
					t.Errorf("doctor prints %q outside the quoted name", bad)
				}
			}
			for _, line := range strings.Split(r.stdout, "\n") {
				if strings.HasPrefix(strings.TrimSpace(line), "->") && strings.Contains(line, "id)") {
					t.Errorf("a command to paste holds the name: %q", line)
				}
			}
			if t.Failed() {
				t.Logf("doctor:\n%s%s", r.stdout, r.stderr)
			}
		})
	}
}

// TestDoctorFailsOnBrokenMetadata: a volume whose metadata cannot be read
// is a failure, named with its file.
func TestDoctorFailsOnBrokenMetadata(t *testing.T) {
	root := newRoot(t)
	uuid := strings.TrimSpace(mustRun(t, root, "create", "b", "--size", "8M", "--no-start"))
	meta := filepath.Join(root, uuid+".json")
	if err := os.Truncate(meta, 10); err != nil {
		t.Fatal(err)
	}
	r := sparsevol(t, root, nil, "doctor")
	if r.code != 1 || !strings.Contains(r.stdout, "[FAIL] volume "+uuid+": broken: ") || !strings.Contains(r.stdout, meta) {
		t.Errorf("doctor: exit %d, want 1 and a failure naming %s:\n%s%s", r.code, meta, r.stdout, r.stderr)
	}
	mustRun(t, root, "delete", uuid)
}

// TestDoctorBackingFileProblems: a backing file that is a symbolic link or
// has a second link, or a loop device someone else bound to it, is a
// failure naming the volume; operations refuse such a volume.
func TestDoctorBackingFileProblems(t *testing.T) {
	tests := []struct {
		name  string
		want  string
		setup func(t *testing.T, file string) (undo func())
	}{
		{"symlinked", "symbolic link", func(t *testing.T, file string) func() {
			moved := filepath.Join(t.TempDir(), "moved")
			if err := os.Rename(file, moved); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(moved, file); err != nil {
				t.Fatal(err)
			}
			return func() { os.Remove(file); os.Rename(moved, file) }
		}},
		{"hard-linked", "2 links", func(t *testing.T, file string) func() {
			other := filepath.Join(t.TempDir(), "other")
			if err := os.Link(file, other); err != nil {
				t.Fatal(err)
			}
			return func() { os.Remove(other) }
		}},
		{"foreign device", "not ours", func(t *testing.T, file string) func() {
			out, err := exec.Command("losetup", "--find", "--show", "--offset", "1048576", file).Output()
			if err != nil {
				t.Fatal(err)
			}
			dev := strings.TrimSpace(string(out))
			return func() { testutil.DetachIfServes(dev, file) }
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := newRoot(t)
			uuid := strings.TrimSpace(mustRun(t, root, "create", "v", "--size", "8M", "--no-start"))
			undo := tt.setup(t, filepath.Join(root, uuid))
			r := sparsevol(t, root, nil, "doctor")
			undo()
			mustRun(t, root, "delete", "v")
			if r.code != 1 || !strings.Contains(r.stdout, "[FAIL] volume v: ") || !strings.Contains(r.stdout, tt.want) {
				t.Fatalf("doctor: exit %d, want 1 and a failure of volume v saying %q:\n%s%s", r.code, tt.want, r.stdout, r.stderr)
			}
		})
	}
}

// TestStatusQuotesHostileMountPoints mounts a volume at a directory whose
// name holds a newline, a forged status row and an escape sequence:
// status shows the mount point quoted, and delete's busy refusal names
// it quoted, never raw.
func TestStatusQuotesHostileMountPoints(t *testing.T) {
	const hostile = "m\nProblem:  none\x1b[2J"
	root := newRoot(t)
	uuid := strings.TrimSpace(mustRun(t, root, "create", "v", "--size", "16M"))
	dir := filepath.Join(t.TempDir(), hostile)
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/dev/disk/by-uuid/"+uuid, dir, "ext4", 0, ""); err != nil {
		// No udev here: the volume's stable path names its device.
		if err := unix.Mount("/dev/sparsevol/"+uuid, dir, "ext4", 0, ""); err != nil {
			t.Fatalf("mount the volume: %v", err)
		}
	}
	t.Cleanup(func() {
		unix.Unmount(dir, 0)
		mustRun(t, root, "delete", "v")
	})
	quoted := strconv.QuoteToASCII(dir)
	for _, args := range [][]string{{"status", "v"}, {"delete", "v"}} {
		r := sparsevol(t, root, nil, args...)
		out := r.stdout + r.stderr
		if !strings.Contains(out, quoted) {
			t.Errorf("%v does not show the mount point quoted as %s:\n%s", args, quoted, out)
		}
		rest := strings.ReplaceAll(out, quoted, "")
		for _, bad := range []string{"\x1b", "\nProblem:  none"} {
			if strings.Contains(rest, bad) {
				t.Errorf("%v prints %q outside the quoted mount point:\n%s", args, bad, out)
			}
		}
	}
}

// TestDoctorReportsLeftovers: doctor reports the partial copy a killed
// recover left, with what removes it, and removes the probe file and
// device a killed doctor left, saying so.
func TestDoctorReportsLeftovers(t *testing.T) {
	root := newRoot(t)
	uuid := strings.TrimSpace(mustRun(t, root, "create", "v", "--size", "8M", "--mode", "block", "--no-partition"))
	t.Cleanup(func() { mustRun(t, root, "delete", "v") })
	copied := filepath.Join(root, ".recover-"+uuid)
	if err := os.WriteFile(copied, []byte("partial"), 0o600); err != nil {
		t.Fatal(err)
	}
	probe := filepath.Join(root, ".doctor-1234")
	f, err := os.Create(probe)
	if err != nil {
		t.Fatal(err)
	}
	err = f.Truncate(4 << 20)
	var dev *loop.Device
	if err == nil {
		dev, err = loop.Attach(int(f.Fd()), loop.AttachOptions{Tag: volume.ProbeTag})
	}
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { testutil.DetachIfServes(dev.Path, probe) })
	then := time.Now().Add(-time.Minute)
	if err := os.Chtimes(probe, then, then); err != nil {
		t.Fatal(err)
	}

	r := sparsevol(t, root, nil, "doctor")
	for _, want := range []string{
		"[WARN] leftovers: " + copied + " is a partial copy a killed recover of volume " + uuid + " left",
		"-> rerun `sparsevol recover " + uuid + "` (it starts over), or `rm " + copied + "`",
		"[OK  ] leftovers: removed " + probe + " and " + dev.Path + " bound to it, left by a killed doctor",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("doctor does not say %q:\n%s%s", want, r.stdout, r.stderr)
		}
	}
	if _, err := os.Lstat(probe); !os.IsNotExist(err) {
		t.Errorf("%s after doctor: %v, want it removed", probe, err)
	}
	if devs := devicesUnder(root); slices.Contains(devs, dev.Path) {
		t.Errorf("bound after doctor: %v, want the probe's device %s detached", devs, dev.Path)
	}
}
