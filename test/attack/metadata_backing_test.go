package attack

import (
	"path/filepath"
	"strings"
	"testing"
)

// The backing file is always <store>/<uuid>: a backingFile in the metadata
// that points elsewhere is neither bound nor deleted.
func TestMetadataBackingFileIgnored(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	u := c.create(s, "v")
	victim := c.ext4Image("host-image")
	rewriteRecord(t, filepath.Join(s, u+".json"), map[string]any{"backingFile": victim})
	want := digest(victim)
	victimBound := func(when string) {
		for dev, l := range c.loops() {
			if strings.HasPrefix(l.backing, victim) {
				t.Errorf("%s: %s is bound to %s", when, dev, l.backing)
			}
		}
	}
	c.expectCode(c.sv(s, "attach", "v"), 0)
	victimBound("after attach")
	if st := c.status(s, "v"); st.Attached {
		for dev, l := range c.loops() {
			if dev == st.Device && l.backing != filepath.Join(s, u) {
				t.Errorf("attach bound %s to %s, not %s", dev, l.backing, filepath.Join(s, u))
			}
		}
	}
	c.expectCode(c.sv(s, "delete", "v"), 0)
	victimBound("after delete")
	if got := digest(victim); got != want {
		t.Errorf("victim %s: was %s, now %s", victim, want, got)
	}
}
