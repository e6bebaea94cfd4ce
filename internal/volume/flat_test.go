package volume

import (
	"context"
	"fmt"
	"os"
	"testing"
)

// TestPerVolumeCallsScanNothing: a call about one volume costs the same
// whatever the size of the store and the number of bound devices: it
// reads no store directory and lists no bound loop devices. The store
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
