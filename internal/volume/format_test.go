package volume

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// makeNewer rewrites the record at path as a newer sparsevol might
// write it: a format beyond RecordFormat, a state and a field shape this
// binary does not know.
func makeNewer(t *testing.T, path string) {
	t.Helper()
	corruptRecord(t, path, "", map[string]any{"format": RecordFormat + 1, "state": "migrating", "ioLimits": "per-tenant"})
}

// TestNewerVolumeRecordRefused: a volume record of a newer format is
// listed in state newer under its name, refused by every operation with
// ErrNewer, changing nothing (the store's files and records byte for
// byte, no loop device: newStore's cleanup checks), and never deleted;
// the store's other volumes still work.
func TestNewerVolumeRecordRefused(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	good := rawVolume(t, s, "good")
	v := rawVolume(t, s, "v")
	if err := s.DetachAll(DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	path := s.metaPath(v.UUID)
	makeNewer(t, path)
	before := listing(t, s.Root())

	for _, ref := range []string{v.UUID, "v"} {
		st, err := s.Status(ref)
		if err != nil || st.State != StateNewer || st.Name != "v" || st.Format != RecordFormat+1 ||
			!strings.Contains(st.Problem, path) || !strings.Contains(st.Problem, "upgrade sparsevol") {
			t.Errorf("Status(%s) = %+v, %v; want state newer, named v, naming %s and the upgrade", ref, st, err, path)
		}
	}
	vols, err := s.List()
	if err != nil || len(vols) != 2 || vols[1].UUID != v.UUID || vols[1].State != StateNewer {
		t.Errorf("List = %+v, %v; want good and v in state newer", vols, err)
	}
	for _, op := range []struct {
		name string
		fn   func() error
	}{
		{"attach", func() error { _, err := s.Attach(ctx, "v"); return err }},
		{"attach --all", func() error { _, err := s.AttachMany(ctx, []string{v.UUID}); return err }},
		{"detach", func() error { return s.Detach("v", DetachOptions{}) }},
		{"delete", func() error { return s.Delete(ctx, "v", DetachOptions{}) }},
		{"delete by uuid", func() error { return s.Delete(ctx, v.UUID, DetachOptions{Force: true}) }},
		{"delete as broken", func() error { return s.deleteBroken(v.UUID) }},
		{"expand", func() error { _, err := s.Expand(ctx, "v", 2*MiB, ExpandOptions{}); return err }},
		{"snapshot", func() error { _, err := s.CreateSnapshot(ctx, "v", "s", SnapshotOptions{}); return err }},
		{"change", func() error { _, err := s.Change("v", Change{Labels: map[string]string{"k": "v"}}); return err }},
		{"clone", func() error { _, err := s.Create(ctx, CreateRequest{Name: "c", CloneOf: "v"}); return err }},
		{"adopt its file", func() error { _, err := s.Adopt(ctx, []string{v.BackingFile}, ""); return err }},
	} {
		if err := op.fn(); !errors.Is(err, ErrNewer) || errors.Is(err, ErrBroken) || !strings.Contains(err.Error(), path) {
			t.Errorf("%s of the newer volume: %v; want ErrNewer naming %s", op.name, err, path)
		}
		if after := listing(t, s.Root()); after != before {
			t.Fatalf("the refused %s changed the store:\nbefore %s\nafter  %s", op.name, before, after)
		}
	}
	if _, err := s.Create(ctx, CreateRequest{Name: "v", SizeBytes: MiB, Mode: ModeBlock, NoPartition: true}); !errors.Is(err, ErrExists) {
		t.Errorf("create of its name: %v; want ErrExists", err)
	}
	sts, err := s.AttachAll(ctx)
	if !errors.Is(err, ErrNewer) || len(sts) != 1 || sts[0].UUID != good.UUID || !sts[0].Attached {
		t.Errorf("AttachAll = %+v, %v; want good attached and ErrNewer", sts, err)
	}
	if err := s.DetachAll(DetachOptions{}); !errors.Is(err, ErrNewer) {
		t.Errorf("DetachAll: %v; want ErrNewer for v", err)
	}
	if after := listing(t, s.Root()); after != before {
		t.Errorf("the store changed:\nbefore %s\nafter  %s", before, after)
	}
}

// TestNewerSnapshotRecordRefused: a snapshot record of a newer format is
// listed in state newer under its name, and neither deleted nor restored
// (ErrNewer), changing nothing.
func TestNewerSnapshotRecordRefused(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	src := rawVolume(t, s, "src")
	sn, err := s.CreateSnapshot(ctx, src.Name, "s", SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	path := s.snapMetaPath(sn.UUID)
	makeNewer(t, path)
	before := listing(t, s.Root())

	sns, err := s.ListSnapshots(ctx)
	if err != nil || len(sns) != 1 || sns[0].State != StateNewer || sns[0].Name != "s" ||
		!strings.Contains(sns[0].Problem, path) || !strings.Contains(sns[0].Problem, "upgrade sparsevol") {
		t.Errorf("ListSnapshots = %+v, %v; want s in state newer, naming %s and the upgrade", sns, err, path)
	}
	for _, op := range []struct {
		name string
		fn   func() error
	}{
		{"delete", func() error { return s.DeleteSnapshot(ctx, "s") }},
		{"restore", func() error { _, err := s.Create(ctx, CreateRequest{Name: "r", FromSnapshot: "s"}); return err }},
		{"snapshot of its name", func() error { _, err := s.CreateSnapshot(ctx, "src", "s", SnapshotOptions{}); return err }},
	} {
		if err := op.fn(); err == nil || errors.Is(err, ErrBroken) {
			t.Errorf("%s of the newer snapshot: %v; want a refusal, not ErrBroken", op.name, err)
		}
		if after := listing(t, s.Root()); after != before {
			t.Fatalf("the refused %s changed the store:\nbefore %s\nafter  %s", op.name, before, after)
		}
	}
	if err := s.DeleteSnapshot(ctx, sn.UUID); !errors.Is(err, ErrNewer) {
		t.Errorf("DeleteSnapshot: %v; want ErrNewer", err)
	}
}

// TestRecordFormat: records are written with RecordFormat; a record
// without one (format 0, every store before formats) reads as it did.
func TestRecordFormat(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	v := rawVolume(t, s, "v")
	sn, err := s.CreateSnapshot(ctx, "v", "s", SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{s.metaPath(v.UUID), s.snapMetaPath(sn.UUID)} {
		testutil.EditJSON(t, path, func(rec map[string]any) {
			if rec["format"] != float64(RecordFormat) {
				t.Errorf("%s carries format %v; want %d", path, rec["format"], RecordFormat)
			}
			delete(rec, "format")
		})
	}
	if st, err := s.Status("v"); err != nil || st.State != StateReady || st.Format != 0 {
		t.Errorf("Status of a format-0 record = %+v, %v; want ready, format 0", st, err)
	}
	if sns, err := s.ListSnapshots(ctx); err != nil || len(sns) != 1 || sns[0].State != StateReady {
		t.Errorf("ListSnapshots of a format-0 record = %+v, %v; want s ready", sns, err)
	}
	if err := s.Detach("v", DetachOptions{}); err != nil {
		t.Errorf("Detach of a format-0 volume: %v", err)
	}
	if _, err := s.Attach(ctx, "v"); err != nil {
		t.Errorf("Attach of a format-0 volume: %v", err)
	}
	if _, err := s.Create(ctx, CreateRequest{Name: "r", FromSnapshot: "s"}); err != nil {
		t.Errorf("restore from a format-0 snapshot: %v", err)
	}
}
