package volume

import (
	"context"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// TestExpandFailureBeforeAnyChange: when the backing file cannot grow (here:
// beyond RLIMIT_FSIZE, the EFBIG of a size the filesystem cannot hold),
// nothing stays pending: the volume is ready at its size, the space it
// would have taken is free again, and other expansions and creates work.
func TestExpandFailureBeforeAnyChange(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{OvercommitRatio: 1e9})
	rawVolume(t, s, "v")
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_FSIZE, &old); err != nil {
		t.Fatal(err)
	}
	limit := unix.Rlimit{Cur: 8 * MiB, Max: old.Max}
	if err := unix.Setrlimit(unix.RLIMIT_FSIZE, &limit); err != nil {
		t.Fatal(err)
	}
	_, err := s.Expand(ctx, "v", 20<<40, ExpandOptions{})
	if err := unix.Setrlimit(unix.RLIMIT_FSIZE, &old); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(err, unix.EFBIG) {
		t.Fatalf("Expand beyond the file size limit = %v, want EFBIG", err)
	}
	st, err := s.Status("v")
	if err != nil || st.State != StateReady || st.ExpandingTo != 0 || st.SizeBytes != MiB || st.FileSizeBytes != MiB {
		t.Fatalf("after a failed first step: %+v, %v; want ready, 1 MiB, nothing pending", st, err)
	}
	if sp, err := s.Space(); err != nil || sp.CommittedBytes != MiB {
		t.Errorf("committed %d (%v) after the failed expansion, want %d", sp.CommittedBytes, err, MiB)
	}
	if _, err := s.AbandonExpand("v"); !errors.Is(err, ErrInvalid) {
		t.Errorf("AbandonExpand with nothing pending = %v, want ErrInvalid", err)
	}
	if v, err := s.Expand(ctx, "v", 2*MiB, ExpandOptions{}); err != nil || v.SizeBytes != 2*MiB {
		t.Errorf("a later expansion: %+v, %v", v, err)
	}
	rawVolume(t, s, "w")
}

// TestExpandPending: a partial expansion (what a failure or crash after
// the file grew leaves) shows as state expanding with its target; it can
// be abandoned while nothing beyond the old size is in use, else abandon
// refuses and changes nothing; either way it can be finished.
func TestExpandPending(t *testing.T) {
	tests := []struct {
		name    string
		req     CreateRequest
		attach  bool
		grow    func(t *testing.T, s *Store, v *Volume) // what the failed steps got done beyond the file
		wantErr error                                   // of AbandonExpand
	}{
		{"file only, detached", CreateRequest{Mode: ModeBlock, NoPartition: true}, false, nil, nil},
		{"file only, attached ext4", CreateRequest{FSType: "ext4"}, true, nil, nil},
		{"device grown", CreateRequest{Mode: ModeBlock, NoPartition: true}, true, func(t *testing.T, s *Store, v *Volume) {
			st, err := s.Status(v.UUID)
			if err != nil {
				t.Fatal(err)
			}
			fst, err := s.statBacking(v.UUID)
			if err != nil {
				t.Fatal(err)
			}
			if err := loop.SetCapacity(st.Device, v.owner(loop.FileID{Dev: fst.Dev, Inode: fst.Ino})); err != nil {
				t.Fatal(err)
			}
		}, ErrBusy},
		{"filesystem grown", CreateRequest{FSType: "ext4"}, false, func(t *testing.T, s *Store, v *Volume) {
			run(t, "e2fsck", "-f", "-p", v.BackingFile)
			run(t, "resize2fs", v.BackingFile)
		}, ErrBusy},
		{"partition table grown", CreateRequest{Mode: ModeBlock}, false, func(t *testing.T, s *Store, v *Volume) {
			st, err := s.Attach(context.Background(), v.UUID)
			if err != nil {
				t.Fatal(err)
			}
			run(t, "sgdisk", "--move-second-header", st.Device)
			if err := s.Detach(v.UUID, DetachOptions{}); err != nil {
				t.Fatal(err)
			}
		}, ErrBusy},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			req := tt.req
			req.Name, req.SizeBytes, req.KeepAttached = "v", 16*MiB, tt.attach
			v := mustCreate(t, s, req)
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			// What Expand leaves when the steps after the file fail.
			v.ExpandingTo = 32 * MiB
			if err := s.writeMeta(v); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(v.BackingFile, 32*MiB); err != nil {
				t.Fatal(err)
			}
			if tt.grow != nil {
				tt.grow(t, s, v)
			}

			st, err := s.Status("v")
			if err != nil || st.State != StateExpanding || st.ExpandingTo != 32*MiB || st.SizeBytes != 16*MiB {
				t.Fatalf("partial expansion shown as %s, size %d, target %d (%v); want expanding, 16 MiB, target 32 MiB",
					st.State, st.SizeBytes, st.ExpandingTo, err)
			}
			sts, err := s.Statuses()
			if err != nil || len(sts) != 1 || sts[0].State != StateExpanding {
				t.Fatalf("Statuses = %+v, %v; want one expanding", sts, err)
			}
			if _, err := s.Expand(ctx, "v", 20*MiB, ExpandOptions{}); !errors.Is(err, ErrInvalid) {
				t.Errorf("Expand below the pending target = %v, want ErrInvalid", err)
			}

			before := listing(t, s.Root())
			_, err = s.AbandonExpand("v")
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Fatalf("AbandonExpand = %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				if after := listing(t, s.Root()); after != before {
					t.Errorf("refused abandon changed the store:\n%s\nwas\n%s", after, before)
				}
				if v, err := s.Expand(ctx, "v", 32*MiB, ExpandOptions{}); err != nil || v.SizeBytes != 32*MiB || v.ExpandingTo != 0 {
					t.Fatalf("finishing the expansion: %+v, %v", v, err)
				}
				if st, err := s.Status("v"); err != nil || st.State != StateReady || st.FileSizeBytes != 32*MiB {
					t.Errorf("after finishing: %+v, %v; want ready, file 32 MiB", st, err)
				}
				return
			}
			st, err = s.Status("v")
			if err != nil || st.State != StateReady || st.ExpandingTo != 0 || st.SizeBytes != 16*MiB || st.FileSizeBytes != 16*MiB {
				t.Fatalf("after abandon: %+v, %v; want ready, file and size 16 MiB", st, err)
			}
			if tt.req.FSType != "" {
				dev := st.Device
				if dev == "" {
					a, err := s.Attach(ctx, "v")
					if err != nil {
						t.Fatal(err)
					}
					dev = a.Device
				}
				if err := s.CheckFilesystem(ctx, v, dev); err != nil {
					t.Errorf("after abandon: %v", err)
				}
			}
			if v, err := s.Expand(ctx, "v", 32*MiB, ExpandOptions{}); err != nil || v.SizeBytes != 32*MiB {
				t.Errorf("expanding again after abandon: %+v, %v", v, err)
			}
		})
	}
}

// TestFsEnd: the filesystem sizes read from the superblocks are what mkfs
// made.
func TestFsEnd(t *testing.T) {
	for _, tt := range []struct {
		fs   string
		size int64
		mkfs []string
	}{
		{"ext4", 64 * MiB, []string{"mkfs.ext4", "-q", "-F"}},
		{"xfs", 320 * MiB, []string{"mkfs.xfs", "-q", "-f"}},
	} {
		t.Run(tt.fs, func(t *testing.T) {
			path := t.TempDir() + "/img"
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(path, 2*tt.size); err != nil {
				t.Fatal(err)
			}
			args := append(tt.mkfs[1:], path)
			if tt.fs == "ext4" {
				args = append(args, "65536") // 1 KiB blocks
			} else {
				args = append([]string{"-d", "size=320m"}, args...)
			}
			run(t, tt.mkfs[0], args...)
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			fd := int(f.Fd())
			if got, err := fsEnd(fd, tt.fs); err != nil || got != tt.size {
				t.Errorf("fsEnd = %d, %v; want %d", got, err, tt.size)
			}
			if _, err := fsEnd(fd, map[string]string{"ext4": "xfs", "xfs": "ext4"}[tt.fs]); err == nil {
				t.Errorf("fsEnd as the other filesystem: no error")
			}
		})
	}
}

// TestTempMountSwapped: the temporary mount point of an offline XFS
// expansion, swapped for a link to another directory between its proof
// and the mount (a hostile writer of the lock directory racing the
// expansion), is never mounted through: nothing is mounted where the link
// points, the expansion is refused as unsafe, and no mount is left behind
// on the directory moved away either.
func TestTempMountSwapped(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	v := mustCreate(t, s, CreateRequest{Name: "x", SizeBytes: 300 << 20, FSType: "xfs"})
	victim := t.TempDir()
	var moved string
	tempMountRace = func(path string) {
		moved = path + ".moved"
		if err := os.Rename(path, moved); err != nil {
			t.Error(err)
		}
		if err := os.Symlink(victim, path); err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(func() { tempMountRace = nil })
	_, err := s.Expand(ctx, "x", 320<<20, ExpandOptions{})
	tempMountRace = nil
	if !errors.Is(err, ErrUnsafe) {
		t.Errorf("Expand with its mount point swapped = %v, want ErrUnsafe", err)
	}
	if moved == "" {
		t.Fatal("the expansion mounted nothing: the race was never run")
	}
	for _, dir := range []string{victim, moved} {
		if testutil.IsMountPoint(t, dir) {
			unix.Unmount(dir, unix.MNT_DETACH)
			t.Errorf("%s was mounted on", dir)
		}
	}
	if err := os.Remove(s.tempMountDir(v)); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(moved); err != nil {
		t.Fatal(err)
	}
	if v, err := s.Expand(ctx, "x", 320<<20, ExpandOptions{}); err != nil || v.SizeBytes != 320<<20 {
		t.Errorf("the expansion once the link is gone: %+v, %v", v, err)
	}
}

// TestGrowMountedXFSSwapped: an online XFS expansion whose mount point,
// as the mount table gave it, leads elsewhere by the time it is used (a
// hostile writer swapped a directory on the way) grows no filesystem but
// the volume's: it is refused as unsafe, the filesystem the path leads to
// keeps its size although its device has grown, and once the path is
// back the expansion finishes online.
func TestGrowMountedXFSSwapped(t *testing.T) {
	const size, grown = 300 << 20, 320 << 20
	tests := []struct {
		name string
		// swap puts something at dir, the directory holding the volume's
		// mount point mnt, which was moved away; other is the directory
		// holding the other volume's mount point mnt.
		swap func(dir, other string) error
	}{
		{"link to another XFS", func(dir, other string) error { return os.Symlink(other, dir) }},
		{"plain directory", func(dir, _ string) error { return os.MkdirAll(filepath.Join(dir, "mnt"), 0o700) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			base := t.TempDir()
			dir, other := filepath.Join(base, "x"), filepath.Join(base, "other")
			for _, name := range []string{"x", "other"} {
				mountXFSVolume(t, s, name, size, filepath.Join(base, name, "mnt"))
			}
			// The other filesystem could grow: its device has.
			if _, err := s.Expand(ctx, "other", grown, ExpandOptions{FileOnly: true}); err != nil {
				t.Fatal(err)
			}
			otherBlocks := fsBlocks(t, filepath.Join(other, "mnt"))

			moved := dir + ".moved"
			restore := func() {
				if _, err := os.Lstat(moved); err != nil {
					return
				}
				if err := os.RemoveAll(dir); err != nil {
					t.Error(err)
				}
				if err := os.Rename(moved, dir); err != nil {
					t.Error(err)
				}
			}
			t.Cleanup(restore)
			raced := false
			growMountRace = func(mountpoint string) {
				raced = true
				if mountpoint != filepath.Join(dir, "mnt") {
					t.Errorf("growing at %s, want %s/mnt", mountpoint, dir)
				}
				if err := os.Rename(dir, moved); err != nil {
					t.Error(err)
				}
				if err := tt.swap(dir, other); err != nil {
					t.Error(err)
				}
			}
			t.Cleanup(func() { growMountRace = nil })
			_, err := s.Expand(ctx, "x", grown, ExpandOptions{})
			growMountRace = nil
			if !raced {
				t.Fatalf("Expand = %v without growing online: the race was never run", err)
			}
			if !errors.Is(err, ErrUnsafe) {
				t.Errorf("Expand with its mount point swapped = %v, want ErrUnsafe", err)
			}
			if got := fsBlocks(t, filepath.Join(other, "mnt")); got != otherBlocks {
				t.Errorf("the other filesystem went from %d to %d blocks", otherBlocks, got)
			}

			restore()
			xBlocks := fsBlocks(t, filepath.Join(dir, "mnt"))
			if v, err := s.Expand(ctx, "x", grown, ExpandOptions{}); err != nil || v.SizeBytes != grown {
				t.Fatalf("the expansion once the path is back: %+v, %v", v, err)
			}
			if got := fsBlocks(t, filepath.Join(dir, "mnt")); got <= xBlocks {
				t.Errorf("the volume's filesystem has %d blocks after the expansion, %d before", got, xBlocks)
			}
		})
	}
}

// mountXFSVolume creates an attached XFS volume name of size bytes and
// mounts it at mnt, made with its parents, until cleanup.
func mountXFSVolume(t *testing.T, s *Store, name string, size int64, mnt string) {
	t.Helper()
	mustCreate(t, s, CreateRequest{Name: name, SizeBytes: size, FSType: "xfs", KeepAttached: true})
	st, err := s.Status(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(st.DataDevice, mnt, "xfs", 0, ""); err != nil {
		t.Fatalf("mount %s: %v", st.DataDevice, err)
	}
	t.Cleanup(func() { unmountEventually(t, mnt) })
}

// fsBlocks is the size of the filesystem mounted at dir, in its blocks.
func fsBlocks(t *testing.T, dir string) uint64 {
	t.Helper()
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	return sfs.Blocks
}

// TestTempMountCovered: another XFS mounted over the offline expansion's
// temporary mount of the volume, between that mount and the grow, is not
// grown although its device has: the grow acts on a descriptor proven on
// the volume's device, so the expansion is refused as unsafe, and once
// nothing covers the mount it finishes.
func TestTempMountCovered(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	v := mustCreate(t, s, CreateRequest{Name: "x", SizeBytes: 300 << 20, FSType: "xfs"})
	mustCreate(t, s, CreateRequest{Name: "other", SizeBytes: 300 << 20, FSType: "xfs", KeepAttached: true})
	if _, err := s.Expand(ctx, "other", 320<<20, ExpandOptions{FileOnly: true}); err != nil {
		t.Fatal(err)
	}
	other, err := s.Status("other")
	if err != nil {
		t.Fatal(err)
	}
	otherBlocks := func() uint64 {
		dir := mountTemp(t, other.DataDevice, "xfs")
		defer unmountEventually(t, dir)
		return fsBlocks(t, dir)
	}
	before := otherBlocks()
	covered := ""
	tempMountedRace = func(dir string) {
		covered = dir
		if err := unix.Mount(other.DataDevice, dir, "xfs", 0, ""); err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(func() { tempMountedRace = nil })
	_, err = s.Expand(ctx, "x", 320<<20, ExpandOptions{})
	tempMountedRace = nil
	if covered == "" {
		t.Fatalf("Expand = %v without a temporary mount: the race was never run", err)
	}
	if !errors.Is(err, ErrUnsafe) {
		t.Errorf("Expand with its temporary mount covered = %v, want ErrUnsafe", err)
	}
	if _, err := os.Lstat(s.tempMountDir(v)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the temporary mount point is left: %v", err)
	}
	if after := otherBlocks(); after != before {
		t.Errorf("the other filesystem went from %d to %d blocks", before, after)
	}
	if v, err := s.Expand(ctx, "x", 320<<20, ExpandOptions{}); err != nil || v.SizeBytes != 320<<20 {
		t.Errorf("the expansion once nothing covers it: %+v, %v", v, err)
	}
}

// TestExpandFrozenRefused: an online expansion of a filesystem someone
// else froze (fsfreeze --freeze, a backup hook) is refused with ErrBusy,
// saying how to thaw it, at once and with nothing changed (record, file,
// device), instead of waiting in the kernel, unkillable and holding the
// volume's lock, until the thaw; that freeze stays. Once thawed, the
// expansion works.
func TestExpandFrozenRefused(t *testing.T) {
	for _, tt := range []struct {
		fsType      string
		size, grown int64
	}{
		{"xfs", 300 << 20, 320 << 20},
		{"ext4", 32 << 20, 64 << 20},
	} {
		t.Run(tt.fsType, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
			mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: tt.size, FSType: tt.fsType, KeepAttached: true})
			st, err := s.Status("v")
			if err != nil {
				t.Fatal(err)
			}
			mnt := filepath.Join(t.TempDir(), "mnt")
			if err := os.Mkdir(mnt, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := unix.Mount(st.DataDevice, mnt, tt.fsType, 0, ""); err != nil {
				t.Fatalf("mount %s: %v", st.DataDevice, err)
			}
			t.Cleanup(func() { unmountEventually(t, mnt) })
			fd := frozenByOthers(t, mnt)

			done := make(chan error, 1)
			go func() { _, err := s.Expand(ctx, "v", tt.grown, ExpandOptions{}); done <- err }()
			select {
			case err = <-done:
			case <-time.After(10 * time.Second):
				unix.IoctlSetInt(fd, ioctlFITHAW, 0) // lets the blocked grow go on
				<-done
				t.Fatalf("Expand of a frozen filesystem blocked until it was thawed")
			}
			if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "fsfreeze --unfreeze "+mnt) {
				t.Fatalf("Expand of a frozen filesystem = %v, want ErrBusy saying how to thaw it", err)
			}
			if v, err := s.Get("v"); err != nil || v.SizeBytes != tt.size || v.ExpandingTo != 0 {
				t.Errorf("record after the refused expand: %+v, %v; want size %d, nothing pending", v, err, tt.size)
			}
			if fi, err := os.Stat(st.BackingFile); err != nil || fi.Size() != tt.size {
				t.Errorf("backing file after the refused expand: %v, %v; want %d bytes", fi, err, tt.size)
			}
			if n, err := loop.Size(st.Device); err != nil || int64(n) != tt.size {
				t.Errorf("device after the refused expand: %d, %v; want %d bytes", n, err, tt.size)
			}
			if err := unix.IoctlSetInt(fd, ioctlFIFREEZE, 0); !errors.Is(err, unix.EBUSY) {
				t.Fatalf("the other freeze is gone: FIFREEZE = %v, want EBUSY", err)
			}
			if err := unix.IoctlSetInt(fd, ioctlFITHAW, 0); err != nil {
				t.Fatal(err)
			}
			if tt.fsType == "ext4" && testutil.HostLacks(t, testutil.FeatureSysResource, testutil.CapSysResource()) {
				return // online ext4 growth needs it
			}
			if v, err := s.Expand(ctx, "v", tt.grown, ExpandOptions{}); err != nil || v.SizeBytes != tt.grown {
				t.Fatalf("Expand once thawed: %+v, %v", v, err)
			}
		})
	}
}

// TestExpandRefusesHugeSize: a size beyond what the store takes (the
// largest int64, or one MiB past the bound create applies) is refused as
// invalid, as create refuses it, not weighed as a want of space, and
// nothing changes.
func TestExpandRefusesHugeSize(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	v := rawVolume(t, s, "v")
	for _, size := range []int64{math.MaxInt64, maxSize + MiB, math.MaxInt64 - MiB + 2} {
		before := listing(t, s.Root())
		if _, err := s.Expand(ctx, "v", size, ExpandOptions{}); !errors.Is(err, ErrInvalid) || errors.Is(err, ErrNoSpace) {
			t.Errorf("Expand to %d = %v, want ErrInvalid", size, err)
		}
		if after := listing(t, s.Root()); after != before {
			t.Errorf("the refused expand to %d changed the store:\nbefore %s\nafter  %s", size, before, after)
		}
	}
	if got, err := s.Get(v.UUID); err != nil || got.SizeBytes != MiB || got.ExpandingTo != 0 {
		t.Errorf("volume after refused expands: %+v, %v", got, err)
	}
}
