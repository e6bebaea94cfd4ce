package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
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
// lax store private (saying so on stderr) and removes the temporary
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
