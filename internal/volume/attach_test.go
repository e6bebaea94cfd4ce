package volume

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"golang.org/x/sys/unix"
)

// TestAttachDetachWhateverTheLink: attach and detach read the device the
// volume's link names first; whatever became of the link since (removed,
// pointed at another device, a foreign device bound next to ours), a
// second attach (AttachDevice, the command line's) keeps the one device,
// detach removes exactly ours, and devices someone else bound are left
// alone.
func TestAttachDetachWhateverTheLink(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// meddle runs between the first and the second attach; it
		// returns a device that must survive the detach, if any.
		meddle func(t *testing.T, v *Volume, dev string) string
	}{
		{"link intact", func(*testing.T, *Volume, string) string { return "" }},
		{"link removed", func(t *testing.T, v *Volume, _ string) string {
			if err := os.Remove(linkPath(v.UUID)); err != nil {
				t.Fatal(err)
			}
			return ""
		}},
		{"link to another file's device", func(t *testing.T, v *Volume, _ string) string {
			other := filepath.Join(t.TempDir(), "other")
			if err := os.WriteFile(other, make([]byte, 1<<20), 0o600); err != nil {
				t.Fatal(err)
			}
			foreign := testutil.Losetup(t, other)
			if err := setLink(v.UUID, foreign); err != nil {
				t.Fatal(err)
			}
			return foreign
		}},
		{"foreign device beside ours", func(t *testing.T, v *Volume, _ string) string {
			return testutil.Losetup(t, v.BackingFile, "-r", "-o", "4096")
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 4 << 20, Mode: ModeBlock, NoPartition: true})
			t.Cleanup(func() { os.Remove(linkPath(v.UUID)) })
			first, err := s.Attach(ctx, v.UUID)
			if err != nil {
				t.Fatal(err)
			}
			keep := tt.meddle(t, v, first.Device)
			_, second, err := s.AttachDevice(ctx, v.UUID)
			if err != nil {
				t.Fatalf("second attach: %v", err)
			}
			if second != first.Device {
				t.Fatalf("second attach gave %s, first %s", second, first.Device)
			}
			if st, _ := s.Status(v.UUID); len(st.ExtraDevices) > 0 {
				t.Fatalf("attached twice: %s and %v", st.Device, st.ExtraDevices)
			}
			if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
				t.Fatalf("detach: %v", err)
			}
			id := v.backingID()
			bound, err := loop.Bound(id)
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range bound[id] {
				if d.Path != keep {
					t.Errorf("%s still bound to the volume's file after detach", d.Path)
				}
			}
			if keep != "" {
				if _, err := loop.Get(keep); err != nil {
					t.Errorf("the device someone else bound, %s, is gone: %v", keep, err)
				}
			}
			if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
				t.Fatalf("second detach: %v", err)
			}
		})
	}
}

// TestCreateRawRecordsIdentity: a whole-device raw volume, made without a
// device, records its backing file's identity as any other, so that
// attach and detach find its device by it.
func TestCreateRawRecordsIdentity(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	v := mustCreate(t, s, CreateRequest{Name: "raw", SizeBytes: 4 << 20, Mode: ModeBlock, NoPartition: true})
	t.Cleanup(func() { os.Remove(linkPath(v.UUID)) })
	var st unix.Stat_t
	if err := unix.Stat(v.BackingFile, &st); err != nil {
		t.Fatal(err)
	}
	read, err := s.readMeta(v.UUID)
	if err != nil {
		t.Fatal(err)
	}
	if want := (loop.FileID{Dev: st.Dev, Inode: st.Ino}); read.backingID() != want || read.State != StateReady {
		t.Fatalf("recorded %+v in state %s, want %+v ready", read.backingID(), read.State, want)
	}
	if st, err := s.Status(v.UUID); err != nil || st.Attached || st.FileSizeBytes != 4<<20 {
		t.Fatalf("after create: %+v, %v; want detached, 4 MiB", st, err)
	}
	att, err := s.Attach(ctx, v.UUID)
	if err != nil || att.DataDeviceBytes != 4<<20 {
		t.Fatalf("attach: %+v, %v", att, err)
	}
	if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestMarkAttachedNoFollow: a link where attach leaves a volume's attached
// marker is refused, never followed: attach reports it, and the file the
// link names is neither made nor changed.
func TestMarkAttachedNoFollow(t *testing.T) {
	ctx := context.Background()
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	absent := filepath.Join(t.TempDir(), "absent")
	for _, target := range []string{victim, absent} {
		t.Run(filepath.Base(target), func(t *testing.T) {
			dir := t.TempDir()
			s := newStore(t, Options{AttachedDir: dir})
			v := rawVolume(t, s, "v")
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			if err := os.Symlink(target, filepath.Join(dir, v.UUID)); err != nil {
				t.Fatal(err)
			}
			marker := filepath.Join(dir, v.UUID)
			if _, _, err := s.AttachDevice(ctx, v.UUID); err == nil || !strings.Contains(err.Error(), marker) {
				t.Errorf("attach = %v, want a refusal naming %s", err, marker)
			}
			if got, err := os.ReadFile(victim); err != nil || string(got) != "kept" {
				t.Errorf("victim now %q, %v", got, err)
			}
			if _, err := os.Lstat(absent); !os.IsNotExist(err) {
				t.Errorf("the link's target was made (%v)", err)
			}
		})
	}
}
