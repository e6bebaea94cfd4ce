package attack

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// One truncated <uuid>.json: list shows that volume as broken, naming the
// file; the rest of the store works; doctor exits 1; delete by UUID
// removes it.
func TestTruncatedMetadata(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	good := c.create(s, "good")
	bad := c.create(s, "bad")
	meta := filepath.Join(s, bad+".json")
	if err := os.Truncate(meta, 20); err != nil {
		t.Fatal(err)
	}
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
			if v["state"] != "broken" || !strings.Contains(fmt.Sprint(v), meta) {
				t.Errorf("broken volume listed as %v; want state broken naming %s", v, meta)
			}
		}
	}
	if r.code == 0 && !found {
		t.Errorf("list does not show the broken volume %s: %s", bad, r.stdout)
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
	c.expectCode(c.sv(s, "delete", bad), 0)
	for _, p := range []string{meta, filepath.Join(s, bad)} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("delete %s left %s", bad, p)
		}
	}
}
