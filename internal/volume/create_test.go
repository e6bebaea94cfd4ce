package volume

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// TestLabelsCheckedWhereSet: every call that sets labels refuses what
// ValidateLabels refuses with ErrInvalid, changing nothing, and takes
// labels at its bounds into a record that reads back as it was written.
func TestLabelsCheckedWhereSet(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	a := rawVolume(t, s, "a")
	var stream bytes.Buffer
	if _, err := s.Export(ctx, a.Name, &stream, StreamOptions{}); err != nil {
		t.Fatal(err)
	}
	// Each setter sets labels on what it names name and returns the labels
	// that name's record then holds.
	setters := []struct {
		name string
		set  func(name string, labels map[string]string) (map[string]string, error)
	}{
		{"create", func(name string, labels map[string]string) (map[string]string, error) {
			v, err := s.Create(ctx, CreateRequest{Name: name, SizeBytes: MiB, Mode: ModeBlock, NoPartition: true, Labels: labels})
			return volumeLabels(s, v, err)
		}},
		{"clone", func(name string, labels map[string]string) (map[string]string, error) {
			v, err := s.Create(ctx, CreateRequest{Name: name, CloneOf: a.Name, Labels: labels})
			return volumeLabels(s, v, err)
		}},
		{"import", func(name string, labels map[string]string) (map[string]string, error) {
			v, err := s.Import(ctx, bytes.NewReader(stream.Bytes()), ImportRequest{Name: name, Labels: labels})
			return volumeLabels(s, v, err)
		}},
		{"change", func(name string, labels map[string]string) (map[string]string, error) {
			_, err := s.Change(a.Name, Change{Labels: labels})
			return volumeLabels(s, a, err)
		}},
		{"snapshot", func(name string, labels map[string]string) (map[string]string, error) {
			sns, err := s.CreateSnapshot(ctx, a.Name, name, SnapshotOptions{Labels: labels})
			return snapshotLabels(s, []*Snapshot{sns}, err)
		}},
		{"group snapshot", func(name string, labels map[string]string) (map[string]string, error) {
			sns, err := s.CreateSnapshotGroup(ctx, []string{a.Name}, name, SnapshotOptions{Labels: labels})
			return snapshotLabels(s, sns, err)
		}},
	}
	refused := []struct {
		name   string
		labels map[string]string
	}{
		{"escape in a value", map[string]string{"k": "a\x1b[2Jb"}},
		{"newline in a key", map[string]string{"k\n": "v"}},
		{"empty key", map[string]string{"": "v"}},
		{"key too long", map[string]string{strings.Repeat("k", MaxLabelKeyLength+1): "v"}},
		{"value too long", map[string]string{"k": strings.Repeat("v", MaxLabelValueLength+1)}},
		{"too many", manyLabels(MaxLabels + 1)},
	}
	for _, set := range setters {
		for _, tt := range refused {
			t.Run(set.name+"/"+tt.name, func(t *testing.T) {
				before := listing(t, s.Root())
				if got, err := set.set("r", tt.labels); !errors.Is(err, ErrInvalid) {
					t.Errorf("labels %v = %v; want ErrInvalid", got, err)
				}
				if after := listing(t, s.Root()); after != before {
					t.Errorf("the refusal changed the store:\nbefore %s\nafter  %s", before, after)
				}
			})
		}
	}
	for i, set := range setters {
		t.Run(set.name+"/at the bounds", func(t *testing.T) {
			want := boundLabels()
			got, err := set.set(fmt.Sprintf("ok%d", i), want)
			if err != nil {
				t.Fatal(err)
			}
			if !maps.Equal(got, want) {
				t.Errorf("the record holds labels %v; want %v", got, want)
			}
		})
	}
}

// volumeLabels returns the labels of v's record, read anew, or err.
func volumeLabels(s *Store, v *Volume, err error) (map[string]string, error) {
	if err != nil {
		return nil, err
	}
	if v, err = s.readMeta(v.UUID); err != nil {
		return nil, err
	}
	return v.Labels, nil
}

// snapshotLabels returns the labels of the records of sns, read anew,
// which must all hold the same, or err.
func snapshotLabels(s *Store, sns []*Snapshot, err error) (map[string]string, error) {
	if err != nil {
		return nil, err
	}
	var labels map[string]string
	for i, sn := range sns {
		if sn, err = s.readSnapMeta(sn.UUID); err != nil {
			return nil, err
		}
		if i > 0 && !maps.Equal(sn.Labels, labels) {
			return nil, fmt.Errorf("snapshot %s holds labels %v, %s holds %v", sns[0].Name, labels, sn.Name, sn.Labels)
		}
		labels = sn.Labels
	}
	return labels, nil
}

// tmpfsStore opens a store on a tmpfs of size, unmounted at cleanup after
// any loop device left on its files was detached and reported.
func tmpfsStore(t *testing.T, size string, opts Options) *Store {
	t.Helper()
	testutil.RequireRoot(t)
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size="+size+",mode=0700"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	t.Cleanup(func() {
		for _, dev := range boundUnder(dir) {
			exec.Command("losetup", "-d", dev).Run()
			t.Errorf("leaked loop device %s", dev)
		}
	})
	s, err := Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// boundUnder lists the loop devices bound to a file in dir.
func boundUnder(dir string) []string {
	var devs []string
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil && strings.HasPrefix(string(b), dir+"/") {
			devs = append(devs, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return devs
}

// assertNothingLeft fails unless the store holds no volume, no file but
// its lock directory, and no loop device is bound to a file in it.
func assertNothingLeft(t *testing.T, s *Store) {
	t.Helper()
	if vols, err := s.List(); err != nil || len(vols) != 0 {
		t.Errorf("volumes left: %+v, %v", vols, err)
	}
	entries, _ := os.ReadDir(s.Root())
	for _, e := range entries {
		if e.Name() != lockDir {
			t.Errorf("left in the store: %s", e.Name())
		}
	}
	if devs := boundUnder(s.Root()); len(devs) > 0 {
		t.Errorf("loop devices still bound to its files: %v", devs)
	}
}

// TestFailedCreateLeavesNothing: a create that fails at any step before
// the volume is ready (the file cannot grow, mkfs fails, the store fills
// up under mkfs, mkfs makes something that is not the volume's own
// filesystem) leaves no metadata, no backing file and no device, and a
// rerun with other arguments succeeds.
func TestFailedCreateLeavesNothing(t *testing.T) {
	tests := []struct {
		name  string
		store func(t *testing.T) *Store
		req   CreateRequest
		setup func(t *testing.T) (undo func()) // around the create
		want  string                           // in the error
		// deviceOnly: fails on a device only. mkfs zeroes a file by
		// punching holes, which allocate nothing, and a device by
		// writing zeros through it.
		deviceOnly bool
	}{
		{
			name:  "file too large",
			store: func(t *testing.T) *Store { return newStore(t, Options{OvercommitRatio: 1e9}) },
			req:   CreateRequest{SizeBytes: 64 << 20},
			setup: func(t *testing.T) func() {
				var old unix.Rlimit
				if err := unix.Getrlimit(unix.RLIMIT_FSIZE, &old); err != nil {
					t.Fatal(err)
				}
				if err := unix.Setrlimit(unix.RLIMIT_FSIZE, &unix.Rlimit{Cur: 8 * MiB, Max: old.Max}); err != nil {
					t.Fatal(err)
				}
				return func() { unix.Setrlimit(unix.RLIMIT_FSIZE, &old) }
			},
			want: "file too large",
		},
		{
			name:  "mkfs fails",
			store: func(t *testing.T) *Store { return newStore(t, Options{}) },
			req:   CreateRequest{SizeBytes: 16 << 20, MkfsOptions: []string{"-J size=1024"}},
			want:  "mkfs.ext4",
		},
		{
			name:       "store full under mkfs",
			store:      func(t *testing.T) *Store { return tmpfsStore(t, "4m", Options{OvercommitRatio: 1e9}) },
			req:        CreateRequest{SizeBytes: 256 << 20, MkfsOptions: []string{"-E lazy_itable_init=0,lazy_journal_init=0"}},
			want:       "mkfs.ext4",
			deviceOnly: true,
		},
		{
			name:  "mkfs makes another filesystem type",
			store: func(t *testing.T) *Store { return newStore(t, Options{}) },
			req: CreateRequest{SizeBytes: 16 << 20,
				MkfsOptions: []string{"-O ^has_journal,^extent,^flex_bg,^huge_file,^dir_nlink,^extra_isize,^64bit,^metadata_csum"}},
			want: "ext2",
		},
	}
	for _, tt := range tests {
		for _, keep := range []bool{true, false} { // formatted on its device, or on its file
			if tt.deviceOnly && !keep {
				continue
			}
			t.Run(fmt.Sprintf("%s/attached=%t", tt.name, keep), func(t *testing.T) {
				s := tt.store(t)
				req := tt.req
				req.Name = "v"
				req.KeepAttached = keep
				undo := func() {}
				if tt.setup != nil {
					undo = tt.setup(t)
				}
				_, err := s.Create(context.Background(), req)
				undo()
				if err == nil || !strings.Contains(err.Error(), tt.want) {
					t.Fatalf("Create = %v, want an error saying %q", err, tt.want)
				}
				if errors.Is(err, ErrInvalid) {
					t.Fatalf("Create = %v: refused before it started, the case tests nothing", err)
				}
				assertNothingLeft(t, s)
				v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: MiB, Mode: ModeBlock, NoPartition: true})
				if err := s.Delete(context.Background(), v.UUID, DetachOptions{}); err != nil {
					t.Fatal(err)
				}
				assertNothingLeft(t, s)
			})
		}
	}
}

// TestCreateFinishesOnlyTheSameRequest: a create killed after it reserved
// the name is finished by the same request again, labels included; a
// request that differs (another owner's labels, another size) is
// ErrExists and leaves the unfinished volume as it is.
func TestCreateFinishesOnlyTheSameRequest(t *testing.T) {
	crashed := CreateRequest{Name: "v", SizeBytes: 8 << 20, Labels: map[string]string{"owner": "csi"}}
	tests := []struct {
		name     string
		change   func(r *CreateRequest)
		finishes bool
	}{
		{"same", func(*CreateRequest) {}, true},
		{"other labels", func(r *CreateRequest) { r.Labels = map[string]string{"owner": "cli"} }, false},
		{"no labels", func(r *CreateRequest) { r.Labels = nil }, false},
		{"other size", func(r *CreateRequest) { r.SizeBytes = 16 << 20 }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			req := crashed
			if err := req.Normalize(); err != nil {
				t.Fatal(err)
			}
			v, err := s.reserve(req) // what a create killed before the file leaves
			if err != nil {
				t.Fatal(err)
			}
			again := crashed
			tt.change(&again)
			got, err := s.Create(context.Background(), again)
			if !tt.finishes {
				if !errors.Is(err, ErrExists) {
					t.Fatalf("Create = %v, want ErrExists", err)
				}
				if now, err := s.Get(v.UUID); err != nil || now.State != StateCreating {
					t.Fatalf("unfinished volume now %+v, %v; want it still creating", now, err)
				}
				return
			}
			if err != nil || got.UUID != v.UUID || got.State != StateReady {
				t.Fatalf("Create = %+v, %v; want volume %s finished", got, err, v.UUID)
			}
		})
	}
}

// TestCreateChecksTheFilesystem: a created filesystem volume's device
// holds the volume's own filesystem (type and UUID), which create proved.
func TestCreateChecksTheFilesystem(t *testing.T) {
	s := newStore(t, Options{})
	ctx := context.Background()
	v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 16 << 20, KeepAttached: true,
		MkfsOptions: []string{"-O ^has_journal", "-L data"}})
	st, err := s.Status(v.UUID)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CheckFilesystem(ctx, v, st.Device); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, v.UUID, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestFailedCreateLeavesUnsafeFilesAlone: finishing an unfinished create
// whose backing file was replaced by a symlink fails with ErrUnsafe and
// changes nothing: the link, its target and the volume stay for Delete.
func TestFailedCreateLeavesUnsafeFilesAlone(t *testing.T) {
	s := newStore(t, Options{})
	req := CreateRequest{Name: "v", SizeBytes: 8 << 20}
	if err := req.Normalize(); err != nil {
		t.Fatal(err)
	}
	v, err := s.reserve(req) // what a create killed before the file leaves
	if err != nil {
		t.Fatal(err)
	}
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, s.backingPath(v.UUID)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Create(context.Background(), req); !errors.Is(err, ErrUnsafe) {
		t.Fatalf("Create over a symlinked backing file = %v, want ErrUnsafe", err)
	}
	if target, err := os.Readlink(s.backingPath(v.UUID)); err != nil || target != victim {
		t.Errorf("backing file link now %q, %v; want it left pointing at %s", target, err, victim)
	}
	if data, err := os.ReadFile(victim); err != nil || string(data) != "precious" {
		t.Errorf("victim now %q, %v", data, err)
	}
	if got, err := s.Get(v.UUID); err != nil || got.State != StateCreating {
		t.Errorf("volume after the refusal: %+v, %v; want it still creating", got, err)
	}
	// delete refuses too, until the operator removed what is not the
	// volume's.
	if err := s.Delete(context.Background(), v.UUID, DetachOptions{}); !errors.Is(err, ErrUnsafe) {
		t.Fatalf("Delete with a symlinked backing file = %v, want ErrUnsafe", err)
	}
	if err := os.Remove(s.backingPath(v.UUID)); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(context.Background(), v.UUID, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	if data, err := os.ReadFile(victim); err != nil || string(data) != "precious" {
		t.Errorf("victim after delete %q, %v", data, err)
	}
	assertNothingLeft(t, s)
}
