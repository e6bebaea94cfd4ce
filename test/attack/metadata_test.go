package attack

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// One hostile <uuid>.json — truncated, a FIFO, a symbolic link to a
// host file, a file of 64 MiB: list shows that volume as broken, naming
// the file, without blocking, following the link or reading the big file;
// the rest of the store works; doctor exits 1; delete by UUID removes it
// (a link itself, not what it names). One of a newer format than the
// binary reads, whatever else it says, is listed as newer and kept:
// delete, even --force, exits 1 and changes nothing.
func TestTruncatedMetadata(t *testing.T) {
	for _, tt := range []struct {
		name string
		// plant makes the hostile record; state and why are what the
		// listing must say of it.
		plant func(c *kase, meta string)
		state string
		why   string
	}{
		{"truncated", func(c *kase, meta string) {
			if err := os.Truncate(meta, 20); err != nil {
				c.t.Fatal(err)
			}
		}, "broken", "unexpected end of JSON input"},
		{"FIFO", func(c *kase, meta string) {
			mustReplace(c.t, meta, func() error { return unix.Mkfifo(meta, 0o600) })
		}, "broken", "not a regular file"},
		{"link to a host file", func(c *kase, meta string) {
			victim := c.victim("host.json", 4096)
			c.watch(victim)
			replaceWithSymlink(c.t, meta, victim)
		}, "broken", "a symbolic link, not followed"},
		{"64 MiB", func(c *kase, meta string) {
			if err := os.Truncate(meta, 64<<20); err != nil {
				c.t.Fatal(err)
			}
		}, "broken", "more than 1048576"},
		{"newer format", func(c *kase, meta string) {
			// Fields that, read as this binary's, would send a delete
			// to a host file.
			rewriteRecord(c.t, meta, map[string]any{"format": math.MaxInt32, "state": "deleting",
				"backingFile": c.ext4Image("host-image"), "ioLimits": "per-tenant"})
		}, "newer", "upgrade sparsevol"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			hostileMetadata(t, tt.plant, tt.state, tt.why)
		})
	}
}

func hostileMetadata(t *testing.T, plant func(c *kase, meta string), state, why string) {
	c := newCase(t)
	s := c.store("s")
	good := c.create(s, "good")
	bad := c.create(s, "bad")
	meta := filepath.Join(s, bad+".json")
	plant(c, meta)
	r := c.sv(s, "list", "-o", "json")
	c.expectCode(r, 0)
	var vols []map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &vols); err != nil && r.code == 0 {
		t.Errorf("list -o json: %v: %s", err, r.stdout)
	}
	found := false
	for _, v := range vols {
		if v["uuid"] == bad {
			found = true
			if v["state"] != state || !strings.Contains(fmt.Sprint(v), meta) || !strings.Contains(fmt.Sprint(v), why) {
				t.Errorf("hostile volume listed as %v; want state %s naming %s: %s", v, state, meta, why)
			}
		}
	}
	if r.code == 0 && !found {
		t.Errorf("list does not show the hostile volume %s: %s", bad, r.stdout)
	}
	c.expectCode(c.sv(s, "status", "good"), 0)
	c.expectCode(c.sv(s, "attach", good), 0)
	dev := c.status(s, good).Device
	c.expectCode(c.sv(s, "create", "third", "--no-start", "--size", "16M"), 0)
	r = c.sv(s, "doctor")
	c.expectCode(r, 1)
	if dev != "" && advisesDetach(r.stdout+r.stderr, dev) {
		t.Errorf("doctor advises detaching the healthy volume's %s:\n%s", dev, r.stdout)
	}
	if state == "newer" {
		before := c.snapshot()
		c.expectCode(c.sv(s, "delete", bad), 1)
		c.expectCode(c.sv(s, "delete", "--force", bad), 1)
		c.unchanged(before)
		return
	}
	c.expectCode(c.sv(s, "delete", bad), 0)
	for _, p := range []string{meta, filepath.Join(s, bad)} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("delete %s left %s", bad, p)
		}
	}
}
