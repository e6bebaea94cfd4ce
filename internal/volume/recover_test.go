package volume

import (
	"bytes"
	"context"
	"errors"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// orphan makes s a volume name of size bytes, attached, writes data at
// offset 0 of its device and removes its backing file: the data lives on
// only on the device, which it returns.
func orphan(t *testing.T, s *Store, name string, size int64, data []byte) string {
	t.Helper()
	mustCreate(t, s, CreateRequest{Name: name, SizeBytes: size, Mode: ModeBlock, NoPartition: true})
	st, err := s.Attach(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := os.OpenFile(st.Device, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = dev.WriteAt(data, 0)
	if serr := dev.Sync(); err == nil {
		err = serr
	}
	dev.Close()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(st.BackingFile); err != nil {
		t.Fatal(err)
	}
	if st, err = s.Status(name); err != nil || st.State != StateOrphaned {
		t.Fatalf("after its file went: %+v, %v; want orphaned", st, err)
	}
	return st.Device
}

// TestRecoverRefusedBeyondFreeSpace: a recover whose copy of the device's
// data the store's filesystem has not the room for is refused with
// ErrNoSpace before anything is written (the store is not filled up,
// which would fail every thin volume's writes meanwhile); the orphan
// keeps its device. With the room made, the same recover copies the data
// back, sparse.
func TestRecoverRefusedBeyondFreeSpace(t *testing.T) {
	ctx := context.Background()
	s := smallStore(t, "ext4", 256<<20, Options{OvercommitRatio: 10})
	data := make([]byte, 64<<20)
	rand.New(rand.NewSource(1)).Read(data)
	dev := orphan(t, s, "v", 128<<20, data)
	fillStore(t, s, 16<<20)
	refusedForSpace(t, s, "recover of 64MiB of data", func() error {
		_, err := s.Recover(ctx, "v", RecoverOptions{})
		return err
	})
	if st, err := s.Status("v"); err != nil || st.State != StateOrphaned || st.Device != dev {
		t.Fatalf("after the refusal: %+v, %v; want orphaned on %s", st, err, dev)
	}

	fillers, _ := filepath.Glob(filepath.Join(filepath.Dir(s.Root()), "filler-*"))
	for _, f := range fillers {
		os.Remove(f)
	}
	st, err := s.Recover(ctx, "v", RecoverOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Delete(ctx, "v", DetachOptions{}) })
	back, err := os.ReadFile(st.BackingFile)
	if err != nil || int64(len(back)) != 128<<20 || !bytes.Equal(back[:len(data)], data) || !allZero(back[len(data):]) {
		t.Fatalf("recovered file: %d bytes, %v; want the data, then zeroes to 128MiB", len(back), err)
	}
	if got := allocated(t, st.BackingFile); got > int64(len(data))+1<<20 {
		t.Errorf("recovered file holds %d bytes, want no more than its %d of data", got, len(data))
	}
}

// TestRecoverAfterKilledRecover: the copy a killed recover left is
// removed before the room for the new one is counted: a rerun, which
// doctor advises, is not refused for the space the old copy held.
func TestRecoverAfterKilledRecover(t *testing.T) {
	ctx := context.Background()
	s := smallStore(t, "ext4", 256<<20, Options{OvercommitRatio: 10})
	data := make([]byte, 64<<20)
	rand.New(rand.NewSource(1)).Read(data)
	orphan(t, s, "v", 128<<20, data)
	v, err := s.Get("v")
	if err != nil {
		t.Fatal(err)
	}
	// What a recover killed midway left: a copy of the data.
	if err := os.WriteFile(filepath.Join(s.Root(), recoverTempName(v.UUID)), data, 0o600); err != nil {
		t.Fatal(err)
	}
	fillStore(t, s, 32<<20)
	st, err := s.Recover(ctx, "v", RecoverOptions{})
	if err != nil {
		t.Fatalf("recover after a killed one, with room once its copy is gone: %v", err)
	}
	t.Cleanup(func() { s.Delete(ctx, "v", DetachOptions{}) })
	if back, err := os.ReadFile(st.BackingFile); err != nil || !bytes.Equal(back[:len(data)], data) {
		t.Fatalf("recovered file: %v; want the data", err)
	}
	if _, err := os.Lstat(filepath.Join(s.Root(), recoverTempName(v.UUID))); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the killed recover's copy: %v, want it gone", err)
	}
}

// TestRecoverRefusesState: only a ready volume is recovered. An
// unfinished one (creating, deleting) is refused with ErrNotReady, and a
// record of a newer sparsevol with ErrNewer, before anything changes:
// the device still holds the data, and no copy is made.
func TestRecoverRefusesState(t *testing.T) {
	tests := []struct {
		name string
		edit func(rec map[string]any)
		want error
	}{
		{"creating", func(rec map[string]any) { rec["state"] = string(StateCreating) }, ErrNotReady},
		{"deleting", func(rec map[string]any) { rec["state"] = string(StateDeleting) }, ErrNotReady},
		{"newer", func(rec map[string]any) { rec["format"] = RecordFormat + 1 }, ErrNewer},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			dev := orphan(t, s, "v", 16<<20, []byte("only on the device"))
			v, err := s.Get("v")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { testutil.DetachIfServes(dev, v.BackingFile) })
			testutil.EditJSON(t, s.metaPath(v.UUID), tt.edit)
			before := storeTree(t, s)
			_, err = s.Recover(context.Background(), v.UUID, RecoverOptions{})
			if !errors.Is(err, tt.want) {
				t.Fatalf("Recover: %v, want %v", err, tt.want)
			}
			if after := storeTree(t, s); !slices.Equal(after, before) {
				t.Errorf("the store changed:\n%q\nwas\n%q", after, before)
			}
			if devs := boundUnder(s.Root()); len(devs) != 1 || devs[0] != dev {
				t.Errorf("devices after the refusal: %v, want the orphan's %s", devs, dev)
			}
		})
	}
}

// TestRecoverRefusesAWrittenDevice: a writer that opens the orphan's
// device for each write is seldom an opener when recover looks, but what
// it writes during the copy would be lost with the device: recover
// refuses with ErrBusy, the device keeps the data and no backing file
// appears. Once the writer stops, recover copies everything.
func TestRecoverRefusesAWrittenDevice(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	data := make([]byte, 64<<20)
	rand.New(rand.NewSource(1)).Read(data)
	dev := orphan(t, s, "v", 64<<20, data)
	t.Cleanup(func() { s.Delete(ctx, "v", DetachOptions{Force: true}) })
	rounds, stop := rawWriter(t, dev)
	before := rounds()
	_, err := s.Recover(ctx, "v", RecoverOptions{})
	after := rounds()
	stop()
	if after <= before {
		t.Fatalf("the writer completed no round during the recover (%d, %d)", before, after)
	}
	if !errors.Is(err, ErrBusy) {
		t.Fatalf("recover while the device is written = %v, want ErrBusy", err)
	}
	if st, err := s.Status("v"); err != nil || st.State != StateOrphaned || st.Device != dev {
		t.Fatalf("after the refusal: %+v, %v; want orphaned on %s", st, err, dev)
	}
	if _, err := s.Recover(ctx, "v", RecoverOptions{}); err != nil {
		t.Fatalf("recover once the writer stopped: %v", err)
	}
}
