package volume

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// victim is a file outside any store that an attack aims at.
type victim struct {
	path string
	sum  string
	id   loop.FileID
}

func newVictim(t *testing.T) *victim {
	t.Helper()
	path := filepath.Join(t.TempDir(), "victim")
	data := []byte(strings.Repeat("precious host data\n", 1<<16))
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return &victim{path: path, sum: sha256sum(t, path), id: loop.FileID{Dev: st.Dev, Inode: st.Ino}}
}

func sha256sum(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// intact fails the test unless the victim is unchanged and no loop
// device is bound to it.
func (vi *victim) intact(t *testing.T) {
	t.Helper()
	if got := sha256sum(t, vi.path); got != vi.sum {
		t.Errorf("victim %s changed", vi.path)
	}
	bound, err := loop.Bound(vi.id)
	if err != nil {
		t.Fatal(err)
	}
	if devs := bound[vi.id]; len(devs) > 0 {
		for _, d := range devs {
			loop.Detach(d.Path, loop.Owner{ID: d.Backing, Tag: d.Tag, ReadOnly: d.ReadOnly()})
		}
		t.Errorf("victim %s was bound to %s", vi.path, devs[0].Path)
	}
}

// TestBackingFileRules: a backing file replaced by a symlink, given a
// second link, or bound by someone else is never followed, bound, linked,
// detached or formatted; metadata never names the file.
func TestBackingFileRules(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// tamper attacks the volume's file and returns a check that the
		// attack hurt nothing.
		tamper     func(t *testing.T, s *Store, v *Volume, vi *victim) func(t *testing.T)
		attachErr  error // nil: attach works
		deleteErr  error
		wantDelete bool // delete removes the volume
	}{
		{"symlink to a host file", func(t *testing.T, s *Store, v *Volume, vi *victim) func(t *testing.T) {
			os.Remove(v.BackingFile)
			if err := os.Symlink(vi.path, v.BackingFile); err != nil {
				t.Fatal(err)
			}
			return func(t *testing.T) {}
		}, ErrUnsafe, ErrUnsafe, false},
		{"second link", func(t *testing.T, s *Store, v *Volume, vi *victim) func(t *testing.T) {
			other := filepath.Join(t.TempDir(), "other")
			if err := os.Link(v.BackingFile, other); err != nil {
				t.Fatal(err)
			}
			return func(t *testing.T) {
				if _, err := os.Stat(v.BackingFile); err != nil {
					t.Errorf("hard-linked file gone: %v", err)
				}
			}
		}, ErrUnsafe, ErrUnsafe, false},
		{"metadata names a host file", func(t *testing.T, s *Store, v *Volume, vi *victim) func(t *testing.T) {
			v.BackingFile = vi.path
			if err := s.writeMeta(v); err != nil {
				t.Fatal(err)
			}
			return func(t *testing.T) {}
		}, nil, nil, true},
	}
	windows := map[string][]string{
		"foreign window at an offset":   {"-o", "1048576"},
		"foreign read-write at 32M":     {"-o", "33554432"},
		"foreign size-limited window":   {"--sizelimit", "8388608"},
		"foreign read-only":             {"-r"},
		"foreign untagged whole device": nil,
	}
	for name, args := range windows {
		tests = append(tests, struct {
			name       string
			tamper     func(t *testing.T, s *Store, v *Volume, vi *victim) func(t *testing.T)
			attachErr  error
			deleteErr  error
			wantDelete bool
		}{name, func(t *testing.T, s *Store, v *Volume, vi *victim) func(t *testing.T) {
			dev := testutil.Losetup(t, v.BackingFile, args...)
			before, err := loop.Get(dev)
			if err != nil {
				t.Fatal(err)
			}
			return func(t *testing.T) {
				after, err := loop.Get(dev)
				if err != nil || *after != *before {
					t.Errorf("foreign %s changed: %+v %v, was %+v", dev, after, err, before)
				}
				if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
					t.Errorf("detach with a foreign device = %v, want nil (left alone)", err)
				}
				if after, err := loop.Get(dev); err != nil || *after != *before {
					t.Errorf("detach touched the foreign %s: %+v %v", dev, after, err)
				}
				if st, err := s.Status(v.UUID); err != nil || len(st.ForeignDevices) != 1 || st.Attached || st.Problem == "" {
					t.Errorf("status = %+v, %v; want the foreign device named, not attached", st, err)
				}
			}
		}, ErrUnsafe, ErrUnsafe, false})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 64 << 20})
			vi := newVictim(t)
			check := tt.tamper(t, s, v, vi)
			st, err := s.Attach(ctx, v.UUID)
			if !errors.Is(err, tt.attachErr) || (tt.attachErr == nil) != (err == nil) {
				t.Fatalf("Attach = %v, want %v", err, tt.attachErr)
			}
			if err == nil {
				if st.BackingFile != filepath.Join(s.Root(), v.UUID) {
					t.Errorf("attached %s, want the store's own file", st.BackingFile)
				}
				if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
					t.Fatal(err)
				}
			} else if _, err := os.Lstat(linkPath(v.UUID)); err == nil {
				t.Errorf("refused attach published %s", linkPath(v.UUID))
			}
			check(t)
			vi.intact(t)
			err = s.Delete(ctx, v.UUID, DetachOptions{})
			if !errors.Is(err, tt.deleteErr) || (tt.deleteErr == nil) != (err == nil) {
				t.Fatalf("Delete = %v, want %v", err, tt.deleteErr)
			}
			_, gone := s.Get(v.UUID)
			if errors.Is(gone, ErrNotFound) != tt.wantDelete {
				t.Errorf("after delete: Get = %v, want deleted %v", gone, tt.wantDelete)
			}
			vi.intact(t)
			check(t)
			if !tt.wantDelete {
				for _, d := range devicesUnder(s.Root()) {
					testutil.DetachIfServes(d, v.BackingFile)
				}
				os.Remove(v.BackingFile)
				s.Delete(ctx, v.UUID, DetachOptions{Force: true})
			}
		})
	}
}

func devicesUnder(dir string) []string {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil && strings.HasPrefix(string(b), dir+"/") {
			out = append(out, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return out
}

// TestAdoptRefuses: files an operator points adopt at are checked as
// hostile: another store's live volume, a symlink, a second link, a file
// a loop device serves. Each is refused with ErrInvalid, nothing moves.
func TestAdoptRefuses(t *testing.T) {
	ctx := context.Background()
	formatted := func(t *testing.T, dir string) string {
		t.Helper()
		path := filepath.Join(dir, NewUUID())
		if err := os.WriteFile(path, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		os.Truncate(path, 16<<20)
		run(t, "mkfs.ext4", "-q", "-U", filepath.Base(path), path)
		return path
	}
	tests := []struct {
		name string
		make func(t *testing.T) string
	}{
		{"another store's volume", func(t *testing.T) string {
			a := newStore(t, Options{})
			v := mustCreate(t, a, CreateRequest{Name: "a", SizeBytes: 16 << 20, KeepAttached: true})
			t.Cleanup(func() { a.Detach(v.UUID, DetachOptions{}) })
			return v.BackingFile
		}},
		{"another store's detached volume", func(t *testing.T) string {
			a := newStore(t, Options{})
			return mustCreate(t, a, CreateRequest{Name: "a", SizeBytes: 16 << 20}).BackingFile
		}},
		{"symlink", func(t *testing.T) string {
			dir := t.TempDir()
			target := formatted(t, dir)
			link := filepath.Join(dir, "link")
			os.Symlink(target, link)
			return link
		}},
		{"second link", func(t *testing.T) string {
			dir := t.TempDir()
			path := formatted(t, dir)
			os.Link(path, filepath.Join(dir, "other"))
			return path
		}},
		{"bound by losetup", func(t *testing.T) string {
			path := formatted(t, t.TempDir())
			testutil.Losetup(t, path)
			return path
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := newStore(t, Options{})
			path := tt.make(t)
			sum := sha256sum(t, path)
			before := listing(t, b.Root())
			if _, err := b.Adopt(ctx, []string{path}, ""); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Adopt(%s) = %v, want ErrInvalid", path, err)
			}
			if after := listing(t, b.Root()); after != before {
				t.Errorf("refused adopt changed the store:\n%s", after)
			}
			if sha256sum(t, path) != sum {
				t.Errorf("%s changed", path)
			}
		})
	}
}

// TestUUIDNodeWide: /dev/sparsevol/<uuid> serves one device per node, so
// a UUID another store links is refused, and that store's link is neither
// replaced nor removed.
func TestUUIDNodeWide(t *testing.T) {
	ctx := context.Background()
	a, b := newStore(t, Options{}), newStore(t, Options{})
	u := NewUUID()
	// b's volume exists before a's is attached (a create in b is refused
	// once a's is).
	vb := mustCreate(t, b, CreateRequest{Name: "b", UUID: u, SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true})
	va := mustCreate(t, a, CreateRequest{Name: "a", UUID: u, SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true, KeepAttached: true})
	t.Cleanup(func() { a.Delete(ctx, va.UUID, DetachOptions{}); b.Delete(ctx, vb.UUID, DetachOptions{}) })
	target, err := os.Readlink(linkPath(u))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Create(ctx, CreateRequest{Name: "c", UUID: u, SizeBytes: 16 << 20}); !errors.Is(err, ErrExists) {
		t.Errorf("create with a UUID another store links = %v, want ErrExists", err)
	}
	if _, err := b.Attach(ctx, vb.UUID); !errors.Is(err, ErrUnsafe) {
		t.Errorf("attach of the other store's namesake = %v, want ErrUnsafe", err)
	}
	if devs := devicesUnder(b.Root()); len(devs) > 0 {
		t.Errorf("refused attach left %v bound", devs)
	}
	if err := b.Detach(vb.UUID, DetachOptions{}); err != nil {
		t.Errorf("detach = %v", err)
	}
	if err := b.Delete(ctx, vb.UUID, DetachOptions{}); err != nil {
		t.Errorf("delete = %v", err)
	}
	if got, err := os.Readlink(linkPath(u)); err != nil || got != target {
		t.Errorf("the other store's link is now %q, %v; was %s", got, err, target)
	}
}

// TestAdoptRenamesThroughParentFD: adopt names the file it checked as a
// name in its directory's fd, never by its path again. Between the checks
// and the rename, the hostile owner of the directory swaps it for a link
// to a victim directory holding a file of the same name, or replaces the
// file itself. The victim is never moved (its inode, content and ctime stay
// as they were); the directory swap redirects nothing, so the inode that
// was checked is what arrives in the store; a replaced file is put back
// where it was and refused, and the store does not change.
func TestAdoptRenamesThroughParentFD(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// race runs in place of the attacker; d is the file's directory,
		// victimDir holds the victim file passwd.
		race    func(t *testing.T, d, victimDir string)
		adopted bool // else refused with ErrInvalid or ErrUnsafe
	}{
		{"directory swapped for a link", func(t *testing.T, d, victimDir string) {
			if err := os.Rename(d, d+".moved"); err != nil {
				t.Error(err)
			}
			if err := os.Symlink(victimDir, d); err != nil {
				t.Error(err)
			}
		}, true},
		{"file replaced", func(t *testing.T, d, victimDir string) {
			if err := os.Rename(filepath.Join(d, "passwd"), filepath.Join(d, "checked")); err != nil {
				t.Error(err)
			}
			other := filepath.Join(d, "passwd")
			if err := os.WriteFile(other, []byte("replacement"), 0o600); err != nil {
				t.Error(err)
			}
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			home := t.TempDir()
			d := filepath.Join(home, "d")
			if err := os.Mkdir(d, 0o755); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(d, "passwd")
			uuid := NewUUID()
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			os.Truncate(path, 16<<20)
			run(t, "mkfs.ext4", "-q", "-U", uuid, path)
			var checked unix.Stat_t
			if err := unix.Stat(path, &checked); err != nil {
				t.Fatal(err)
			}
			victimDir := t.TempDir()
			victimFile := filepath.Join(victimDir, "passwd")
			if err := os.WriteFile(victimFile, []byte("root:x:0:0::/root:/bin/sh\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			var victimBefore unix.Stat_t
			if err := unix.Stat(victimFile, &victimBefore); err != nil {
				t.Fatal(err)
			}
			before := listing(t, s.Root())

			ran := false
			adoptRace = func(string) { ran = true; tt.race(t, d, victimDir) }
			t.Cleanup(func() { adoptRace = nil })
			vols, err := s.Adopt(ctx, []string{path}, "")
			adoptRace = nil
			if !ran {
				t.Fatal("adopt renamed nothing: the race was never run")
			}

			var victimAfter unix.Stat_t
			if err := unix.Stat(victimFile, &victimAfter); err != nil {
				t.Fatalf("victim %s is gone: %v", victimFile, err)
			}
			if victimAfter.Ino != victimBefore.Ino || victimAfter.Ctim != victimBefore.Ctim {
				t.Errorf("victim %s was moved (inode %d -> %d, ctime %v -> %v)", victimFile,
					victimBefore.Ino, victimAfter.Ino, victimBefore.Ctim, victimAfter.Ctim)
			}
			if b, _ := os.ReadFile(victimFile); string(b) != "root:x:0:0::/root:/bin/sh\n" {
				t.Errorf("victim %s changed: %q", victimFile, b)
			}
			if !tt.adopted {
				if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrUnsafe) {
					t.Fatalf("Adopt = %v, %v, want ErrInvalid or ErrUnsafe", vols, err)
				}
				if after := listing(t, s.Root()); after != before {
					t.Errorf("refused adopt changed the store:\n%s", after)
				}
				if b, err := os.ReadFile(path); err != nil || string(b) != "replacement" {
					t.Errorf("the replacement was not put back at %s: %q, %v", path, b, err)
				}
				return
			}
			if err != nil || len(vols) != 1 || vols[0].UUID != uuid {
				t.Fatalf("Adopt = %v, %v, want the checked file adopted as %s", vols, err, uuid)
			}
			var got unix.Stat_t
			if err := unix.Lstat(filepath.Join(s.Root(), uuid), &got); err != nil || got.Ino != checked.Ino || got.Dev != checked.Dev {
				t.Errorf("%s/%s is inode %d (%v), want the checked %d", s.Root(), uuid, got.Ino, err, checked.Ino)
			}
		})
	}
}

// TestAdoptRefusesUUIDOfNode: adopt keeps the UUID it finds, so it follows
// import --keep-uuid's rule (uuidFree): a UUID that a filesystem or a
// partition of the node has (its /dev/disk link, here in a directory of
// the test's own) or a snapshot of the store has is refused with
// ErrExists, and neither the file nor the store changes. Adopted, such a
// volume's stable path would name the node's disk.
func TestAdoptRefusesUUIDOfNode(t *testing.T) {
	ctx := context.Background()
	image := func(t *testing.T, gpt bool, uuid string) string {
		t.Helper()
		path := filepath.Join(t.TempDir(), "image")
		if err := os.WriteFile(path, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		os.Truncate(path, 16<<20)
		if gpt {
			run(t, "sgdisk", "--largest-new=1", "--partition-guid=1:"+uuid, path)
		} else {
			run(t, "mkfs.ext4", "-q", "-U", uuid, path)
		}
		return path
	}
	diskLink := func(t *testing.T, kind, uuid string) {
		t.Helper()
		dir := filepath.Join(diskDir, kind)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("../../sda1", filepath.Join(dir, uuid)); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name string
		// take makes the UUID the node's; it returns the file to adopt.
		take func(t *testing.T, s *Store) string
	}{
		{"filesystem of the node", func(t *testing.T, s *Store) string {
			u := NewUUID()
			diskLink(t, "by-uuid", u)
			return image(t, false, u)
		}},
		{"partition of the node", func(t *testing.T, s *Store) string {
			u := NewUUID()
			diskLink(t, "by-partuuid", u)
			return image(t, true, u)
		}},
		{"snapshot of the store", func(t *testing.T, s *Store) string {
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 16 << 20})
			sn, err := s.CreateSnapshot(ctx, v.Name, "sn", SnapshotOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return image(t, false, sn.UUID)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			old := diskDir
			diskDir = t.TempDir()
			t.Cleanup(func() { diskDir = old })
			s := newStore(t, Options{})
			path := tt.take(t, s)
			sum := sha256sum(t, path)
			before := listing(t, s.Root())
			if vols, err := s.Adopt(ctx, []string{path}, ""); !errors.Is(err, ErrExists) {
				t.Fatalf("Adopt(%s) = %v, %v, want ErrExists", path, vols, err)
			}
			if after := listing(t, s.Root()); after != before {
				t.Errorf("refused adopt changed the store:\n%s", after)
			}
			if sha256sum(t, path) != sum {
				t.Errorf("%s moved or changed", path)
			}
		})
	}
}
