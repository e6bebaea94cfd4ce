package volume

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/iolimit"
	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// limitStore opens a store whose limits go to a cgroup of the test's own
// on a private cgroup v2 mount: the host's hierarchy where it runs cgroup
// v2 (with io), one without io where io is bound to cgroup v1 blkio. It
// reports whether limits can be enforced here.
func limitStore(t *testing.T) (*Store, iolimit.Config, bool) {
	t.Helper()
	m, cg := testutil.PrivateCgroup2(t)
	cfg := iolimit.Config{Mount: m, Cgroup: cg}
	s := newStore(t, Options{IOLimits: cfg})
	return s, cfg, !testutil.HostLacks(t, testutil.FeatureIOLimits, cfg.Supported())
}

func rawAttached(t *testing.T, s *Store, name string) *Volume {
	t.Helper()
	v := mustCreate(t, s, CreateRequest{Name: name, SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true, KeepAttached: true})
	t.Cleanup(func() { s.Detach(v.UUID, DetachOptions{Force: true}) })
	return v
}

func metaBytes(t *testing.T, s *Store, uuid string) []byte {
	t.Helper()
	b, err := os.ReadFile(s.metaPath(uuid))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func devNumber(t *testing.T, s *Store, ref string) uint64 {
	t.Helper()
	st, err := s.Status(ref)
	if err != nil || !st.Attached {
		t.Fatalf("status %s: %+v, %v; want attached", ref, st, err)
	}
	n, err := iolimit.DeviceNumber(st.Device)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestChangeLive changes direct I/O and provisioning of an attached
// volume, and refuses bad limits changing nothing.
func TestChangeLive(t *testing.T) {
	s, _, _ := limitStore(t)
	v := rawAttached(t, s, "live")
	st, err := s.Status(v.UUID)
	if err != nil {
		t.Fatal(err)
	}
	kernelDirect := st.DirectIOActive // what the store's filesystem allows
	t.Logf("direct I/O as attached: %t", kernelDirect)

	off := false
	st, err = s.Change(v.UUID, Change{DirectIO: &off})
	if err != nil {
		t.Fatal(err)
	}
	if st.DirectIOActive || st.DirectIO {
		t.Errorf("after directIO=false: active %t, requested %t", st.DirectIOActive, st.DirectIO)
	}
	on := true
	if st, err = s.Change(v.UUID, Change{DirectIO: &on}); err != nil {
		t.Fatal(err)
	}
	if st.DirectIOActive != kernelDirect || !st.DirectIO {
		t.Errorf("after directIO=true: active %t (want %t), requested %t", st.DirectIOActive, kernelDirect, st.DirectIO)
	}

	if got := allocated(t, v.BackingFile); got >= v.SizeBytes {
		t.Fatalf("thin volume already has %d of %d bytes", got, v.SizeBytes)
	}
	st, err = s.Change(v.UUID, Change{Preallocate: true, Labels: map[string]string{"k": "thick"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := allocated(t, v.BackingFile); got < v.SizeBytes || !st.Preallocate || st.Labels["k"] != "thick" {
		t.Errorf("after thick: %d of %d bytes allocated, preallocate %t, labels %v", got, v.SizeBytes, st.Preallocate, st.Labels)
	}

	before := metaBytes(t, s, v.UUID)
	for _, bad := range []IOLimits{{ReadIOPS: iolimit.MaxIOPS + 1}, {WriteBPS: ^uint64(0)}} {
		if _, err := s.Change(v.UUID, Change{IOLimits: LimitsTo(bad), DirectIO: &off}); !errors.Is(err, ErrInvalid) {
			t.Errorf("Change(%+v) = %v, want ErrInvalid", bad, err)
		}
	}
	if st, _ := s.Status(v.UUID); !bytes.Equal(metaBytes(t, s, v.UUID), before) || st.DirectIOActive != kernelDirect {
		t.Errorf("a refused change changed the volume (directIO active %t)", st.DirectIOActive)
	}
	if _, err := s.Change("nosuch", Change{DirectIO: &off}); !errors.Is(err, ErrNotFound) {
		t.Errorf("Change of an unknown volume = %v, want ErrNotFound", err)
	}
}

// TestLimitsFollowTheDevice: limits set live are on the device at once,
// gone when it is detached, back at the next attach (whatever its number)
// and lifted by a change to none. Where the host cannot enforce limits,
// create, change and attach of a limited volume fail with ErrNotSupported
// and leave nothing: no volume, no metadata change, no bound device.
func TestLimitsFollowTheDevice(t *testing.T) {
	s, cfg, ok := limitStore(t)
	ctx := context.Background()
	want := IOLimits{WriteBPS: 10 << 20, ReadIOPS: 200}
	if !ok {
		_, err := s.Create(ctx, CreateRequest{Name: "limited", SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true, IOLimits: want, KeepAttached: true})
		if !errors.Is(err, ErrNotSupported) {
			t.Fatalf("Create with limits = %v, want ErrNotSupported", err)
		}
		assertNothingLeft(t, s)
		v := rawAttached(t, s, "plain")
		before := metaBytes(t, s, v.UUID)
		if _, err := s.Change(v.UUID, Change{IOLimits: LimitsTo(want)}); !errors.Is(err, ErrNotSupported) {
			t.Fatalf("Change of limits = %v, want ErrNotSupported", err)
		}
		if !bytes.Equal(metaBytes(t, s, v.UUID), before) {
			t.Errorf("a refused limit changed the metadata")
		}
		// Limits recorded where they could be enforced (the store moved
		// hosts): attach refuses and leaves no device.
		if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
			t.Fatal(err)
		}
		moved, _ := s.readMeta(v.UUID)
		moved.IOLimits = want
		if err := s.writeMeta(moved); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Attach(ctx, v.UUID); !errors.Is(err, ErrNotSupported) {
			t.Errorf("Attach of a limited volume = %v, want ErrNotSupported", err)
		}
		if _, err := s.AttachAll(ctx); !errors.Is(err, ErrNotSupported) {
			t.Errorf("AttachAll with a limited volume = %v, want ErrNotSupported", err)
		}
		if devs := boundUnder(s.Root()); len(devs) > 0 {
			t.Errorf("refused attaches left %v bound", devs)
		}
		return
	}
	made := mustCreate(t, s, CreateRequest{Name: "made-limited", SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true, IOLimits: want, KeepAttached: true})
	t.Cleanup(func() { s.Detach(made.UUID, DetachOptions{}) })
	if got, err := cfg.Get(devNumber(t, s, made.UUID)); err != nil || got != want {
		t.Fatalf("io.max entry of a volume created attached with limits = %+v, %v; want %+v", got, err, want)
	}
	v := rawAttached(t, s, "limited")
	n := devNumber(t, s, v.UUID)
	if _, err := s.Change(v.UUID, Change{IOLimits: LimitsTo(want)}); err != nil {
		t.Fatal(err)
	}
	if got, err := cfg.Get(n); err != nil || got != want {
		t.Fatalf("io.max entry after Change = %+v, %v; want %+v", got, err, want)
	}
	if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	if got, err := cfg.Get(n); err != nil || !got.IsZero() {
		t.Fatalf("io.max entry after Detach = %+v, %v; want none", got, err)
	}
	if _, err := s.AttachAll(ctx); err != nil {
		t.Fatal(err)
	}
	n = devNumber(t, s, v.UUID)
	if got, err := cfg.Get(n); err != nil || got != want {
		t.Fatalf("io.max entry after AttachAll = %+v, %v; want %+v", got, err, want)
	}
	if _, err := s.Change(v.UUID, Change{IOLimits: LimitsTo(IOLimits{})}); err != nil {
		t.Fatal(err)
	}
	if got, err := cfg.Get(n); err != nil || !got.IsZero() {
		t.Fatalf("io.max entry after lifting the limits = %+v, %v; want none", got, err)
	}
}

// TestDetachLeavesTheNextBindersLimits: once the kernel has unbound a
// limited volume's device, its number is anyone's; a bind that takes it
// at once and sets limits of its own keeps them. The detach must not drop
// them after the fact (it drops its own before the unbind).
func TestDetachLeavesTheNextBindersLimits(t *testing.T) {
	s, cfg, ok := limitStore(t)
	if !ok {
		t.Skip("no io controller here; the VM suite's guest run has one and runs this")
	}
	v := mustCreate(t, s, CreateRequest{Name: "limited", SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true,
		IOLimits: IOLimits{WriteBPS: 10 << 20}, KeepAttached: true})
	t.Cleanup(func() { s.Detach(v.UUID, DetachOptions{}) })
	other := filepath.Join(t.TempDir(), "other")
	if err := os.WriteFile(other, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(other, 8<<20); err != nil {
		t.Fatal(err)
	}
	theirs := IOLimits{ReadIOPS: 123}
	var n uint64
	detachedRace = func(d *loop.Device) {
		detachedRace = nil
		var err error
		if n, err = d.DevT(); err != nil {
			t.Error(err)
			return
		}
		if out, err := exec.Command("losetup", d.Path, other).CombinedOutput(); err != nil {
			t.Errorf("losetup %s %s: %v: %s", d.Path, other, err, out)
			return
		}
		t.Cleanup(func() { testutil.DetachIfServes(d.Path, other) })
		if err := cfg.Set(n, theirs); err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(func() { detachedRace = nil })
	if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("the detach never unbound a device")
	}
	if got, err := cfg.Get(n); err != nil || got != theirs {
		t.Errorf("limits of the next binder of the number after the detach = %+v, %v; want %+v", got, err, theirs)
	}
}

// TestLimitsStayOnADeviceLeftBound: a detach that leaves the device bound
// (busy: mounted or held exclusively; deferred: still open) leaves the
// volume's limits on it, for whoever still does I/O through it.
func TestLimitsStayOnADeviceLeftBound(t *testing.T) {
	s, cfg, ok := limitStore(t)
	if !ok {
		t.Skip("no io controller here; the VM suite's guest run has one and runs this")
	}
	want := IOLimits{WriteBPS: 10 << 20, ReadIOPS: 200}
	for _, tc := range []struct {
		name  string
		flags int
		err   error
	}{
		{"busy", unix.O_RDONLY | unix.O_EXCL, ErrBusy},
		{"deferred", unix.O_RDONLY, loop.ErrDeferred},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := mustCreate(t, s, CreateRequest{Name: "held-" + tc.name, SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true,
				IOLimits: want, KeepAttached: true})
			t.Cleanup(func() { s.Detach(v.UUID, DetachOptions{}) })
			st, err := s.Status(v.UUID)
			if err != nil {
				t.Fatal(err)
			}
			n := devNumber(t, s, v.UUID)
			fd, err := unix.Open(st.Device, tc.flags|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			err = s.Detach(v.UUID, DetachOptions{})
			if got, gerr := cfg.Get(n); gerr != nil || got != want {
				t.Errorf("limits of %s after a detach that left it bound = %+v, %v; want %+v", st.Device, got, gerr, want)
			}
			unix.Close(fd)
			if !errors.Is(err, tc.err) {
				t.Fatalf("Detach while %s = %v, want %v", tc.name, err, tc.err)
			}
		})
	}
}

// TestLimitsOnlyOnAHeldDevice: a volume's limits are written for its
// device's number only while the device is held proven the volume's.
// Someone who detaches the device between the proof and the write and
// binds the number to a file of their own, with limits of their own, keeps
// them: their detach is only deferred while the device is held, so their
// bind fails, or, if it took the number, the volume's limits stay off it.
func TestLimitsOnlyOnAHeldDevice(t *testing.T) {
	s, cfg, ok := limitStore(t)
	if !ok {
		t.Skip("no io controller here; the VM suite's guest run has one and runs this")
	}
	ctx := context.Background()
	want := IOLimits{WriteBPS: 10 << 20}
	for _, tc := range []struct {
		name string
		op   func(v *Volume) error
	}{
		{"change", func(v *Volume) error {
			_, err := s.Change(v.UUID, Change{IOLimits: LimitsTo(IOLimits{ReadIOPS: 200})})
			return err
		}},
		{"attach", func(v *Volume) error { _, err := s.Attach(ctx, v.UUID); return err }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := mustCreate(t, s, CreateRequest{Name: "raced-" + tc.name, SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true,
				IOLimits: want, KeepAttached: true})
			t.Cleanup(func() { s.Detach(v.UUID, DetachOptions{Force: true}) })
			other := filepath.Join(t.TempDir(), "other")
			if err := os.WriteFile(other, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(other, 8<<20); err != nil {
				t.Fatal(err)
			}
			theirs := IOLimits{ReadIOPS: 123}
			var dev string
			var n uint64
			limitsRace = func(d *loop.Device) {
				limitsRace = nil
				var err error
				if n, err = d.DevT(); err != nil {
					t.Error(err)
					return
				}
				dev = d.Path
				t.Cleanup(func() { testutil.DetachIfServes(dev, other) })
				if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
					t.Errorf("losetup -d %s: %v: %s", dev, err, out)
					return
				}
				if out, err := exec.Command("losetup", dev, other).CombinedOutput(); err != nil {
					t.Logf("their bind of %s: %v: %s", dev, err, out)
					return
				}
				if err := cfg.Set(n, theirs); err != nil {
					t.Error(err)
				}
			}
			t.Cleanup(func() { limitsRace = nil })
			err := tc.op(v)
			t.Logf("%s with the device detached under it: %v", tc.name, err)
			if dev == "" {
				t.Fatal("no limits were written")
			}
			b, _ := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/loop/backing_file")
			if strings.TrimSpace(string(b)) != other {
				return // their bind failed: the number stayed the volume's
			}
			if got, err := cfg.Get(n); err != nil || got != theirs {
				t.Errorf("limits of %s, bound to their file = %+v, %v; want theirs, %+v", dev, got, err, theirs)
			}
		})
	}
}

// TestLimitChangeOver: a change replaces the limits it gives, 0 lifting
// one, and keeps the others as they are.
func TestLimitChangeOver(t *testing.T) {
	n := func(v uint64) *uint64 { return &v }
	have := IOLimits{ReadBPS: 1, WriteBPS: 2, ReadIOPS: 3, WriteIOPS: 4}
	for _, tc := range []struct {
		name string
		ch   LimitChange
		want IOLimits
	}{
		{"nothing", LimitChange{}, have},
		{"one set", LimitChange{WriteIOPS: n(40)}, IOLimits{ReadBPS: 1, WriteBPS: 2, ReadIOPS: 3, WriteIOPS: 40}},
		{"one lifted", LimitChange{ReadBPS: n(0)}, IOLimits{WriteBPS: 2, ReadIOPS: 3, WriteIOPS: 4}},
		{"all", LimitsTo(IOLimits{ReadIOPS: 9}), IOLimits{ReadIOPS: 9}},
		{"all lifted", LimitsTo(IOLimits{}), IOLimits{}},
	} {
		if got := tc.ch.Over(have); got != tc.want {
			t.Errorf("%s: Over(%+v) = %+v, want %+v", tc.name, have, got, tc.want)
		}
		if tc.ch.IsZero() != (tc.name == "nothing") {
			t.Errorf("%s: IsZero() = %t", tc.name, tc.ch.IsZero())
		}
	}
}

// TestParseBPS: a byte rate is a size or max; zero, which would stop all
// I/O, is refused saying max is how to ask for no limit, as ParseIOPS
// says it; every refusal is ErrInvalid.
func TestParseBPS(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"max", 0, true},
		{"10M", 10 << 20, true},
		{"1.5Ki", 1536, true},
		{"0", 0, false},
		{"0.0M", 0, false},
		{"-1", 0, false},
		{"99999999P", 0, false},
		{"", 0, false},
	} {
		got, err := ParseBPS(tc.in)
		if tc.ok != (err == nil) || got != tc.want || (err != nil && !errors.Is(err, ErrInvalid)) {
			t.Errorf("ParseBPS(%q) = %d, %v; want %d, ok=%t", tc.in, got, err, tc.want, tc.ok)
		}
		if err != nil && !strings.Contains(err.Error(), "max for no limit") {
			t.Errorf("ParseBPS(%q): %v does not say max is no limit", tc.in, err)
		}
	}
}
