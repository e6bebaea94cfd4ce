package iolimit

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// loopDevice binds a small file to a loop device for the test.
func loopDevice(t *testing.T) (string, uint64) {
	t.Helper()
	f := filepath.Join(t.TempDir(), "backing")
	if err := os.WriteFile(f, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(f, 8<<20); err != nil {
		t.Fatal(err)
	}
	dev := testutil.Losetup(t, f)
	n, err := DeviceNumber(dev)
	if err != nil {
		t.Fatal(err)
	}
	return dev, n
}

// TestSetRemove sets, reads back and removes a loop device's limits on a
// cgroup of the test's own where the host has cgroup v2's io controller;
// elsewhere it proves that setting fails with ErrNotSupported, saying so,
// and that nothing was made.
func TestSetRemove(t *testing.T) {
	testutil.RequireRoot(t)
	_, dev := loopDevice(t)
	m, cg := testutil.PrivateCgroup2(t)
	c := Config{Mount: m, Cgroup: cg}
	want := Limits{ReadBPS: 20 << 20, WriteBPS: 10 << 20, ReadIOPS: 300, WriteIOPS: 200}
	if err := c.Supported(); testutil.HostLacks(t, testutil.FeatureIOLimits, err) {
		if !errors.Is(err, ErrNotSupported) || !strings.Contains(err.Error(), "io controller") {
			t.Fatalf("Supported() = %v, want ErrNotSupported naming the io controller", err)
		}
		err = c.Set(dev, want)
		if !errors.Is(err, ErrNotSupported) {
			t.Fatalf("Set on a host without io = %v, want ErrNotSupported", err)
		}
		if _, err := os.Lstat(filepath.Join(m, cg)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("a refused Set left %s: %v", filepath.Join(m, cg), err)
		}
		if err := c.Set(dev, Limits{}); err != nil {
			t.Errorf("Set of no limits on a host without io = %v, want nil (nothing to remove)", err)
		}
		if err := c.Remove(dev); err != nil {
			t.Errorf("Remove on a host without io = %v, want nil", err)
		}
		return // the refusal is what is tested
	}
	if err := c.Set(dev, want); err != nil {
		t.Fatal(err)
	}
	got, err := c.Get(dev)
	if err != nil || got != want {
		t.Fatalf("Get after Set = %+v, %v; want %+v", got, err, want)
	}
	data, _ := os.ReadFile(filepath.Join(m, cg, "io.max"))
	if !strings.Contains(string(data), "7:") {
		t.Errorf("io.max = %q, want an entry for the loop device", data)
	}
	half := Limits{WriteBPS: 5 << 20}
	if err := c.Set(dev, half); err != nil {
		t.Fatal(err)
	}
	if got, err := c.Get(dev); err != nil || got != half {
		t.Fatalf("Get after a change = %+v, %v; want %+v", got, err, half)
	}
	if err := c.Remove(dev); err != nil {
		t.Fatal(err)
	}
	if got, err := c.Get(dev); err != nil || !got.IsZero() {
		t.Fatalf("Get after Remove = %+v, %v; want none", got, err)
	}
}

// podsCgroup is the setting of the tests of Set's undo: a private cgroup
// v2 hierarchy mounted at m whose top cgroup top is the test's, the pods'
// cgroup cg below it (not made), and a loop device's number dev. Where
// the hierarchy offers no io controller the test is skipped as
// testutil.HostLacks says: the VM suite's guest runs it.
func podsCgroup(t *testing.T) (m, top, cg string, dev uint64) {
	t.Helper()
	testutil.RequireRoot(t)
	m, top = testutil.PrivateCgroup2(t)
	if testutil.HostLacks(t, testutil.FeatureIOLimits, Config{Mount: m, Cgroup: top}.Supported()) {
		t.Skip("no io controller here; the VM suite's guest run has one and runs this")
	}
	_, dev = loopDevice(t)
	return m, top, filepath.Join(top, "pods"), dev
}

// TestRefusedSetChangesNothing: a Set whose io.max write the kernel
// refuses (a device number no block device has) takes back what it did
// itself, and only that: the cgroups it made are gone, the io controller
// it enabled is disabled again, and cgroups and controllers that were
// there before stay.
func TestRefusedSetChangesNothing(t *testing.T) {
	m, top, cg, dev := podsCgroup(t)
	noDevice := unix.Mkdev(0, 1<<19) // major 0 names no block device
	subtreeIO := func(t *testing.T, dir string) bool {
		t.Helper()
		data, err := os.ReadFile(filepath.Join(m, dir, "cgroup.subtree_control"))
		if err != nil {
			t.Fatal(err)
		}
		return slices.Contains(strings.Fields(string(data)), "io")
	}
	exists := func(dir string) bool {
		_, err := os.Lstat(filepath.Join(m, dir))
		return err == nil
	}
	for _, tc := range []struct {
		name         string
		top, pods    bool // the cgroups exist before the Set
		ioEnabledTop bool // top's subtree_control has io before the Set
	}{
		{"nothing made yet", false, false, false},
		{"parent made, io not enabled in it", true, false, false},
		{"parent made, io enabled in it", true, false, true},
		{"all made", true, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Cleanup(func() {
				os.Remove(filepath.Join(m, cg))
				os.Remove(filepath.Join(m, top))
			})
			if tc.top {
				if err := os.Mkdir(filepath.Join(m, top), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			if tc.ioEnabledTop {
				if _, err := enableIO(m, filepath.Join(m, cg)); err != nil {
					t.Fatal(err)
				}
			}
			if tc.pods {
				if err := os.Mkdir(filepath.Join(m, cg), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			c := Config{Mount: m, Cgroup: cg}
			rootIO := subtreeIO(t, ".")
			if err := c.Set(noDevice, Limits{WriteIOPS: 10}); err == nil || strings.Contains(err.Error(), "undoing") {
				t.Fatalf("Set for no device = %v, want the kernel's refusal, undone", err)
			}
			if got := subtreeIO(t, "."); got != rootIO {
				t.Errorf("io in the root's subtree_control: %t after a refused Set, %t before", got, rootIO)
			}
			if exists(top) != tc.top || exists(cg) != tc.pods {
				t.Errorf("after a refused Set: %s exists %t, %s exists %t; want %t, %t", top, exists(top), cg, exists(cg), tc.top, tc.pods)
			}
			if tc.top && subtreeIO(t, top) != tc.ioEnabledTop {
				t.Errorf("io in %s's subtree_control: %t after a refused Set, %t before", top, !tc.ioEnabledTop, tc.ioEnabledTop)
			}
			// The same Set for a device works, and sets it up.
			if err := c.Set(dev, Limits{WriteIOPS: 10}); err != nil {
				t.Fatal(err)
			}
			if err := c.Remove(dev); err != nil {
				t.Fatal(err)
			}
			if !exists(cg) || !subtreeIO(t, top) {
				t.Errorf("a Set that worked left no %s with io enabled above it", cg)
			}
		})
	}
}

// TestRefusedSetKeepsAConcurrentSet: a refused Set undoes the io
// controller it enabled; a Set of another device that ran meanwhile (the
// plugin and the CLI each set limits) relied on that controller and must
// keep its limit. Sets are serialised on the hierarchy (lockHierarchy):
// the second waits for the first's undo, then enables io again itself.
func TestRefusedSetKeepsAConcurrentSet(t *testing.T) {
	m, top, cg, dev := podsCgroup(t)
	t.Cleanup(func() {
		os.Remove(filepath.Join(m, cg))
		os.Remove(filepath.Join(m, top))
	})
	c := Config{Mount: m, Cgroup: cg}
	want := Limits{WriteIOPS: 10}
	other := make(chan error, 1)
	t.Cleanup(func() { setRace = nil })
	setRace = func() {
		setRace = nil // the other Set runs without the hook
		go func() { other <- c.Set(dev, want) }()
		// The other Set is done in well under a second unless it waits
		// for this one.
		select {
		case err := <-other:
			other <- err
		case <-time.After(time.Second):
		}
	}
	if err := c.Set(unix.Mkdev(0, 1<<19), want); err == nil { // major 0: refused by the kernel
		t.Fatal("Set for no device worked")
	}
	if err := <-other; err != nil {
		t.Fatalf("the concurrent Set of %d:%d: %v", unix.Major(dev), unix.Minor(dev), err)
	}
	if got, err := c.Get(dev); err != nil || got != want {
		t.Errorf("limits of %d:%d after a refused Set beside it: %+v, %v; want %+v", unix.Major(dev), unix.Minor(dev), got, err, want)
	}
	if err := c.Remove(dev); err != nil {
		t.Fatal(err)
	}
}

// TestHostRefusal: on a host whose /sys/fs/cgroup is not cgroup v2, a
// limit is refused with ErrNotSupported that names cgroup v1 or the
// hybrid layout, never accepted and ignored.
func TestHostRefusal(t *testing.T) {
	testutil.RequireRoot(t)
	var st unix.Statfs_t
	if err := unix.Statfs(DefaultMount, &st); err != nil {
		t.Fatal(err)
	}
	_, dev := loopDevice(t)
	err := Config{}.Set(dev, Limits{WriteIOPS: 10})
	if st.Type == unix.CGROUP2_SUPER_MAGIC {
		// A cgroup v2 host: Set would write the pods' cgroup of the real
		// node, which a test must not do; Supported decides alone.
		if serr := (Config{}).Supported(); serr != nil && !errors.Is(serr, ErrNotSupported) {
			t.Fatalf("Supported() = %v", serr)
		}
		t.Logf("cgroup v2 host: refusal path not reachable here")
		return
	}
	if !errors.Is(err, ErrNotSupported) || !strings.Contains(err.Error(), "cgroup v2") {
		t.Fatalf("Set on a cgroup v1 host = %v, want ErrNotSupported asking for cgroup v2", err)
	}
}
