package volume

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// rawVolume creates a whole-device raw volume of 1 MiB (no mkfs: fast).
func rawVolume(t *testing.T, s *Store, name string) *Volume {
	t.Helper()
	return mustCreate(t, s, CreateRequest{Name: name, SizeBytes: MiB, Mode: ModeBlock, NoPartition: true})
}

// TestBrokenMetadataSpoilsNothingElse: one unreadable <uuid>.json is listed
// as a broken volume naming the file; every other volume of the store can
// still be listed, shown, created, attached and deleted; attaching all
// attaches the others and names the broken one.
func TestBrokenMetadataSpoilsNothingElse(t *testing.T) {
	tests := []struct {
		name    string
		content string
		reason  string // in Volume.Error
	}{
		{"truncated", `{"name": "bad", "uu`, "unexpected end of JSON input"},
		{"empty", ``, "unexpected end of JSON input"},
		{"garbage", "\x00\x01garbage", "invalid character"},
		{"null", `null`, `names volume ""`},
		{"another volume's", `{"name": "x", "uuid": "0b7e4bd6-1c2b-4a57-9d6a-0e5d7f4e2f10"}`, `names volume "0b7e4bd6-1c2b-4a57-9d6a-0e5d7f4e2f10"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			good := rawVolume(t, s, "good")
			bad := rawVolume(t, s, "bad")
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			if err := os.WriteFile(s.metaPath(bad.UUID), []byte(tt.content), 0o600); err != nil {
				t.Fatal(err)
			}

			vols, err := s.List()
			if err != nil {
				t.Fatalf("List: %v", err)
			}
			var broken *Volume
			for _, v := range vols {
				if v.UUID == bad.UUID {
					broken = v
				}
			}
			if len(vols) != 2 || broken == nil {
				t.Fatalf("List = %d volumes, broken one present %v; want good and the broken one", len(vols), broken != nil)
			}
			if broken.State != StateBroken || broken.Name != bad.UUID || broken.SizeBytes != MiB ||
				!strings.Contains(broken.Problem, s.metaPath(bad.UUID)) || !strings.Contains(broken.Problem, tt.reason) {
				t.Errorf("broken volume listed as %+v; want state broken, named by its UUID, 1 MiB, error naming %s and %q",
					broken, s.metaPath(bad.UUID), tt.reason)
			}
			if st, err := s.Status(bad.UUID); err != nil || st.State != StateBroken {
				t.Errorf("Status(broken) = %+v, %v; want state broken", st, err)
			}
			if st, err := s.Status("good"); err != nil || st.State != StateReady {
				t.Errorf("Status(good) = %+v, %v", st, err)
			}
			other := rawVolume(t, s, "other")

			for _, op := range []struct {
				name string
				fn   func() error
			}{
				{"attach", func() error { _, err := s.Attach(ctx, bad.UUID); return err }},
				{"detach", func() error { return s.Detach(bad.UUID, DetachOptions{}) }},
				{"expand", func() error { _, err := s.Expand(ctx, bad.UUID, 2*MiB, ExpandOptions{}); return err }},
			} {
				if err := op.fn(); !errors.Is(err, ErrBroken) || !errors.Is(err, ErrNotReady) || !strings.Contains(err.Error(), s.metaPath(bad.UUID)) {
					t.Errorf("%s of the broken volume: %v; want ErrBroken (an ErrNotReady) naming its file", op.name, err)
				}
			}
			sts, err := s.AttachAll(ctx)
			if !errors.Is(err, ErrBroken) || !strings.Contains(err.Error(), s.metaPath(bad.UUID)) {
				t.Errorf("AttachAll error %v; want ErrBroken naming %s", err, s.metaPath(bad.UUID))
			}
			if len(sts) != 2 || sts[0].Name != "good" || sts[1].Name != "other" || !sts[0].Attached || !sts[1].Attached {
				t.Errorf("AttachAll attached %+v; want good and other", sts)
			}
			if err := s.Delete(ctx, "good", DetachOptions{}); err != nil {
				t.Errorf("Delete(good): %v", err)
			}
			if err := s.Delete(ctx, other.UUID, DetachOptions{}); err != nil {
				t.Errorf("Delete(other): %v", err)
			}
			if err := s.Delete(ctx, bad.UUID, DetachOptions{}); err != nil {
				t.Fatalf("Delete(broken): %v", err)
			}
			for _, p := range []string{s.metaPath(bad.UUID), bad.BackingFile, good.BackingFile} {
				if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s still there after delete (%v)", p, err)
				}
			}
			if vols, err := s.List(); err != nil || len(vols) != 0 {
				t.Errorf("List after deleting all = %v, %v", vols, err)
			}
		})
	}
}

// TestDeleteBroken: deleting a broken volume removes its metadata, and its
// backing file only where that is provably the volume's own; a loop device
// on the file refuses the delete, changing nothing.
func TestDeleteBroken(t *testing.T) {
	tests := []struct {
		name     string
		prepare  func(t *testing.T, v *Volume) // after the metadata broke
		wantErr  error
		keepFile bool // the backing file stays
		keepMeta bool
	}{
		{"plain", func(*testing.T, *Volume) {}, nil, false, false},
		{"file already gone", func(t *testing.T, v *Volume) {
			if err := os.Remove(v.BackingFile); err != nil {
				t.Fatal(err)
			}
		}, nil, false, false},
		{"hard-linked file", func(t *testing.T, v *Volume) {
			other := filepath.Join(t.TempDir(), "link")
			if err := os.Link(v.BackingFile, other); err != nil {
				t.Fatal(err)
			}
		}, nil, true, false},
		{"symlink", func(t *testing.T, v *Volume) {
			victim := filepath.Join(t.TempDir(), "victim")
			if err := os.WriteFile(victim, []byte("victim"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(v.BackingFile); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(victim, v.BackingFile); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if b, err := os.ReadFile(victim); err != nil || string(b) != "victim" {
					t.Errorf("symlink target changed: %q, %v", b, err)
				}
			})
		}, nil, true, false},
		{"loop device on the file", func(t *testing.T, v *Volume) {
			testutil.Losetup(t, v.BackingFile)
		}, ErrBusy, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			v := rawVolume(t, s, "bad")
			if err := os.WriteFile(s.metaPath(v.UUID), []byte("{"), 0o600); err != nil {
				t.Fatal(err)
			}
			tt.prepare(t, v)
			before := listing(t, s.Root())
			err := s.Delete(ctx, v.UUID, DetachOptions{})
			if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
				t.Fatalf("Delete = %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				if after := listing(t, s.Root()); after != before {
					t.Errorf("refused delete changed the store:\n%s\nwas\n%s", after, before)
				}
			}
			if _, err := os.Lstat(v.BackingFile); (err == nil) != tt.keepFile {
				t.Errorf("backing file present %v, want %v", err == nil, tt.keepFile)
			}
			if _, err := os.Lstat(s.metaPath(v.UUID)); (err == nil) != tt.keepMeta {
				t.Errorf("metadata present %v, want %v", err == nil, tt.keepMeta)
			}
			if tt.keepFile && !tt.keepMeta {
				os.Remove(v.BackingFile) // the leak check would not see it, but keep the store clean
			}
		})
	}
}
