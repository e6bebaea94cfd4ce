package attack

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A world-writable store is not used silently: create tightens it to 0700
// and says so (or refuses and creates nothing).
func TestWorldWritableStore(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	if err := os.Chmod(s, 0o777); err != nil {
		t.Fatal(err)
	}
	r := c.sv(s, "create", "v", "--no-start", "--size", "16M")
	fi, err := os.Stat(s)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		t.Errorf("store left %v after create: %v", fi.Mode().Perm(), r)
	}
	if r.code == 0 && !strings.Contains(r.stderr, s) {
		t.Errorf("create tightened or used a 0777 store without saying so on stderr: %v", r)
	}
}

// SIGKILL of the CLI during mkfs takes mkfs with it (parent-death
// signal); the next delete then removes what the create left.
func TestKilledCreateLeavesNoMkfs(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	// A mkfs that takes its time, found first in PATH.
	fake := c.mkdir("fakebin")
	script := "#!/bin/sh\nexec sleep 60\n"
	for _, name := range []string{"mkfs.ext4", "mke2fs"} {
		if err := os.WriteFile(filepath.Join(fake, name), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(bin, "--root", s, "--unit-dir", c.path("units"), "create", "v", "--no-start", "--size", "16M")
	cmd.Env = append(os.Environ(), "PATH="+fake+":"+os.Getenv("PATH"))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	mkfs := 0
	for deadline := time.Now().Add(30 * time.Second); mkfs == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		mkfs = childNamed(cmd.Process.Pid, "sleep")
	}
	cmd.Process.Kill()
	cmd.Wait()
	if mkfs == 0 {
		t.Fatal("the CLI never ran mkfs")
	}
	t.Cleanup(func() { syscall.Kill(mkfs, syscall.SIGKILL) })
	var alive bool
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if alive = running(mkfs); !alive {
			break
		}
	}
	if alive {
		t.Errorf("mkfs (pid %d) still runs after the CLI was killed", mkfs)
	}
	c.expectCode(c.sv(s, "delete", "v"), 0)
	if vols := storeUUIDs(s); len(vols) != 0 || len(c.loops()) != 0 {
		t.Errorf("after delete: metadata %v, devices %v", vols, c.loops())
	}
}

// Temporary metadata files a crash left are cleaned when the store is listed.
func TestStaleTempFilesCleaned(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	u := c.create(s, "v")
	stale := filepath.Join(s, ".tmp-"+u+".json-12345")
	if err := os.WriteFile(stale, []byte(`{"name":`), 0o600); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-2 * time.Hour)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	c.expectCode(c.sv(s, "list"), 0)
	if _, err := os.Lstat(stale); err == nil {
		t.Errorf("%s is still there after the store was listed", stale)
	}
}
