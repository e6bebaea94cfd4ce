package volume

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	osexec "os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// fsStore opens a store on a loop-mounted filesystem of fsType made for
// the test: xfs with reflink (snapshots share extents), ext4 (they copy).
func fsStore(t *testing.T, fsType string, opts Options) *Store {
	t.Helper()
	dir := testutil.FilesystemDir(t, fsType, 4<<30)
	t.Cleanup(func() {
		for _, dev := range boundUnder(dir) {
			osexec.Command("losetup", "-d", dev).Run()
			t.Errorf("leaked loop device %s", dev)
		}
	})
	s, err := Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// storeKinds are the stores snapshots are proven on, with the copy
// method each must use.
var storeKinds = []struct {
	fs     string
	method CopyMethod
}{
	{"xfs", CopyReflink},
	{"ext4", CopySparse},
}

// TestSnapshotRestoreClone: on a reflink store and a copy store, for
// every kind of volume, a snapshot of the volume (mounted where it has a
// filesystem: frozen) restores to a new volume that holds the data and has
// an identity of its own; a clone does alike; the snapshot outlives its
// volume; deleting it leaves nothing.
func TestSnapshotRestoreClone(t *testing.T) {
	kinds := []struct {
		name string
		req  CreateRequest
	}{
		{"ext4", CreateRequest{SizeBytes: 64 << 20}},
		{"xfs", CreateRequest{SizeBytes: 320 << 20, FSType: "xfs"}},
		{"raw-gpt", CreateRequest{SizeBytes: 16 << 20, Mode: ModeBlock}},
		{"raw-whole", CreateRequest{SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true}},
	}
	for _, sk := range storeKinds {
		t.Run(sk.fs+"-store", func(t *testing.T) {
			s := fsStore(t, sk.fs, Options{})
			ctx := context.Background()
			for _, k := range kinds {
				t.Run(k.name, func(t *testing.T) {
					req := k.req
					req.Name = "src-" + k.name
					req.KeepAttached = true
					v := mustCreate(t, s, req)
					st, err := s.Status(v.Name)
					if err != nil {
						t.Fatal(err)
					}
					payload := make([]byte, 4<<20)
					rand.Read(payload)
					writeData(t, v, st, payload)
					want := ConsistencyQuiet
					var srcTotal int64
					if v.Mode == ModeFilesystem {
						dir := mountTemp(t, st.DataDevice, v.FSType) // kept mounted: frozen
						want = ConsistencyFrozen
						srcTotal = fsTotal(t, dir)
					}
					sn, err := s.CreateSnapshot(ctx, v.Name, "snap-"+k.name, SnapshotOptions{})
					if err != nil {
						t.Fatal(err)
					}
					if sn.State != StateReady || !sn.ReadyToUse || sn.Method != sk.method || sn.Consistency != want || sn.SizeBytes != v.SizeBytes {
						t.Fatalf("snapshot %+v: want ready, %s, %s, %d bytes", sn, sk.method, want, v.SizeBytes)
					}
					again, err := s.CreateSnapshot(ctx, v.UUID, sn.Name, SnapshotOptions{})
					if err != nil || again.UUID != sn.UUID {
						t.Fatalf("second CreateSnapshot = %+v, %v; want the same snapshot", again, err)
					}
					for _, ref := range []string{sn.Name, sn.UUID} {
						if got, err := s.GetSnapshot(ctx, ref); err != nil || got.UUID != sn.UUID {
							t.Fatalf("GetSnapshot(%s) = %+v, %v", ref, got, err)
						}
					}

					restored := mustCreate(t, s, CreateRequest{Name: "restored-" + k.name, FromSnapshot: sn.Name, KeepAttached: true})
					clone := mustCreate(t, s, CreateRequest{Name: "clone-" + k.name, CloneOf: v.Name, SizeBytes: v.SizeBytes + 64<<20, KeepAttached: true})
					for _, c := range []*Volume{restored, clone} {
						if c.UUID == v.UUID || c.Mode != v.Mode || c.FSType != v.FSType || c.Partitioned != v.Partitioned {
							t.Fatalf("copy %+v does not match source %+v", c, v)
						}
						cst, err := s.Status(c.Name)
						if err != nil {
							t.Fatal(err)
						}
						assertIdentity(t, c, cst)
						if got := readData(t, c, cst, len(payload)); !bytes.Equal(got, payload) {
							t.Fatalf("%s does not hold the source's data", c.Name)
						}
					}
					if cst, _ := s.Status(clone.Name); !clone.Partitioned && cst.DataDeviceBytes != clone.SizeBytes {
						t.Fatalf("clone's data device is %d bytes, want %d", cst.DataDeviceBytes, clone.SizeBytes)
					}
					if clone.Mode == ModeFilesystem {
						cst, _ := s.Status(clone.Name)
						dir := mountTemp(t, cst.DataDevice, clone.FSType)
						if total := fsTotal(t, dir); total < srcTotal+60<<20 {
							t.Fatalf("clone's filesystem is %d bytes, not grown by 64MiB beyond the source's %d", total, srcTotal)
						}
						unix.Unmount(dir, 0)
					}
					// Independent files: the source goes, the snapshot stays.
					for _, name := range []string{v.Name, restored.Name, clone.Name} {
						unmountAll(t, s, name)
						if err := s.Delete(ctx, name, DetachOptions{}); err != nil {
							t.Fatal(err)
						}
					}
					again2 := mustCreate(t, s, CreateRequest{Name: "late-" + k.name, FromSnapshot: sn.UUID})
					if err := s.Delete(ctx, again2.Name, DetachOptions{}); err != nil {
						t.Fatal(err)
					}
					if err := s.DeleteSnapshot(ctx, sn.Name); err != nil {
						t.Fatal(err)
					}
					if err := s.DeleteSnapshot(ctx, sn.Name); !errors.Is(err, ErrNotFound) {
						t.Fatalf("second DeleteSnapshot = %v, want ErrNotFound", err)
					}
					if entries, _ := os.ReadDir(filepath.Join(s.Root(), snapDir)); len(entries) != 0 {
						t.Fatalf("left in %s: %v", snapDir, entries)
					}
					if vols, err := s.List(); err != nil || len(vols) != 0 {
						t.Fatalf("volumes left: %+v, %v", vols, err)
					}
					if devs := boundUnder(s.Root()); len(devs) > 0 {
						t.Fatalf("loop devices left: %v", devs)
					}
				})
			}
		})
	}
}

// fsTotal is the size statfs gives the filesystem mounted at dir.
func fsTotal(t *testing.T, dir string) int64 {
	t.Helper()
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	return int64(sfs.Blocks) * sfs.Bsize
}

// assertIdentity proves, by blkid, that the copy c carries its own UUID
// (filesystem) or partition GUID, and no other volume's.
func assertIdentity(t *testing.T, c *Volume, st *Status) {
	t.Helper()
	switch {
	case c.Mode == ModeFilesystem:
		got := strings.TrimSpace(run(t, "blkid", "-p", "-s", "UUID", "-o", "value", st.DataDevice))
		if got != c.UUID {
			t.Fatalf("%s: filesystem UUID %q, want %s", c.Name, got, c.UUID)
		}
	case c.Partitioned:
		got := strings.ToLower(run(t, "sfdisk", "--json", c.BackingFile))
		if !strings.Contains(got, c.UUID) {
			t.Fatalf("%s: partition GUID %s not in the table: %s", c.Name, c.UUID, got)
		}
	}
}

// unmountAll unmounts whatever the test mounted of the volume.
func unmountAll(t *testing.T, s *Store, ref string) {
	t.Helper()
	st, err := s.Status(ref)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range st.MountPoints {
		if err := unix.Unmount(m, 0); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSnapshotRefuses: bad names, a missing or unready source and a name
// taken by another volume's snapshot are refused, changing nothing.
func TestSnapshotRefuses(t *testing.T) {
	s := newStore(t, Options{})
	ctx := context.Background()
	a := mustCreate(t, s, CreateRequest{Name: "a", SizeBytes: 4 << 20, Mode: ModeBlock, NoPartition: true})
	b := rawVolume(t, s, "b")
	if _, err := s.CreateSnapshot(ctx, a.Name, "s", SnapshotOptions{}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		call      func() error
		wantClass error
	}{
		{"bad name", func() error { _, err := s.CreateSnapshot(ctx, a.Name, "../x", SnapshotOptions{}); return err }, ErrInvalid},
		{"missing volume", func() error { _, err := s.CreateSnapshot(ctx, "nope", "t", SnapshotOptions{}); return err }, ErrNotFound},
		{"name of another volume's", func() error { _, err := s.CreateSnapshot(ctx, b.Name, "s", SnapshotOptions{}); return err }, ErrExists},
		{"missing snapshot", func() error { return s.DeleteSnapshot(ctx, "nope") }, ErrNotFound},
		{"restore of a missing snapshot", func() error {
			_, err := s.Create(ctx, CreateRequest{Name: "r", FromSnapshot: "nope"})
			return err
		}, ErrNotFound},
		{"restore smaller", func() error {
			_, err := s.Create(ctx, CreateRequest{Name: "r", FromSnapshot: "s", SizeBytes: 1 << 20})
			return err
		}, ErrInvalid},
		{"restore with another filesystem", func() error {
			_, err := s.Create(ctx, CreateRequest{Name: "r", FromSnapshot: "s", FSType: "xfs"})
			return err
		}, ErrInvalid},
		{"both sources", func() error {
			_, err := s.Create(ctx, CreateRequest{Name: "r", FromSnapshot: "s", CloneOf: "a"})
			return err
		}, ErrInvalid},
		{"mkfs options", func() error {
			_, err := s.Create(ctx, CreateRequest{Name: "r", CloneOf: "a", MkfsOptions: []string{"-j"}})
			return err
		}, ErrInvalid},
	}
	before := listing(t, s.Root())
	for _, tt := range tests {
		if err := tt.call(); !errors.Is(err, tt.wantClass) {
			t.Errorf("%s: %v, want %v", tt.name, err, tt.wantClass)
		}
	}
	if after := listing(t, s.Root()); after != before {
		t.Errorf("refusals changed the store:\nbefore %s\nafter  %s", before, after)
	}
}

// TestSnapshotUnderWriter: a snapshot of a mounted filesystem taken while
// a writer creates and fsyncs files restores to a filesystem that fscks
// clean and holds every file whose fsync returned before the snapshot
// began, with its content.
func TestSnapshotUnderWriter(t *testing.T) {
	for _, sk := range storeKinds {
		for _, fsType := range []string{"ext4", "xfs"} {
			t.Run(sk.fs+"-store/"+fsType, func(t *testing.T) {
				s := fsStore(t, sk.fs, Options{})
				ctx := context.Background()
				v := mustCreate(t, s, CreateRequest{Name: "w", SizeBytes: 320 << 20, FSType: fsType, KeepAttached: true})
				st, err := s.Status(v.Name)
				if err != nil {
					t.Fatal(err)
				}
				dir := mountTemp(t, st.DataDevice, fsType)
				var synced atomic.Int64 // files 0..synced-1 are fsynced
				stop := make(chan struct{})
				done := make(chan error, 1)
				go func() {
					for i := int64(0); ; i++ {
						select {
						case <-stop:
							done <- nil
							return
						default:
						}
						if err := writeSynced(filepath.Join(dir, fmt.Sprintf("f%06d", i)), fileContent(i)); err != nil {
							done <- err
							return
						}
						synced.Store(i + 1)
					}
				}()
				for synced.Load() < 50 {
					time.Sleep(10 * time.Millisecond)
				}
				before := synced.Load()
				sn, err := s.CreateSnapshot(ctx, v.Name, "under-writer", SnapshotOptions{})
				close(stop)
				if werr := <-done; werr != nil {
					t.Fatalf("writer: %v", werr)
				}
				if err != nil {
					t.Fatal(err)
				}
				if sn.Consistency != ConsistencyFrozen {
					t.Fatalf("consistency %s, want frozen", sn.Consistency)
				}
				r := mustCreate(t, s, CreateRequest{Name: "r", FromSnapshot: sn.Name, KeepAttached: true})
				rst, err := s.Status(r.Name)
				if err != nil {
					t.Fatal(err)
				}
				if fsType == "ext4" {
					run(t, "e2fsck", "-f", "-n", rst.DataDevice)
				} else {
					run(t, "xfs_repair", "-n", rst.DataDevice)
				}
				rdir := mountTemp(t, rst.DataDevice, fsType)
				for i := int64(0); i < before; i++ {
					got, err := os.ReadFile(filepath.Join(rdir, fmt.Sprintf("f%06d", i)))
					if err != nil || !bytes.Equal(got, fileContent(i)) {
						t.Fatalf("file %d of %d fsynced before the snapshot: %v (%d bytes)", i, before, err, len(got))
					}
				}
				unix.Unmount(rdir, 0)
				unix.Unmount(dir, 0)
				for _, name := range []string{r.Name, v.Name} {
					if err := s.Delete(ctx, name, DetachOptions{}); err != nil {
						t.Fatal(err)
					}
				}
				if err := s.DeleteSnapshot(ctx, sn.UUID); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

func fileContent(i int64) []byte {
	return bytes.Repeat([]byte(fmt.Sprintf("file %d\n", i)), 1000)
}

// writeSynced writes path and fsyncs it and its directory.
func writeSynced(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// TestSnapshotGroup: a group snapshot freezes every mounted member, copies
// all, thaws all; members are named <group>-<volume> and carry the group;
// a rerun returns the same snapshots.
func TestSnapshotGroup(t *testing.T) {
	s := fsStore(t, "xfs", Options{})
	ctx := context.Background()
	var refs []string
	for _, name := range []string{"a", "b"} {
		v := mustCreate(t, s, CreateRequest{Name: name, SizeBytes: 64 << 20, KeepAttached: true})
		st, err := s.Status(name)
		if err != nil {
			t.Fatal(err)
		}
		mountTemp(t, st.DataDevice, v.FSType)
		refs = append(refs, name)
	}
	sns, err := s.CreateSnapshotGroup(ctx, refs, "grp", SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(sns) != 2 || sns[0].Name != "grp-a" || sns[1].Name != "grp-b" {
		t.Fatalf("group members %+v", sns)
	}
	for _, sn := range sns {
		if sn.Group != "grp" || sn.Consistency != ConsistencyFrozen || !sn.ReadyToUse {
			t.Fatalf("member %+v: want group grp, frozen, ready", sn)
		}
	}
	again, err := s.CreateSnapshotGroup(ctx, refs, "grp", SnapshotOptions{})
	if err != nil || again[0].UUID != sns[0].UUID || again[1].UUID != sns[1].UUID {
		t.Fatalf("rerun = %+v, %v; want the same members", again, err)
	}
	if _, err := s.CreateSnapshotGroup(ctx, []string{"a", "a"}, "twice", SnapshotOptions{}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a group naming a volume twice: %v, want ErrInvalid", err)
	}
	for _, sn := range sns {
		if err := s.DeleteSnapshot(ctx, sn.UUID); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range refs {
		unmountAll(t, s, name)
		if err := s.Delete(ctx, name, DetachOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSnapshotNameKeepsItsGroup: a snapshot name is reused only by a call
// of the same kind. A plain snapshot named as a group's member would be
// taken into the group without having been frozen with the others, and a
// group's member returned to a plain CreateSnapshot could be deleted
// from under its group: both are ErrExists, and the failed group leaves
// no member behind.
func TestSnapshotNameKeepsItsGroup(t *testing.T) {
	s := newStore(t, Options{})
	ctx := context.Background()
	rawVolume(t, s, "a")
	rawVolume(t, s, "b")
	plain, err := s.CreateSnapshot(ctx, "b", "grp-b", SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if sns, err := s.CreateSnapshotGroup(ctx, []string{"a", "b"}, "grp", SnapshotOptions{}); !errors.Is(err, ErrExists) {
		t.Fatalf("a group whose member's name a plain snapshot has = %+v, %v; want ErrExists", sns, err)
	}
	members, err := s.CreateSnapshotGroup(ctx, []string{"a", "b"}, "g2", SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if sn, err := s.CreateSnapshot(ctx, "b", "g2-b", SnapshotOptions{}); !errors.Is(err, ErrExists) {
		t.Fatalf("a plain snapshot named as a group's member = %+v, %v; want ErrExists", sn, err)
	}
	sns, err := s.ListSnapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, sn := range sns {
		got = append(got, sn.Name+"/"+sn.Group)
	}
	slices.Sort(got)
	if want := []string{"g2-a/g2", "g2-b/g2", "grp-b/"}; !slices.Equal(got, want) {
		t.Fatalf("snapshots %q, want %q", got, want)
	}
	for _, sn := range append(members, plain) {
		if err := s.DeleteSnapshot(ctx, sn.UUID); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSnapshotFileRules: a snapshot's file replaced by a symbolic link to
// a host file, or given a second link, is never read, exported or
// removed: restore, export and delete refuse with ErrUnsafe and the host
// file stays as it was.
func TestSnapshotFileRules(t *testing.T) {
	plants := []struct {
		name  string
		plant func(t *testing.T, path, victim string)
	}{
		{"snapshot directory a symlink", func(t *testing.T, path, victim string) {
			dir := filepath.Dir(path)
			if err := os.Rename(dir, dir+"-moved"); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(filepath.Dir(victim), dir); err != nil {
				t.Fatal(err)
			}
		}},
		{"symlink", func(t *testing.T, path, victim string) {
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(victim, path); err != nil {
				t.Fatal(err)
			}
		}},
		{"hardlink", func(t *testing.T, path, _ string) {
			if err := os.Link(path, path+"-second"); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, p := range plants {
		t.Run(p.name, func(t *testing.T) {
			s := newStore(t, Options{})
			ctx := context.Background()
			rawVolume(t, s, "v")
			sn, err := s.CreateSnapshot(ctx, "v", "s", SnapshotOptions{})
			if err != nil {
				t.Fatal(err)
			}
			vi := newVictim(t)
			path := filepath.Join(s.Root(), snapDir, sn.UUID)
			p.plant(t, path, vi.path)
			if _, err := s.Create(ctx, CreateRequest{Name: "r", FromSnapshot: "s"}); !errors.Is(err, ErrUnsafe) {
				t.Errorf("restore: %v, want ErrUnsafe", err)
			}
			if _, err := s.Export(ctx, "s", io.Discard, StreamOptions{}); !errors.Is(err, ErrUnsafe) {
				t.Errorf("export: %v, want ErrUnsafe", err)
			}
			if err := s.DeleteSnapshot(ctx, "s"); !errors.Is(err, ErrUnsafe) {
				t.Errorf("delete: %v, want ErrUnsafe", err)
			}
			if _, err := os.Lstat(path); err != nil && p.name != "snapshot directory a symlink" {
				t.Errorf("the planted file was removed: %v", err)
			}
			vi.intact(t)
			if _, err := s.Get("r"); !errors.Is(err, ErrNotFound) {
				t.Errorf("a refused restore left volume r: %v", err)
			}
		})
	}
}

// TestSnapshotFreezeBounded: a freeze that outlasts the freeze timeout is
// ended (the filesystem thawed) and the snapshot fails with ErrBusy,
// leaving no snapshot behind. The copy (its progress callback) waits
// until the timer has thawed the filesystem, so it always outlasts it.
func TestSnapshotFreezeBounded(t *testing.T) {
	s := newStore(t, Options{FreezeTimeout: 10 * time.Millisecond})
	ctx := context.Background()
	v, dir := mountedVolume(t, s, "v")
	waitThawed := func(int64, int64) { assertThawed(t, dir) }
	if _, err := s.CreateSnapshot(ctx, v.Name, "s", SnapshotOptions{Progress: waitThawed}); !errors.Is(err, ErrBusy) {
		t.Fatalf("snapshot with a freeze beyond its bound: %v, want ErrBusy", err)
	}
	assertThawed(t, dir)
	if sns, err := s.ListSnapshots(ctx); err != nil || len(sns) != 0 {
		t.Fatalf("snapshots left: %+v, %v", sns, err)
	}
	if entries, _ := os.ReadDir(filepath.Join(s.Root(), snapDir)); len(entries) != 0 {
		t.Fatalf("left in %s: %v", snapDir, entries)
	}
	// The late freeze's goroutine holds the mount point open until its
	// FIFREEZE returns and it has thawed: the unmount may wait for that.
	unmountEventually(t, dir)
	if err := s.Delete(ctx, v.Name, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestFreezeLeavesOthersFreeze: a filesystem someone else froze (a
// backup hook, an operator's fsfreeze) makes freeze fail with EBUSY, and
// that freeze is left in place: the guard is dismissed without a thaw,
// not told to thaw what is theirs.
func TestFreezeLeavesOthersFreeze(t *testing.T) {
	dir := testutil.FilesystemDir(t, "ext4", 64<<20)
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	fd := frozenByOthers(t, dir)
	if f, err := freeze([]string{dir}, st.Dev, 5*time.Second, ""); !errors.Is(err, unix.EBUSY) || !errors.Is(err, ErrBusy) ||
		!strings.Contains(err.Error(), "fsfreeze --unfreeze "+dir) {
		if f != nil {
			f.thaw()
		}
		t.Fatalf("freeze of a frozen filesystem = %v, want EBUSY classified ErrBusy, saying how to thaw it", err)
	}
	// The guard has exited (release waits for it): had it thawed, the
	// freeze below would succeed.
	if err := unix.IoctlSetInt(fd, ioctlFIFREEZE, 0); !errors.Is(err, unix.EBUSY) {
		t.Fatalf("the other freeze is gone: FIFREEZE = %v, want EBUSY", err)
	}
	if err := unix.IoctlSetInt(fd, ioctlFITHAW, 0); err != nil {
		t.Fatalf("thaw the other freeze: %v", err)
	}
}

// TestGuardThawsItsOwnFreeze: the guard, left to thaw when we die
// mid-freeze, thaws the filesystem we froze, through the mount point it
// inherited from freeze, even when the mount point's path leads
// elsewhere by then (a directory on the way swapped): a freeze someone
// else holds where the path now leads stays, and the freeze note goes.
func TestGuardThawsItsOwnFreeze(t *testing.T) {
	tests := []struct {
		name string
		// swap puts something at dir, the directory holding our mount
		// point mnt, which was moved away; other holds the mount point
		// mnt of a filesystem someone else froze.
		swap func(dir, other string) error
	}{
		{"link to another frozen filesystem", func(dir, other string) error { return os.Symlink(other, dir) }},
		{"plain directory", func(dir, _ string) error { return os.MkdirAll(filepath.Join(dir, "mnt"), 0o700) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mnt := testutil.FilesystemDir(t, "ext4", 64<<20)
			otherMnt := testutil.FilesystemDir(t, "ext4", 64<<20)
			dir, other := filepath.Dir(mnt), filepath.Dir(otherMnt)
			ofd := frozenByOthers(t, otherMnt)
			var st unix.Stat_t
			if err := unix.Stat(mnt, &st); err != nil {
				t.Fatal(err)
			}
			note := filepath.Join(t.TempDir(), "note")
			if err := os.WriteFile(note, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			f, err := freeze([]string{mnt}, st.Dev, time.Minute, note)
			if err != nil {
				t.Fatal(err)
			}
			f.timer.Stop()

			moved := dir + ".moved"
			if err := os.Rename(dir, moved); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := os.RemoveAll(dir); err != nil {
					t.Error(err)
				}
				if err := os.Rename(moved, dir); err != nil {
					t.Error(err)
				}
			})
			if err := tt.swap(dir, other); err != nil {
				t.Fatal(err)
			}
			// What our death does: the pipe closes without "done".
			// release waits for the guard.
			f.release(false)

			if err := unix.IoctlSetInt(ofd, ioctlFIFREEZE, 0); !errors.Is(err, unix.EBUSY) {
				t.Errorf("the other freeze is gone: FIFREEZE = %v, want EBUSY", err)
			}
			assertThawed(t, filepath.Join(moved, "mnt"))
			if _, err := os.Lstat(note); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the freeze note outlived the guard's thaw: %v", err)
			}
		})
	}
}

// frozenByOthers freezes the filesystem mounted at dir, as someone else
// would, and returns an fd of dir, thawed and closed at cleanup.
func frozenByOthers(t *testing.T, dir string) int {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.IoctlSetInt(fd, ioctlFIFREEZE, 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.IoctlSetInt(fd, ioctlFITHAW, 0) }) // before the close
	return fd
}

// mountedExt4 mounts a new ext4 filesystem for the test and returns its
// mount point and the number of its device.
func mountedExt4(t *testing.T) (string, uint64) {
	t.Helper()
	mnt := testutil.FilesystemDir(t, "ext4", 64<<20)
	var st unix.Stat_t
	if err := unix.Stat(mnt, &st); err != nil {
		t.Fatal(err)
	}
	return mnt, st.Dev
}

// TestOpenMountOf: what freeze and fstrim act on is the mount point the
// mount table gave only while it is the volume's filesystem: a link there
// is not followed, a FIFO not opened, and a directory of another
// filesystem is ErrUnsafe.
func TestOpenMountOf(t *testing.T) {
	mnt, dev := mountedExt4(t)
	other := t.TempDir()
	link := filepath.Join(other, "link")
	fifo := filepath.Join(other, "fifo")
	if err := os.Symlink(mnt, link); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		path string
		ok   bool
	}{{mnt, true}, {link, false}, {fifo, false}, {other, false}} {
		fd, err := openMountOf(tt.path, dev)
		if err == nil {
			unix.Close(fd)
		}
		if tt.ok && err != nil || !tt.ok && !errors.Is(err, ErrUnsafe) {
			t.Errorf("openMountOf(%s) = %v, want ok %t (ErrUnsafe if not)", tt.path, err, tt.ok)
		}
	}
}

// TestOpenMountIn: the first mount point that is still the volume's
// filesystem is used, one covered or swapped since is passed over; with
// none, the first one's refusal.
func TestOpenMountIn(t *testing.T) {
	mnt, dev := mountedExt4(t)
	other := t.TempDir()
	for _, tt := range []struct {
		name   string
		mounts []string
		want   string // "": refused
		err    error
	}{
		{"the first", []string{mnt, other}, mnt, nil},
		{"the second, the first swapped", []string{other, mnt}, mnt, nil},
		{"none is the volume's", []string{other}, "", ErrUnsafe},
		{"no mount point", nil, "", ErrNotMounted},
	} {
		t.Run(tt.name, func(t *testing.T) {
			fd, at, err := openMountIn(tt.mounts, dev)
			if err == nil {
				unix.Close(fd)
			}
			if at != tt.want || tt.err != nil && !errors.Is(err, tt.err) || tt.err == nil && err != nil {
				t.Fatalf("openMountIn(%q) = %q, %v; want %q, %v", tt.mounts, at, err, tt.want, tt.err)
			}
		})
	}
}

// TestThawLeftovers: a freeze whose holder died with its guard (the
// plugin as its PID namespace's first process) is thawed by
// ThawLeftovers, which the plugin runs at start, through the note the
// snapshot left; a note whose freeze is gone is only removed; a snapshot
// that ends leaves no note.
func TestThawLeftovers(t *testing.T) {
	s := newStore(t, Options{})
	ctx := context.Background()
	v, dir := mountedVolume(t, s, "v")
	note := s.freezeNotePath(v.UUID)
	if _, err := s.CreateSnapshot(ctx, v.Name, "s", SnapshotOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(note); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a finished snapshot left its freeze note: %v", err)
	}
	for _, frozen := range []bool{true, false} {
		fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if frozen {
			if err := unix.IoctlSetInt(fd, ioctlFIFREEZE, 0); err != nil {
				t.Fatal(err)
			}
		}
		unix.Close(fd)
		if err := s.noteFreeze(v.UUID); err != nil {
			t.Fatal(err)
		}
		// A locked volume is a live snapshot's: its freeze is left.
		thawLeftoversLocked(t, s, v.UUID, note)
		if frozen {
			fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
			if err != nil {
				t.Fatal(err)
			}
			err = unix.IoctlSetInt(fd, ioctlFIFREEZE, 0)
			unix.Close(fd)
			if !errors.Is(err, unix.EBUSY) {
				t.Fatalf("ThawLeftovers thawed a freeze whose holder holds the lock: FIFREEZE = %v", err)
			}
		}
		if err := s.ThawLeftovers(); err != nil {
			t.Fatalf("frozen %t: ThawLeftovers: %v", frozen, err)
		}
		assertThawed(t, dir)
		if _, err := os.Lstat(note); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("frozen %t: the note is still there: %v", frozen, err)
		}
	}
	sns, err := s.ListSnapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, sn := range sns {
		if err := s.DeleteSnapshot(ctx, sn.UUID); err != nil {
			t.Fatal(err)
		}
	}
	unmountAll(t, s, v.Name)
	if err := s.Delete(ctx, v.Name, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestThawLeftoversUnmounted: a filesystem unmounted while frozen (the
// plugin killed mid-snapshot, kubelet unmounting before it restarts)
// stays frozen and holds its device; ThawLeftovers thaws it through a
// private mount of the device, after which a write on it returns, the
// note and the temporary mount are gone and the volume detaches. A note
// beside a held lock stays; one whose volume is unmounted but not frozen,
// or not attached, is only removed.
func TestThawLeftoversUnmounted(t *testing.T) {
	tests := []struct {
		name     string
		req      CreateRequest
		attached bool
		freeze   bool
	}{
		{"ext4 frozen", CreateRequest{SizeBytes: 64 << 20}, true, true},
		{"xfs frozen", CreateRequest{SizeBytes: 320 << 20, FSType: "xfs"}, true, true},
		{"ext4 not frozen", CreateRequest{SizeBytes: 64 << 20}, true, false},
		{"ext4 detached", CreateRequest{SizeBytes: 64 << 20}, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			req := tt.req
			req.Name, req.KeepAttached = "v", tt.attached
			v := mustCreate(t, s, req)
			note := s.freezeNotePath(v.UUID)
			if err := s.noteFreeze(v.UUID); err != nil {
				t.Fatal(err)
			}
			st, err := s.Status(v.Name)
			if err != nil {
				t.Fatal(err)
			}
			if tt.attached {
				dir := mountTemp(t, st.DataDevice, v.FSType)
				thawAtCleanup(t, s, v)
				if tt.freeze { // what a killed snapshot left
					fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
					if err != nil {
						t.Fatal(err)
					}
					err = unix.IoctlSetInt(fd, ioctlFIFREEZE, 0)
					unix.Close(fd)
					if err != nil {
						t.Fatal(err)
					}
				}
				if err := unix.Unmount(dir, 0); err != nil {
					t.Fatalf("unmount while frozen: %v", err)
				}
			}

			// A locked volume is a live snapshot's: its note is left.
			thawLeftoversLocked(t, s, v.UUID, note)

			if err := s.ThawLeftovers(); err != nil {
				t.Fatalf("ThawLeftovers: %v", err)
			}
			if _, err := os.Lstat(note); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the note is still there: %v", err)
			}
			if _, err := os.Lstat(s.tempMountDir(v)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the temporary mount point is still there: %v", err)
			}
			if tt.attached {
				assertWritable(t, st.DataDevice, v.FSType)
			}
			if err := s.Detach(v.Name, DetachOptions{}); err != nil {
				t.Fatalf("detach after ThawLeftovers: %v", err)
			}
			if st, err := s.Status(v.Name); err != nil || st.Attached {
				t.Fatalf("after detach: attached %t, %v", st != nil && st.Attached, err)
			}
		})
	}
}

// thawAtCleanup thaws, at cleanup, v's filesystem if a failing test left
// it frozen and unmounted (its device attached, claimed, mounted
// nowhere): through a mount of the device, which gets the frozen
// filesystem. Otherwise the device would stay bound to the test's store.
func thawAtCleanup(t *testing.T, s *Store, v *Volume) {
	t.Helper()
	t.Cleanup(func() {
		st, err := s.Status(v.Name)
		if err != nil || !st.Attached || len(st.MountPoints) > 0 || loop.Busy(st.DataDevice) == nil {
			return
		}
		dir, err := os.MkdirTemp("", "thaw")
		if err != nil {
			t.Error(err)
			return
		}
		defer os.Remove(dir)
		if err := unix.Mount(st.DataDevice, dir, v.FSType, 0, ""); err != nil {
			t.Errorf("mount %s to thaw it: %v", st.DataDevice, err)
			return
		}
		if fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0); err == nil {
			unix.IoctlSetInt(fd, ioctlFITHAW, 0)
			unix.Close(fd)
		}
		if err := unix.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
}

// assertWritable fails the test unless a file can be written on the
// filesystem on device within ten seconds: a write on a frozen one waits
// until a thaw, which the test then does itself, so that it fails
// rather than hangs.
func assertWritable(t *testing.T, device, fstype string) {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount(device, dir, fstype, 0, ""); err != nil {
		t.Fatalf("mount %s: %v", device, err)
	}
	done := make(chan error, 1)
	go func() { done <- os.WriteFile(filepath.Join(dir, "written"), []byte("x"), 0o600) }()
	select {
	case err := <-done:
		unmountEventually(t, dir)
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		if fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0); err == nil {
			unix.IoctlSetInt(fd, ioctlFITHAW, 0)
			unix.Close(fd)
		}
		<-done
		unmountEventually(t, dir)
		t.Fatalf("a write on %s did not return: its filesystem is still frozen", device)
	}
}

// mountedVolume creates a 64 MiB filesystem volume, attached, and mounts
// it on a temporary directory, which it returns.
func mountedVolume(t *testing.T, s *Store, name string) (*Volume, string) {
	t.Helper()
	v := mustCreate(t, s, CreateRequest{Name: name, SizeBytes: 64 << 20, KeepAttached: true})
	st, err := s.Status(v.Name)
	if err != nil {
		t.Fatal(err)
	}
	return v, mountTemp(t, st.DataDevice, v.FSType)
}

// unmountEventually unmounts dir, retrying while it is busy (for up to
// five seconds), and fails the test if it stays mounted.
func unmountEventually(t *testing.T, dir string) {
	t.Helper()
	var err error
	for range 100 {
		if err = unix.Unmount(dir, 0); !errors.Is(err, unix.EBUSY) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("unmount %s: %v", dir, err)
	}
}

// assertThawed fails unless the filesystem at dir is (or, once a late
// thaw ran, becomes) thawed: a second freeze succeeds where a frozen one
// is refused with EBUSY.
func assertThawed(t *testing.T, dir string) {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	for range 100 {
		err := unix.IoctlSetInt(fd, ioctlFIFREEZE, 0)
		if err == nil {
			unix.IoctlSetInt(fd, ioctlFITHAW, 0)
			return
		}
		if !errors.Is(err, unix.EBUSY) {
			t.Fatalf("FIFREEZE: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	unix.IoctlSetInt(fd, ioctlFITHAW, 0)
	t.Fatalf("%s stayed frozen", dir)
}

// thawLeftoversLocked runs ThawLeftovers while the test holds uuid's
// lock, as a live snapshot would, and fails unless it succeeds and
// leaves the freeze note at note.
func thawLeftoversLocked(t *testing.T, s *Store, uuid, note string) {
	t.Helper()
	unlock, err := s.lock(uuid)
	if err != nil {
		t.Fatal(err)
	}
	err = s.ThawLeftovers()
	unlock()
	if _, serr := os.Lstat(note); err != nil || serr != nil {
		t.Fatalf("ThawLeftovers beside a holder of the lock: %v, note %v", err, serr)
	}
}

// TestSnapshotDeleteWhileCreating deletes a snapshot from another
// goroutine while its create runs: right after the reservation, the
// create gives up (ErrNotReady) and nothing is left; after the copy, the
// delete waits for the create, which ends ready, and then removes it. In
// neither case is a record left without its file, or a deleted snapshot
// brought back.
func TestSnapshotDeleteWhileCreating(t *testing.T) {
	for _, step := range []string{"reserved", "copied"} {
		t.Run(step, func(t *testing.T) {
			s := newStore(t, Options{})
			ctx := context.Background()
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 16 << 20, Mode: ModeBlock})
			deleted := make(chan error, 1)
			snapshotRace = func(at string, made []*Snapshot) {
				if at != step {
					return
				}
				go func() { deleted <- s.DeleteSnapshot(ctx, made[0].UUID) }()
				select {
				case err := <-deleted:
					deleted <- err
				case <-time.After(300 * time.Millisecond): // waits on the snapshot's lock
				}
			}
			t.Cleanup(func() { snapshotRace = nil })
			sn, err := s.CreateSnapshot(ctx, v.Name, "snap", SnapshotOptions{})
			snapshotRace = nil
			if derr := <-deleted; derr != nil {
				t.Fatalf("DeleteSnapshot during the create: %v", derr)
			}
			switch step {
			case "reserved":
				if !errors.Is(err, ErrNotReady) {
					t.Fatalf("create whose snapshot was deleted after its reservation = %v, %v; want ErrNotReady", sn, err)
				}
			case "copied":
				if err != nil {
					t.Fatalf("create with a delete waiting: %v", err)
				}
			}
			if sns, err := s.ListSnapshots(ctx); err != nil || len(sns) != 0 {
				t.Errorf("snapshots after the create and the delete: %+v, %v; want none", sns, err)
			}
			if ents, err := os.ReadDir(filepath.Join(s.root, snapDir)); err != nil || len(ents) != 0 {
				t.Errorf("snapshot directory after the create and the delete: %v, %v; want empty", ents, err)
			}
		})
	}
}

// rawWriter starts writing counter i to the first 4KiB block of the
// block device dev, then to its last, i = 1, 2, ...: each write opens the
// device anew (O_DIRECT|O_DSYNC) and closes it, so the writer is seldom
// an opener when someone looks. A copy taken at one instant holds first
// == last or first == last+1; a copy whose last block holds more than its
// first is torn. The returned function stops the writer and returns how
// many rounds it completed.
func rawWriter(t *testing.T, dev string) (rounds func() int64, stop func()) {
	t.Helper()
	size, err := loop.Size(dev)
	if err != nil {
		t.Fatal(err)
	}
	buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	var done atomic.Int64
	quit, exited := make(chan struct{}), make(chan error, 1)
	write := func(off int64) error {
		fd, err := unix.Open(dev, unix.O_WRONLY|unix.O_DIRECT|unix.O_DSYNC|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		_, err = unix.Pwrite(fd, buf, off)
		return err
	}
	go func() {
		for i := uint64(1); ; i++ {
			select {
			case <-quit:
				exited <- nil
				return
			default:
			}
			binary.LittleEndian.PutUint64(buf, i)
			for _, off := range []int64{0, int64(size) - 4096} {
				if err := write(off); err != nil {
					exited <- err
					return
				}
			}
			done.Store(int64(i))
		}
	}()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		close(quit)
		if err := <-exited; err != nil {
			t.Errorf("writer: %v", err)
		}
		unix.Munmap(buf)
	}
	t.Cleanup(stop)
	for done.Load() < 20 {
		time.Sleep(5 * time.Millisecond)
	}
	return done.Load, stop
}

// firstLast reads the counters rawWriter wrote from the first and the
// last 4KiB block of the file at path.
func firstLast(t *testing.T, path string) (uint64, uint64) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	var a, b [8]byte
	if _, err := f.ReadAt(a[:], 0); err != nil {
		t.Fatal(err)
	}
	if _, err := f.ReadAt(b[:], st.Size()-4096); err != nil {
		t.Fatal(err)
	}
	return binary.LittleEndian.Uint64(a[:]), binary.LittleEndian.Uint64(b[:])
}

// TestSnapshotLabelUnderRawWriter: a snapshot of a block volume that a
// writer writes throughout, opening the device anew for each write (so
// a look at one moment finds it unused), is never labelled quiet: on a
// reflink store it is crash-consistent (a clone is taken at one
// instant), on a copy store torn (the copy reads the file over time),

// writtenBlockVolume makes s a whole-device block volume "w" of size
// bytes, attached, filled with random data: what the tests of copies
// under a raw writer (rawWriter) copy.
func writtenBlockVolume(t *testing.T, s *Store, size int64) (*Volume, *Status) {
	t.Helper()
	v := mustCreate(t, s, CreateRequest{Name: "w", SizeBytes: size, Mode: ModeBlock, NoPartition: true, KeepAttached: true})
	st, err := s.Status(v.Name)
	if err != nil {
		t.Fatal(err)
	}
	payload := make([]byte, size)
	rand.Read(payload)
	writeData(t, v, st, payload)
	return v, st
}

// and a copy that holds a state no crash leaves is always labelled torn.
func TestSnapshotLabelUnderRawWriter(t *testing.T) {
	want := map[CopyMethod]Consistency{CopyReflink: ConsistencyCrash, CopySparse: ConsistencyTorn}
	for _, sk := range storeKinds {
		t.Run(sk.fs+"-store", func(t *testing.T) {
			s := fsStore(t, sk.fs, Options{})
			ctx := context.Background()
			v, st := writtenBlockVolume(t, s, 150<<20)
			rounds, stop := rawWriter(t, st.DataDevice)
			before := rounds()
			sn, err := s.CreateSnapshot(ctx, v.Name, "s1", SnapshotOptions{})
			after := rounds()
			stop()
			if err != nil {
				t.Fatal(err)
			}
			if after <= before {
				t.Fatalf("the writer completed no round during the snapshot (%d, %d)", before, after)
			}
			first, last := firstLast(t, s.snapPath(sn.UUID))
			t.Logf("consistency %s, method %s, first %d, last %d, writer rounds %d..%d", sn.Consistency, sn.Method, first, last, before, after)
			if last > first && sn.Consistency != ConsistencyTorn {
				t.Errorf("the copy is torn (first block %d, last %d) but labelled %s", first, last, sn.Consistency)
			}
			if sn.Method != sk.method || sn.Consistency != want[sk.method] {
				t.Errorf("snapshot taken %s by %s under a writer, want %s by %s", sn.Consistency, sn.Method, want[sk.method], sk.method)
			}
			if err := s.DeleteSnapshot(ctx, sn.UUID); err != nil {
				t.Fatal(err)
			}
			if err := s.Delete(ctx, v.Name, DetachOptions{}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestCopyOfOpenUnwrittenBlockVolume: a block volume held open, and not
// written while it is copied, is copied on every store: its snapshot is
// crash-consistent (it is in use, and the kernel counted no write during
// the copy, so even a copy read over time holds one state), never torn,
// and its clone is made, not refused as written.
func TestCopyOfOpenUnwrittenBlockVolume(t *testing.T) {
	for _, sk := range storeKinds {
		t.Run(sk.fs+"-store", func(t *testing.T) {
			s := fsStore(t, sk.fs, Options{})
			ctx := context.Background()
			v, st := writtenBlockVolume(t, s, 32<<20)
			// Held open by another process, as an application would.
			reader, err := os.Open(st.DataDevice)
			if err != nil {
				t.Fatal(err)
			}
			holder := exec.Command("sleep", "60")
			holder.ExtraFiles = []*os.File{reader}
			if err := holder.Start(); err != nil {
				t.Fatal(err)
			}
			reader.Close()
			t.Cleanup(func() { holder.Process.Kill(); holder.Wait() })
			sn, err := s.CreateSnapshot(ctx, v.Name, "s1", SnapshotOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if sn.Consistency != ConsistencyCrash {
				t.Errorf("snapshot of a volume open and unwritten: %s by %s, want %s", sn.Consistency, sn.Method, ConsistencyCrash)
			}
			c, err := s.Create(ctx, CreateRequest{Name: "c", CloneOf: v.Name})
			if err != nil {
				t.Fatalf("clone of a volume open and unwritten: %v", err)
			}
			holder.Process.Kill()
			holder.Wait()
			for _, err := range []error{s.DeleteSnapshot(ctx, sn.UUID), s.Delete(ctx, c.Name, DetachOptions{}), s.Delete(ctx, v.Name, DetachOptions{})} {
				if err != nil {
					t.Error(err)
				}
			}
		})
	}
}

// TestCloneUnderRawWriter: a clone of a block volume that a writer
// writes throughout (a new open per write) is made where the store clones
// a file at one instant (reflink), and refused with ErrBusy, leaving no
// volume, where it copies over time: a clone carries no label, and a
// torn one would pass for the volume's state.
func TestCloneUnderRawWriter(t *testing.T) {
	for _, sk := range storeKinds {
		t.Run(sk.fs+"-store", func(t *testing.T) {
			s := fsStore(t, sk.fs, Options{})
			ctx := context.Background()
			v, st := writtenBlockVolume(t, s, 64<<20)
			_, stop := rawWriter(t, st.DataDevice)
			c, err := s.Create(ctx, CreateRequest{Name: "c", CloneOf: v.Name})
			stop()
			switch {
			case sk.method == CopyReflink && err != nil:
				t.Errorf("clone on a reflink store under a writer: %v", err)
			case sk.method == CopySparse && !errors.Is(err, ErrBusy):
				t.Errorf("clone on a %s store under a writer = %+v, %v; want ErrBusy", sk.method, c, err)
			}
			if sk.method == CopySparse {
				if vols, err := s.List(); err != nil || len(vols) != 1 {
					t.Errorf("after the refused clone the store lists %d volumes (%v), want the source only", len(vols), err)
				}
			}
			for _, name := range []string{"c", "w"} {
				if err := s.Delete(ctx, name, DetachOptions{}); err != nil && !errors.Is(err, ErrNotFound) {
					t.Fatal(err)
				}
			}
		})
	}
}

// TestExportUnderRawWriter: an export of a block volume that a writer
// writes throughout, opening the device anew for each write, fails with
// ErrBusy and leaves a stream that import refuses (no end record).
func TestExportUnderRawWriter(t *testing.T) {
	s := fsStore(t, "ext4", Options{})
	ctx := context.Background()
	v, st := writtenBlockVolume(t, s, 64<<20)
	_, stop := rawWriter(t, st.DataDevice)
	var stream bytes.Buffer
	_, err := s.Export(ctx, v.Name, &stream, StreamOptions{})
	stop()
	if !errors.Is(err, ErrBusy) {
		t.Errorf("export under a writer = %v, want ErrBusy", err)
	}
	if _, rerr := readStream(&stream, func(*StreamHeader) error { return nil }, func(int64, []byte) error { return nil }); rerr == nil {
		t.Errorf("the stream of the export under a writer (%d bytes) reads as complete", stream.Len())
	}
	if err := s.Delete(ctx, v.Name, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}
