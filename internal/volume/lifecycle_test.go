package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/udev"
)

// fakeLifecycle records the calls a Store makes, each with the state the
// volume's metadata had at that moment, and fails where told.
type fakeLifecycle struct {
	s                                  *Store // to read the metadata at each call
	calls                              []string
	enabled                            map[string]bool
	list                               []EnabledVolume
	listErr                            error // EnabledVolumes' error, with list
	failEnable, failStart, failDisable error
	onDisable                          func(uuid string)
}

func (f *fakeLifecycle) state(uuid string) State {
	v, err := f.s.lookup(uuid)
	if err != nil {
		return "gone"
	}
	return v.State
}

// unlocked fails a call that starts or stops a unit while the volume's
// lock is held: the unit's attach or detach would wait for it forever
// (flock is per open file, so the same process blocks too).
func (f *fakeLifecycle) unlocked(uuid string) error {
	fd, err := unix.Open(filepath.Join(f.s.Root(), lockDir, uuid), unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return fmt.Errorf("unit of %s started or stopped with the volume's lock held: its attach or detach would deadlock: %w", uuid, err)
	}
	return nil
}

func (f *fakeLifecycle) Enable(_ context.Context, uuid, root string, mountsFor []string, start bool) error {
	f.calls = append(f.calls, fmt.Sprintf("enable %s start=%v mounts=%v (%s)", uuid, start, mountsFor, f.state(uuid)))
	if start {
		if err := f.unlocked(uuid); err != nil {
			return err
		}
	}
	if f.failEnable != nil {
		return f.failEnable
	}
	if root != f.s.Root() {
		return fmt.Errorf("enable %s: root %s, want %s", uuid, root, f.s.Root())
	}
	f.enabled[uuid] = true
	return nil
}

func (f *fakeLifecycle) Start(_ context.Context, uuid string) error {
	f.calls = append(f.calls, fmt.Sprintf("start %s (%s)", uuid, f.state(uuid)))
	if err := f.unlocked(uuid); err != nil {
		return err
	}
	return f.failStart
}

func (f *fakeLifecycle) Disable(_ context.Context, uuid string) error {
	f.calls = append(f.calls, fmt.Sprintf("disable %s (%s)", uuid, f.state(uuid)))
	if err := f.unlocked(uuid); err != nil {
		return err
	}
	if f.failDisable != nil {
		return f.failDisable
	}
	delete(f.enabled, uuid)
	if f.onDisable != nil {
		f.onDisable(uuid)
	}
	return nil
}

func (f *fakeLifecycle) Enabled(uuid string) bool { return f.enabled[uuid] }

func (f *fakeLifecycle) EnabledVolumes() ([]EnabledVolume, error) { return f.list, f.listErr }

// newManagedStore opens a store whose Lifecycle is a fresh fake.
func newManagedStore(t *testing.T) (*Store, *fakeLifecycle) {
	t.Helper()
	f := &fakeLifecycle{enabled: map[string]bool{}}
	s := newStore(t, Options{Lifecycle: f})
	f.s = s
	return s, f
}

// expand replaces U and R in want with the volume's UUID and the root.
func expand(want []string, uuid, root string) []string {
	out := make([]string, len(want))
	for i, w := range want {
		out[i] = strings.NewReplacer("U", uuid, "R", root).Replace(w)
	}
	return out
}

var errFake = errors.New("fake service manager failure")

// TestCreateEnablesBeforeReady: create enables the unit while the volume
// is still creating, and starts it once ready if asked to attach; a
// failed enable leaves no ready volume.
func TestCreateEnablesBeforeReady(t *testing.T) {
	tests := []struct {
		name         string
		keepAttached bool
		failEnable   error
		failStart    error
		wantCalls    []string
		wantErr      error
		wantReady    bool
		wantAttached bool
	}{
		{"start", true, nil, nil, []string{"enable U start=false mounts=[R] (creating)", "start U (ready)"}, nil, true, true},
		{"no start", false, nil, nil, []string{"enable U start=false mounts=[R] (creating)"}, nil, true, false},
		{"enable fails", true, errFake, nil, []string{"enable U start=false mounts=[R] (creating)"}, errFake, false, false},
		{"start fails", true, nil, errFake, []string{"enable U start=false mounts=[R] (creating)", "start U (ready)"}, errFake, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s, f := newManagedStore(t)
			f.failEnable, f.failStart = tt.failEnable, tt.failStart
			uuid := NewUUID()
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			_, err := s.Create(ctx, CreateRequest{Name: "v", UUID: uuid, SizeBytes: MiB, Mode: ModeBlock, NoPartition: true, KeepAttached: tt.keepAttached})
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("Create = %v, want %v", err, tt.wantErr)
			}
			if tt.failStart != nil && !strings.Contains(err.Error(), "was created, but") {
				t.Errorf("a start failure after ready does not say the volume was created: %v", err)
			}
			if want := expand(tt.wantCalls, uuid, s.Root()); !slices.Equal(f.calls, want) {
				t.Errorf("calls\n%q\nwant\n%q", f.calls, want)
			}
			st, err := s.Status(uuid)
			ready := err == nil && st.State == StateReady
			// What a failed create leaves behind is create's business.
			if ready != tt.wantReady || (ready && st.Attached != tt.wantAttached) {
				t.Errorf("after create: ready %v attached %v (%v); want ready %v attached %v", ready, err == nil && st.Attached, err, tt.wantReady, tt.wantAttached)
			}
		})
	}
}

// TestDeleteDisablesUnit: delete refuses a volume in use before touching
// its unit, stops and disables the unit, deletes, and enables and starts
// the unit again when the volume turned out busy after all.
func TestDeleteDisablesUnit(t *testing.T) {
	tests := []struct {
		name        string
		enabled     bool
		holdBefore  bool // the device is held open exclusively before delete
		holdOnStop  bool // ... from the moment the unit is stopped
		failDisable error
		broken      bool
		wantCalls   []string
		wantErr     error
		wantGone    bool
	}{
		{"enabled", true, false, false, nil, false, []string{"disable U (ready)"}, nil, true},
		{"not enabled", false, false, false, nil, false, []string{"disable U (ready)"}, nil, true},
		{"in use: unit untouched", true, true, false, nil, false, nil, ErrBusy, false},
		{"in use after the stop: unit back", true, false, true, nil, false,
			[]string{"disable U (ready)", "enable U start=true mounts=[R] (ready)"}, ErrBusy, false},
		{"in use after the stop, was not enabled", false, false, true, nil, false, []string{"disable U (ready)"}, ErrBusy, false},
		{"disable fails", true, false, false, errFake, false, []string{"disable U (ready)"}, errFake, false},
		{"broken, enabled", true, false, false, nil, true, []string{"disable U (gone)"}, nil, true},
		{"broken, not enabled", false, false, false, nil, true, nil, nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s, f := newManagedStore(t)
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: MiB, Mode: ModeBlock, NoPartition: true, KeepAttached: true})
			t.Cleanup(func() { s.DetachAll(DetachOptions{}); s.Delete(ctx, v.UUID, DetachOptions{}) })
			st, err := s.Status(v.UUID)
			if err != nil || !st.Attached {
				t.Fatalf("status after create: %+v, %v", st, err)
			}
			f.calls, f.enabled[v.UUID] = nil, tt.enabled
			if !tt.enabled {
				delete(f.enabled, v.UUID)
			}
			f.failDisable = tt.failDisable
			hold := func() {
				fd, err := unix.Open(st.Device, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { unix.Close(fd) })
			}
			if tt.holdBefore {
				hold()
			}
			if tt.holdOnStop {
				f.onDisable = func(string) { hold() }
			}
			if tt.broken {
				if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(s.metaPath(v.UUID), []byte("{"), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			err = s.Delete(ctx, v.UUID, DetachOptions{})
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("Delete = %v, want %v", err, tt.wantErr)
			}
			if want := expand(tt.wantCalls, v.UUID, s.Root()); !slices.Equal(f.calls, want) {
				t.Errorf("calls\n%q\nwant\n%q", f.calls, want)
			}
			_, err = s.Get(v.UUID)
			if gone := errors.Is(err, ErrNotFound); gone != tt.wantGone {
				t.Errorf("volume gone %v (%v), want %v", gone, err, tt.wantGone)
			}
		})
	}
}

// TestActivate: adopted (or any ready) volumes are enabled, and started
// if asked, through the service manager; without one they are attached
// directly if asked. The unit needs the store mounted.
func TestActivate(t *testing.T) {
	tests := []struct {
		name         string
		managed      bool
		start        bool
		wantCalls    []string
		wantAttached bool
	}{
		{"managed, start", true, true, []string{"enable U start=true mounts=[R] (ready)"}, false},
		{"managed, no start", true, false, []string{"enable U start=false mounts=[R] (ready)"}, false},
		{"unmanaged, start", false, true, nil, true},
		{"unmanaged, no start", false, false, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s, f := newManagedStore(t)
			if !tt.managed {
				s.opts.Lifecycle = nil
			}
			v := rawVolume(t, s, "v")
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			f.calls = nil
			if err := s.Activate(ctx, []*Volume{v}, tt.start); err != nil {
				t.Fatal(err)
			}
			if want := expand(tt.wantCalls, v.UUID, s.Root()); !slices.Equal(f.calls, want) {
				t.Errorf("calls\n%q\nwant\n%q", f.calls, want)
			}
			if st, err := s.Status(v.UUID); err != nil || st.Attached != tt.wantAttached {
				t.Errorf("attached %v (%v), want %v", st.Attached, err, tt.wantAttached)
			}
		})
	}
}

// TestAttachEnabled: the volumes of the enabled units are attached, store
// by store; volumes without an enabled unit are left alone; a missing
// volume, a missing store and units the lifecycle could not list are
// reported without giving up on the rest.
func TestAttachEnabled(t *testing.T) {
	ctx := context.Background()
	a, b := newStore(t, Options{}), newStore(t, Options{})
	a1, a2, off := rawVolume(t, a, "a1"), rawVolume(t, a, "a2"), rawVolume(t, a, "off")
	b1 := rawVolume(t, b, "b1")
	t.Cleanup(func() { a.DetachAll(DetachOptions{}); b.DetachAll(DetachOptions{}) })
	gone := NewUUID()
	nowhere := filepath.Join(t.TempDir(), "no-store")
	f := &fakeLifecycle{list: []EnabledVolume{
		{a1.UUID, a.Root()}, {b1.UUID, b.Root()}, {gone, a.Root()}, {a2.UUID, a.Root()}, {NewUUID(), nowhere},
	}, listErr: fmt.Errorf("unit left out: %w", ErrInvalid)}
	sts, err := AttachEnabled(ctx, f, Options{})
	if err == nil || !strings.Contains(err.Error(), gone) || !strings.Contains(err.Error(), nowhere) || !errors.Is(err, ErrInvalid) {
		t.Errorf("AttachEnabled error %v; want one naming %s and %s, and the unit left out", err, gone, nowhere)
	}
	var names []string
	for _, st := range sts {
		if st.Attached {
			names = append(names, st.Name)
		}
	}
	if want := []string{"a1", "a2", "b1"}; !slices.Equal(names, want) {
		t.Errorf("attached %v, want %v", names, want)
	}
	if st, err := a.Status(off.UUID); err != nil || st.Attached {
		t.Errorf("volume without an enabled unit: attached %v (%v)", st.Attached, err)
	}
}

// TestAttachEnabledOneDeadline: UdevTimeout bounds the whole of
// AttachEnabled, every store together, not each store afresh: where udev
// runs and its links never come, two stores take one timeout, so the
// boot unit's TimeoutSec above it is never reached by a later store.
func TestAttachEnabledOneDeadline(t *testing.T) {
	if udev.Host.Running() {
		t.Skip("udev runs on this host: " + string(udev.Host) + " has its control socket")
	}
	const timeout = 2 * time.Second
	dir := udev.Dir(t.TempDir())
	if err := os.WriteFile(filepath.Join(string(dir), "control"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	opts := Options{Udev: dir, UdevTimeout: timeout}
	var list []EnabledVolume
	for _, name := range []string{"a", "b"} {
		s := newStore(t, opts)
		v := mustCreate(t, s, CreateRequest{Name: name, SizeBytes: 16 << 20})
		t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
		list = append(list, EnabledVolume{v.UUID, s.Root()})
	}
	start := time.Now()
	_, err := AttachEnabled(context.Background(), &fakeLifecycle{list: list}, opts)
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("AttachEnabled = %v, want the udev waits to reach the deadline", err)
	}
	// Each store afresh would take two timeouts at least.
	if took > timeout*7/4 {
		t.Errorf("AttachEnabled took %v for two stores; want one deadline of %v for both", took, timeout)
	}
}

// TestAttachEnabledStoresAtOnce: the stores share the one deadline side
// by side. A store whose volume's link never comes does not spend the
// time of the store after it, whose raw volume udev handles at once: one
// after the other, that volume was bound after the deadline, refused
// before udev could look at it (errProbed) and detached again.
func TestAttachEnabledStoresAtOnce(t *testing.T) {
	if udev.Host.Running() {
		t.Skip("udev runs on this host: " + string(udev.Host) + " has its control socket")
	}
	identity := filepath.Join(t.TempDir(), "identity")
	m := startMiniUdev(t, identity, true, func(bool, int) bool { return true })
	opts := Options{Udev: m.dir, UdevIdentityDir: identity, UdevTimeout: 2 * time.Second}
	slow, quick := newStore(t, opts), newStore(t, opts)
	fs := mustCreate(t, slow, CreateRequest{Name: "fs", SizeBytes: 16 << 20})
	raw := mustCreate(t, quick, CreateRequest{Name: "raw", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
	for _, s := range []*Store{slow, quick} {
		t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	}
	list := []EnabledVolume{{fs.UUID, slow.Root()}, {raw.UUID, quick.Root()}}
	sts, err := AttachEnabled(context.Background(), &fakeLifecycle{list: list}, opts)
	if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errProbed) {
		t.Errorf("AttachEnabled = %v; want the filesystem volume's wait to reach the deadline, and no raw volume refused", err)
	}
	if !slices.ContainsFunc(sts, func(st *Status) bool { return st.UUID == raw.UUID && st.Device != "" }) {
		t.Errorf("AttachEnabled returned %d statuses, none of %s with its device", len(sts), raw.Name)
	}
	if st, err := quick.Status(raw.UUID); err != nil || st.Device == "" {
		t.Errorf("%s after the boot: %+v, %v; want it attached", raw.Name, st, err)
	}
}
