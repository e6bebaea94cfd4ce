package attack

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// Backing file deleted while attached: status says orphaned and names the
// device; detach and delete refuse (exit 1, nothing changed); recover
// copies the device into a new sparse backing file.
func TestOrphanedVolume(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	s := c.store("s")
	u := c.create(s, "v")
	dev := c.attach(s, u)
	// Some data past the filesystem's metadata, so the copy is checked.
	mnt := c.mkdir("mnt")
	run(t, "mount", dev, mnt)
	if err := os.WriteFile(filepath.Join(mnt, "data"), []byte(strings.Repeat("precious ", 100000)), 0o600); err != nil {
		t.Fatal(err)
	}
	run(t, "umount", mnt)
	want := deviceDigest(t, dev)
	if err := os.Remove(filepath.Join(s, u)); err != nil {
		t.Fatal(err)
	}
	st := c.status(s, "v")
	if st.State != "orphaned" || st.Device == "" {
		t.Errorf("status of a volume whose file is gone but whose device holds the data: state %q device %q; want orphaned with %s", st.State, st.Device, dev)
	}
	before := c.snapshot()
	c.expectCode(c.sv(s, "detach", "v"), 1)
	c.unchanged(before)
	c.expectCode(c.sv(s, "delete", "v"), 1)
	c.unchanged(before)
	if t.Failed() {
		return // the data would be gone: recover has nothing to copy
	}
	c.expectCode(c.sv(s, "recover", "v"), 0)
	file := filepath.Join(s, u)
	fi, err := os.Stat(file)
	if err != nil {
		t.Fatalf("recover made no backing file: %v", err)
	}
	if got := digest(file); !strings.HasPrefix(got, "sha256:"+want[:16]) {
		t.Errorf("recovered file %s, device held sha256:%s", got, want[:16])
	}
	if alloc := fi.Sys().(*syscall.Stat_t).Blocks * 512; alloc >= fi.Size() {
		t.Errorf("recovered file is not sparse: %d of %d bytes allocated", alloc, fi.Size())
	}
}

// A record copied into a second store (a store moved by hand, a backup
// restored beside the original) names the identity and the tag of the
// first store's live device, and its file is missing there. The second
// store must not take that device for its own: recover (which would copy
// it, then detach it), detach, status and a forced delete in it leave the
// first store's device and data alone.
func TestRecordCopiedToAnotherStore(t *testing.T) {
	t.Parallel()
	c := newCase(t)
	a := c.store("a")
	b := c.store("b")
	u := c.create(a, "v")
	dev := c.attach(a, u)
	want := deviceDigest(t, dev)
	record, err := os.ReadFile(filepath.Join(a, u+".json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(b, u+".json"), record, 0o600); err != nil {
		t.Fatal(err)
	}
	if st := c.status(b, "v"); st.Device != "" {
		t.Errorf("the copied record's status names %s, the other store's device", st.Device)
	}
	before := c.snapshot()
	c.expectCode(c.sv(b, "recover", "v"), 1, 2)
	c.unchanged(before)
	c.sv(b, "detach", "v")
	c.unchanged(before)
	c.sv(b, "delete", "--force", "v")
	after := c.loops()
	if before.loops[dev] != after[dev].String() {
		t.Errorf("%s after a forced delete of the copied record: %s, was %s", dev, after[dev], before.loops[dev])
	}
	if st := c.status(a, "v"); st.State != "ready" || st.Device != dev {
		t.Errorf("the first store's volume after all that: state %q device %q, want ready on %s", st.State, st.Device, dev)
	} else if got := deviceDigest(t, dev); got != want {
		t.Errorf("%s's content changed: sha256:%s, was sha256:%s", dev, got[:16], want[:16])
	}
}
