package volume

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// identities lists the files of the udev identity directory: name -> content.
func identities(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	entries, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = string(b)
	}
	return out
}

// Attach leaves udev the identity of a ready, unlabelled filesystem
// volume's binding, named by that binding's disk sequence number, and no
// other: not while create formats, not for raw or labelled volumes, not
// for a device someone else bound to the same file; detach removes it.
func TestUdevIdentity(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "udev")
	s := newStore(t, Options{UdevIdentityDir: dir})
	ext4 := mustCreate(t, s, CreateRequest{Name: "ext4", SizeBytes: 16 << 20})
	mustCreate(t, s, CreateRequest{Name: "labelled", SizeBytes: 16 << 20, MkfsOptions: []string{"-L", "data"}})
	mustCreate(t, s, CreateRequest{Name: "raw", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
	mustCreate(t, s, CreateRequest{Name: "gpt", SizeBytes: 4 << 20, Mode: ModeBlock})
	if got := identities(t, dir); len(got) != 0 {
		t.Fatalf("create left udev identities %v; only attaching a ready volume may", got)
	}
	want := "ID_FS_TYPE=ext4\nID_FS_USAGE=filesystem\nID_FS_UUID=" + ext4.UUID + "\nID_FS_UUID_ENC=" + ext4.UUID + "\n"
	for _, attach := range []struct {
		name string
		do   func() error
	}{
		{"Attach", func() error { _, err := s.Attach(ctx, "ext4"); return err }},
		{"AttachAll", func() error { _, err := s.AttachAll(ctx); return err }},
	} {
		t.Run(attach.name, func(t *testing.T) {
			if err := attach.do(); err != nil {
				t.Fatal(err)
			}
			st, err := s.Status("ext4")
			if err != nil {
				t.Fatal(err)
			}
			dev, err := loop.Get(st.Device)
			if err != nil {
				t.Fatal(err)
			}
			seq := strconv.FormatUint(dev.DiskSeq, 10)
			if got := identities(t, dir); len(got) != 1 || got[seq] != want {
				t.Errorf("udev identities %q, want only %s: %q", got, seq, want)
			}
			// Someone else's binding of the same file has a number of its own.
			file := filepath.Join(s.root, ext4.UUID)
			foreign := testutil.Losetup(t, file, "--read-only")
			fdev, err := loop.Get(foreign)
			testutil.DetachIfServes(foreign, file)
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := identities(t, dir)[strconv.FormatUint(fdev.DiskSeq, 10)]; ok || fdev.DiskSeq == dev.DiskSeq {
				t.Errorf("a foreign binding (%s, diskseq %d) has the volume's identity", foreign, fdev.DiskSeq)
			}
			if err := s.DetachAll(DetachOptions{}); err != nil {
				t.Fatal(err)
			}
			if got := identities(t, dir); len(got) != 0 {
				t.Errorf("detach left udev identities %q", got)
			}
		})
	}
	for _, name := range []string{"ext4", "labelled", "raw", "gpt"} {
		if err := s.Delete(ctx, name, DetachOptions{}); err != nil {
			t.Error(err)
		}
	}
}
