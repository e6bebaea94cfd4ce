package volume

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
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

// corruptRecord rewrites one field of the metadata file at path, as an
// attacker who can write the store's metadata would; with no field, value
// is a map[string]any of the fields to rewrite.
func corruptRecord(t *testing.T, path, field string, value any) {
	t.Helper()
	testutil.EditJSON(t, path, func(rec map[string]any) {
		if field == "" {
			maps.Copy(rec, value.(map[string]any))
		} else {
			rec[field] = value
		}
	})
}

// fieldCorruption is a record with one field no store writes (no field:
// value maps the fields of a combination no store writes), and the reason
// the record is refused with.
type fieldCorruption struct {
	name   string
	field  string
	value  any
	reason string
}

// fieldCorruptions are corruptions of fields volume and snapshot records
// share.
var fieldCorruptions = []fieldCorruption{
	{"size 0", "sizeBytes", 0, "size 0 is not"},
	{"size 3", "sizeBytes", 3, "size 3 is not"},
	{"odd mode", "mode", "weird", `mode "weird"`},
	{"unknown filesystem", "fsType", "btrfs", `filesystem "btrfs"`},
	{"odd block size", "blockSize", 123, "block size 123"},
	{"name with a slash", "name", "a/b", "contains '/'"},
	{"state broken", "state", "broken", `state "broken"`},
	{"state expanding", "state", "expanding", `state "expanding"`},
	{"unknown state", "state", "weird", `state "weird"`},
	{"no state", "state", "", `state ""`},
	{"escape in a label", "labels", map[string]string{"k": "a\x1b[2Jb"}, `label "k": value "a\x1b[2Jb" contains`},
	{"empty label key", "labels", map[string]string{"": "v"}, "a label key is empty"},
	{"label key too long", "labels", map[string]string{strings.Repeat("k", MaxLabelKeyLength+1): "v"}, "label key"},
	{"label value too long", "labels", map[string]string{"k": strings.Repeat("v", MaxLabelValueLength+1)}, `label "k": value is`},
	{"too many labels", "labels", manyLabels(MaxLabels + 1), "labels, at most"},
	{"negative format", "format", -1, "format -1 is negative"},
	{"format not a number", "format", "2", "cannot unmarshal"},
}

// snapshotFieldCorruptions are corruptions of fields only snapshot records
// have.
var snapshotFieldCorruptions = []fieldCorruption{
	{"source not a uuid", "sourceUUID", "../x", `source uuid "../x"`},
	{"source in upper case", "sourceUUID", "0B7E4BD6-1C2B-4A57-9D6A-0E5D7F4E2F10", "source uuid"},
	{"no source", "sourceUUID", "", `source uuid ""`},
	{"source name with a slash", "sourceName", "a/b", `source: name "a/b" contains '/'`},
	{"source name with an escape", "sourceName", "v\x1b[2J", "source: name"},
	{"source name like a uuid", "sourceName", "0b7e4bd6-1c2b-4a57-9d6a-0e5d7f4e2f10", "source: name"},
	{"no source name", "sourceName", "", "source: name is empty"},
	{"group with a slash", "group", "a/b", `group: name "a/b" contains '/'`},
	{"group with an escape", "group", "g\x1b[2J", "group: name"},
	{"consistency with an escape", "consistency", "\x1b[2J\nFAKE ready", `consistency "\x1b[2J\nFAKE ready"`},
	{"consistency unknown", "consistency", "perfect", `consistency "perfect"`},
	{"copy method unknown", "method", "teleport", `copy method "teleport"`},
}

// volumeFieldCorruptions are corruptions of fields only volume records
// have.
var volumeFieldCorruptions = []fieldCorruption{
	{"from snapshot not a uuid", "fromSnapshot", "../x", `source snapshot uuid "../x"`},
	{"from snapshot in upper case", "fromSnapshot", "0B7E4BD6-1C2B-4A57-9D6A-0E5D7F4E2F10", "source snapshot uuid"},
	{"cloned from not a uuid", "clonedFrom", "v\x1b[2J", "source volume uuid"},
	{"cloned from in upper case", "clonedFrom", "0B7E4BD6-1C2B-4A57-9D6A-0E5D7F4E2F10", "source volume uuid"},
	{"two sources", "", map[string]any{
		"fromSnapshot": "0b7e4bd6-1c2b-4a57-9d6a-0e5d7f4e2f10",
		"clonedFrom":   "1c8f5ce7-2d3c-4b68-8e7b-1f6e8a5f3a21",
	}, "one source at most"},
	{"mkfs options on a block volume", "mkfsOptions", []string{"-m 0"}, "mkfs options cannot be given for block volumes"},
	{"IOPS beyond the kernel's", "ioLimits", map[string]any{"writeIOPS": uint64(1) << 40}, "wiops 1099511627776 is beyond"},
	{"IOPS of none", "ioLimits", map[string]any{"readIOPS": uint64(1<<32 - 1)}, "riops 4294967295 is beyond"},
	{"byte rate beyond int64", "ioLimits", map[string]any{"readBytesPerSecond": uint64(1) << 63}, "rbps 9223372036854775808 is beyond"},
}

// TestSnapshotRecordFieldsChecked: a snapshot record with a field no store
// writes is listed as broken, with the reason; a restore from it is
// refused as ErrBroken and changes nothing (no volume, no loop device:
// newStore's cleanup checks), and DeleteSnapshot removes it.
func TestSnapshotRecordFieldsChecked(t *testing.T) {
	for _, tt := range slices.Concat(fieldCorruptions, snapshotFieldCorruptions) {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			src := rawVolume(t, s, "src")
			sn, err := s.CreateSnapshot(ctx, src.Name, "s", SnapshotOptions{})
			if err != nil {
				t.Fatal(err)
			}
			path := s.snapMetaPath(sn.UUID)
			corruptRecord(t, path, tt.field, tt.value)

			before := listing(t, s.Root())
			if v, err := s.Create(ctx, CreateRequest{Name: "r0", FromSnapshot: sn.UUID}); !errors.Is(err, ErrBroken) {
				t.Errorf("restore from the snapshot = %+v, %v; want ErrBroken", v, err)
			}
			if after := listing(t, s.Root()); after != before {
				t.Errorf("the refused restore changed the store:\nbefore %s\nafter  %s", before, after)
			}
			if vols, err := s.List(); err != nil || len(vols) != 1 || vols[0].UUID != src.UUID {
				t.Errorf("List = %v, %v; want the source only", vols, err)
			}
			sns, err := s.ListSnapshots(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(sns) != 1 || sns[0].UUID != sn.UUID || sns[0].State != StateBroken ||
				!strings.Contains(sns[0].Problem, path) || !strings.Contains(sns[0].Problem, tt.reason) {
				t.Errorf("ListSnapshots = %+v; want the snapshot broken, naming %s and %q", sns, path, tt.reason)
			}
			if err := s.DeleteSnapshot(ctx, sn.UUID); err != nil {
				t.Fatalf("DeleteSnapshot(broken): %v", err)
			}
			for _, p := range []string{path, s.snapPath(sn.UUID)} {
				if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s still there after delete (%v)", p, err)
				}
			}
		})
	}
}

// TestVolumeRecordFieldsChecked: a volume record with a field no store
// writes is listed as broken, with the reason, refused by attach and as
// the source of a clone (changing nothing), and removed by Delete with
// its backing file, leaving no loop device.
func TestVolumeRecordFieldsChecked(t *testing.T) {
	for _, tt := range slices.Concat(fieldCorruptions, volumeFieldCorruptions) {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			v := rawVolume(t, s, "v")
			if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
				t.Fatal(err)
			}
			path := s.metaPath(v.UUID)
			corruptRecord(t, path, tt.field, tt.value)

			vols, err := s.List()
			if err != nil {
				t.Fatal(err)
			}
			if len(vols) != 1 || vols[0].UUID != v.UUID || vols[0].State != StateBroken ||
				!strings.Contains(vols[0].Problem, path) || !strings.Contains(vols[0].Problem, tt.reason) {
				t.Errorf("List = %+v; want the volume broken, naming %s and %q", vols, path, tt.reason)
			}
			if _, err := s.Attach(ctx, v.UUID); !errors.Is(err, ErrBroken) {
				t.Errorf("Attach of the broken volume: %v; want ErrBroken", err)
			}
			before := listing(t, s.Root())
			if c, err := s.Create(ctx, CreateRequest{Name: "c0", CloneOf: v.UUID}); !errors.Is(err, ErrBroken) {
				t.Errorf("clone of the broken volume = %+v, %v; want ErrBroken", c, err)
			}
			if after := listing(t, s.Root()); after != before {
				t.Errorf("the refused clone changed the store:\nbefore %s\nafter  %s", before, after)
			}
			if err := s.Delete(ctx, v.UUID, DetachOptions{}); err != nil {
				t.Fatalf("Delete(broken): %v", err)
			}
			for _, p := range []string{path, v.BackingFile} {
				if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s still there after delete (%v)", p, err)
				}
			}
		})
	}
}

// TestVolumeRecordMkfsOptionsChecked: the mkfs options of a filesystem
// volume's record are checked when it is read, as NormalizeMkfsOptions
// checks a request's: options create records pass, and a record with
// options no create writes (an escape that status would print, a host
// path, an option off the list) reads as broken, with the reason.
func TestVolumeRecordMkfsOptionsChecked(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	v, err := s.Create(ctx, CreateRequest{Name: "fs", SizeBytes: 16 * MiB, Mode: ModeFilesystem, FSType: "ext4",
		MkfsOptions: []string{"-m 0", "-L data", "-E lazy_itable_init=1"}})
	if err != nil {
		t.Fatal(err)
	}
	path := s.metaPath(v.UUID)
	recorded, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := s.Get(v.UUID); err != nil || got.State != StateReady || !strings.Contains(string(recorded), `"-L"`) {
		t.Fatalf("the volume create made: %+v, %v; want it ready with its mkfs options recorded:\n%s", got, err, recorded)
	}
	for _, tt := range []struct {
		name   string
		opts   []string
		reason string
	}{
		{"escape", []string{"-E \x1b[2J"}, `"\x1b[2J"`},
		{"host directory", []string{"-d /etc"}, "copies a host directory"},
		{"option off the list", []string{"-V"}, `mkfs option "-V"`},
		{"value missing", []string{"-m 0", "-L"}, "needs a value"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if err := os.WriteFile(path, recorded, 0o600); err != nil {
				t.Fatal(err)
			}
			corruptRecord(t, path, "mkfsOptions", tt.opts)
			got, err := s.Get(v.UUID)
			if !errors.Is(err, ErrBroken) && (err != nil || got.State != StateBroken) {
				t.Fatalf("Get = %+v, %v; want the volume broken", got, err)
			}
			vols, err := s.List()
			if err != nil {
				t.Fatal(err)
			}
			if len(vols) != 1 || vols[0].State != StateBroken || !strings.Contains(vols[0].Problem, tt.reason) {
				t.Errorf("List = %+v; want the volume broken, saying %q", vols, tt.reason)
			}
		})
	}
	if err := os.WriteFile(path, recorded, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, v.UUID, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}
