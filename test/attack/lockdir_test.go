package attack

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// The store's lock directory holds more than locks: a volume's lock file
// records the device its last detach freed, and .locks/names holds the
// name hints. Whatever is planted there is attacker input: a lock file
// that is not a plain file of the store's is refused and left as it is,
// never opened, read or written; a planted name hint directory costs a
// scan.

// TestHostileLockFile: a volume's lock file replaced by a hard link to a
// file, a device node of someone's loop device or a FIFO, or the whole
// lock directory by a symbolic link, makes attach refuse (exit 1, naming
// what to inspect) with what is behind the planted file unchanged; once
// the operator removes it, attach and detach work.
func TestHostileLockFile(t *testing.T) {
	tests := []struct {
		name string
		// plant replaces the file at path and returns what must not
		// change ("" for nothing but the refusal).
		plant func(c *kase, path string) string
		// dir: plant replaces the lock directory, not the volume's lock.
		dir bool
	}{
		{"hard link to a file", func(c *kase, lock string) string {
			victim := c.victim("precious", 4096)
			mustReplace(c.t, lock, func() error { return os.Link(victim, lock) })
			return victim
		}, false},
		{"node of a foreign loop device", func(c *kase, lock string) string {
			victim := c.victim("disk", 1<<20)
			dev := c.foreignLoop(victim, 0, 0, false, "")
			var st unix.Stat_t
			if err := unix.Stat(dev, &st); err != nil {
				c.t.Fatal(err)
			}
			mustReplace(c.t, lock, func() error { return unix.Mknod(lock, unix.S_IFBLK|0o600, int(st.Rdev)) })
			return victim
		}, false},
		{"FIFO", func(c *kase, lock string) string {
			mustReplace(c.t, lock, func() error { return unix.Mkfifo(lock, 0o600) })
			return ""
		}, false},
		{"lock directory a symbolic link", func(c *kase, locks string) string {
			outside := c.mkdir("elsewhere")
			if err := os.Rename(locks, filepath.Join(outside, "moved")); err != nil {
				c.t.Fatal(err)
			}
			if err := os.Symlink(outside, locks); err != nil {
				c.t.Fatal(err)
			}
			return outside
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			s := c.store("s")
			u := c.create(s, "v")
			path := filepath.Join(s, ".locks", u)
			if tt.dir {
				path = filepath.Join(s, ".locks")
			}
			victim := tt.plant(c, path)
			before := digest(victim)
			r := c.sv(s, "attach", "v")
			c.expectCode(r, 1)
			if !strings.Contains(r.stderr, "inspect it with") {
				t.Errorf("the refusal says nothing of what to inspect: %v", r)
			}
			if victim != "" && digest(victim) != before {
				t.Errorf("%s changed behind the planted file:\nbefore: %s\nafter:  %s", victim, before, digest(victim))
			}
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			for _, op := range []string{"attach", "detach", "attach", "detach"} {
				c.expectCode(c.sv(s, op, "v"), 0)
			}
		})
	}
}

// TestHostileNameDir: .locks/names replaced by a symbolic link to another
// directory is never followed: create, status and delete by name work,
// and the directory it points at, which holds a file named like the
// volume, is unchanged.
func TestHostileNameDir(t *testing.T) {
	c := newCase(t)
	s := c.store("s")
	c.victim("v", 4096)
	outside := c.path("victim")
	if err := os.Mkdir(filepath.Join(s, ".locks"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(s, ".locks", "names")); err != nil {
		t.Fatal(err)
	}
	before := digest(outside)
	c.create(s, "v")
	c.expectCode(c.sv(s, "status", "v"), 0)
	c.expectCode(c.sv(s, "delete", "v"), 0)
	if now := digest(outside); now != before {
		t.Errorf("%s changed:\nbefore: %s\nafter:  %s", outside, before, now)
	}
}

// TestHostileTempMountDir: .locks/mnt-<uuid>, where an offline expansion
// of XFS mounts the volume's filesystem and which every detach clears,
// replaced by a symbolic link to a directory holding someone's mount, is
// never followed: the expansion is refused (exit 1, naming what to
// inspect), detach works, and that mount stays mounted with its file as
// it was.
func TestHostileTempMountDir(t *testing.T) {
	c := newCase(t)
	s := c.store("s")
	u := c.create(s, "v", "--fs", "xfs", "--size", "300M")
	c.expectCode(c.sv(s, "detach", "v"), 0)
	victim := c.path("victim")
	c.mountForeignTmpfs(victim)
	before := digest(victim)
	if err := os.Symlink(victim, filepath.Join(s, ".locks", "mnt-"+u)); err != nil {
		t.Fatal(err)
	}
	r := c.sv(s, "expand", "v", "--size", "320M")
	c.expectCode(r, 1)
	if !strings.Contains(r.stderr, "is not a directory (inspect it with") {
		t.Errorf("the refusal says nothing of what to inspect: %v", r)
	}
	c.expectCode(c.sv(s, "detach", "v"), 0)
	if !testutil.IsMountPoint(t, victim) {
		t.Fatalf("the mount at %s, behind .locks/mnt-%s, is gone", victim, u)
	}
	if now := digest(victim); now != before {
		t.Errorf("%s changed:\nbefore: %s\nafter:  %s", victim, before, now)
	}
}

// mustReplace removes the file at path and makes another there with make.
func mustReplace(t *testing.T, path string, make func() error) {
	t.Helper()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := make(); err != nil {
		t.Fatal(err)
	}
}
