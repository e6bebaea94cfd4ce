package volume

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// TestPerVolumeCallsScanNothing: a call about one volume costs the same
// whatever the size of the store and the number of bound devices: it
// reads no store directory and lists no bound loop devices (a change,
// in-use check or delete of a detached volume included). The store
// holds other volumes, some attached, and an unrelated broken metadata
// file a listing would have to read.
func TestPerVolumeCallsScanNothing(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	var others []string
	for _, name := range []string{"a", "b", "c"} {
		others = append(others, mustCreate(t, s, CreateRequest{Name: name, SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true}).UUID)
	}
	if _, err := s.AttachMany(ctx, others[:2]); err != nil {
		t.Fatal(err)
	}
	v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
	gone := mustCreate(t, s, CreateRequest{Name: "gone", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
	poison := s.metaPath(NewUUID())
	t.Cleanup(func() {
		os.Remove(poison)
		if err := s.DetachAll(DetachOptions{}); err != nil {
			t.Error(err)
		}
		for _, u := range append(others, v.UUID) {
			os.Remove(linkPath(u))
		}
	})
	if err := os.WriteFile(poison, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		call func() error
	}{
		{"open", func() error { _, err := Open(s.Root(), Options{}); return err }},
		{"get by uuid", func() error { _, err := s.Get(v.UUID); return err }},
		{"get by name", func() error { _, err := s.Get(v.Name); return err }},
		{"attach by name", func() error { _, err := s.Attach(ctx, v.Name); return err }},
		{"status, attached", func() error { return wantAttached(s.Status(v.Name)) }},
		{"attach again", func() error { _, err := s.Attach(ctx, v.UUID); return err }},
		{"detach by name", func() error { return s.Detach(v.Name, DetachOptions{}) }},
		{"detach again", func() error { return s.Detach(v.UUID, DetachOptions{}) }},
		{"status, detached", func() error { return wantDetached(s.Status(v.UUID)) }},
		{"attach after a detach", func() error { _, err := s.Attach(ctx, v.UUID); return err }},
		{"detach by uuid", func() error { return s.Detach(v.UUID, DetachOptions{}) }},
		{"in use, detached", func() error { return s.InUse(v.Name) }},
		{"change, detached", func() error {
			_, err := s.Change(v.Name, Change{Labels: map[string]string{"k": "v"}})
			return err
		}},
		{"delete, detached", func() error { return s.Delete(ctx, gone.Name, DetachOptions{}) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := countScans()
			if err := tt.call(); err != nil {
				t.Fatal(err)
			}
			if after := countScans(); after != before {
				t.Errorf("%d store directory reads, %d lists of bound loop devices; want none",
					after.dir-before.dir, after.loops-before.loops)
			}
		})
	}
	// The counts see a scan: the test above can fail.
	before := countScans()
	if _, err := s.List(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Statuses(); err != nil {
		t.Fatal(err)
	}
	if after := countScans(); after.dir == before.dir || after.loops == before.loops {
		t.Fatalf("List and Statuses were not counted: %+v -> %+v", before, after)
	}
}

func wantAttached(st *Status, err error) error {
	if err == nil && (!st.Attached || st.Device == "") {
		err = fmt.Errorf("status of an attached volume: %+v", st)
	}
	return err
}

func wantDetached(st *Status, err error) error {
	if err == nil && st.Attached {
		err = fmt.Errorf("status of a detached volume: %+v", st)
	}
	return err
}

// TestAttachTriesFreedDevice: attach binds the device the note in the
// volume's lock file names (what its last detach freed) if it is free,
// and whatever the note says instead (another file's device, no loop
// device, garbage), the volume ends on a device proven its own and
// nothing else is touched.
func TestAttachTriesFreedDevice(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// note returns what to write over detach's note ("": keep it)
		// and whether attach must bind the device it names.
		note func(t *testing.T) (string, bool)
	}{
		{"as detach left it", func(*testing.T) (string, bool) { return "", false }},
		{"a free device far up", func(t *testing.T) (string, bool) { return spareDevice(t), true }},
		{"another file's device", func(t *testing.T) (string, bool) {
			other := filepath.Join(t.TempDir(), "other")
			mustDo(t, os.WriteFile(other, make([]byte, 1<<20), 0o600))
			return testutil.Losetup(t, other), false
		}},
		{"no loop device", func(*testing.T) (string, bool) { return "/dev/null", false }},
		{"garbage", func(*testing.T) (string, bool) { return "\x00\xff../../loop1\n", false }},
		{"too long", func(*testing.T) (string, bool) { return "/dev/loop" + strings.Repeat("9", 100), false }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
			t.Cleanup(func() { os.Remove(linkPath(v.UUID)) })
			if _, err := s.Attach(ctx, v.UUID); err != nil {
				t.Fatal(err)
			}
			mustDo(t, s.Detach(v.UUID, DetachOptions{}))
			note, used := tt.note(t)
			var foreign *loop.Device
			if note != "" {
				mustDo(t, os.WriteFile(filepath.Join(s.Root(), lockDir, v.UUID), []byte(note), 0o600))
				foreign, _ = loop.Get(note)
			}
			st, err := s.Attach(ctx, v.UUID)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { mustDo(t, s.Detach(v.UUID, DetachOptions{})) })
			dev, err := loop.Get(st.Device)
			if err != nil {
				t.Fatal(err)
			}
			if err := v.owner(dev.Backing).Check(dev); err != nil || dev.Backing != v.backingID() {
				t.Fatalf("attached %s, not proven the volume's: %v", st.Device, err)
			}
			if used && st.Device != note {
				t.Errorf("attached %s, not %s which the note names and which was free", st.Device, note)
			}
			if foreign != nil {
				if d, err := loop.Get(foreign.Path); err != nil || d.Backing != foreign.Backing || d.Tag != foreign.Tag {
					t.Errorf("%s was %+v, is %+v, %v", foreign.Path, foreign, d, err)
				}
			}
		})
	}
}

// spareDevice adds an unbound loop device far above the existing ones,
// which no search for a free device reaches, and removes it at cleanup.
func spareDevice(t *testing.T) string {
	t.Helper()
	highest := 0
	entries, _ := os.ReadDir("/sys/block")
	for _, e := range entries {
		if n, err := strconv.Atoi(strings.TrimPrefix(e.Name(), "loop")); err == nil && strings.HasPrefix(e.Name(), "loop") {
			highest = max(highest, n)
		}
	}
	n := highest + 1000
	ctl := func(req uint) error {
		fd, err := unix.Open(loop.ControlPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(n)); errno != 0 {
			return errno
		}
		return nil
	}
	mustDo(t, ctl(unix.LOOP_CTL_ADD))
	t.Cleanup(func() { ctl(unix.LOOP_CTL_REMOVE) })
	return "/dev/loop" + strconv.Itoa(n)
}
