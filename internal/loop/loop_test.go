package loop

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

func backingFile(t *testing.T, size int64) (string, FileID) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "backing")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	id, err := FileIDOfFD(int(f.Fd()))
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	return path, id
}

// openFD opens path read-write for Attach; closed at cleanup.
func openFD(t *testing.T, path string) int {
	t.Helper()
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// ownerOf is the proof of ownership of a device this test bound.
func ownerOf(d *Device) Owner { return Owner{ID: d.Backing, Tag: d.Tag, ReadOnly: d.ReadOnly()} }

func attach(t *testing.T, path string, opts AttachOptions) *Device {
	t.Helper()
	dev, err := Attach(openFD(t, path), opts)
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	t.Cleanup(func() {
		if err := Detach(dev.Path, ownerOf(dev)); err != nil && !errors.Is(err, ErrNotAttached) && !errors.Is(err, ErrNotOwned) {
			t.Errorf("cleanup detach %s: %v", dev.Path, err)
		}
	})
	return dev
}

func TestAttachFindDetach(t *testing.T) {
	testutil.RequireRoot(t)
	path, id := backingFile(t, 64<<20)
	dev := attach(t, path, AttachOptions{Tag: "sparsevol:test"})
	if dev.Backing != id {
		t.Fatalf("backing = %+v, want %+v", dev.Backing, id)
	}
	if dev.Autoclear() {
		t.Fatal("persistent device has autoclear set")
	}
	if dev.Tag != "sparsevol:test" {
		t.Fatalf("tag = %q", dev.Tag)
	}
	found, err := Bound(id)
	if err != nil || len(found[id]) != 1 || found[id][0].Path != dev.Path || found[id][0].Tag != dev.Tag {
		t.Fatalf("Bound = %v, %v; want %s", found, err, dev.Path)
	}
	size, err := Size(dev.Path)
	if err != nil || size != 64<<20 {
		t.Fatalf("Size = %d, %v", size, err)
	}
	// Detaching with the identity of another file must not touch it.
	_, other := backingFile(t, 1<<20)
	if err := Detach(dev.Path, Owner{ID: other, Tag: dev.Tag}); !errors.Is(err, ErrNotOwned) {
		t.Fatalf("Detach(other owner) = %v, want ErrNotOwned", err)
	}
	if err := Detach(dev.Path, Owner{ID: id, Tag: "sparsevol:other"}); !errors.Is(err, ErrNotOwned) {
		t.Fatalf("Detach(other tag) = %v, want ErrNotOwned", err)
	}
	if _, err := Get(dev.Path); err != nil {
		t.Fatalf("device gone after refused detach: %v", err)
	}
	if err := Detach(dev.Path, ownerOf(dev)); err != nil {
		t.Fatalf("Detach: %v", err)
	}
	if found, err := Bound(id); err != nil || len(found) != 0 {
		t.Fatalf("Bound after detach = %v, %v, want none", found, err)
	}
	// The number may already serve another file (tests of other packages
	// run at the same time): then it must be left alone.
	if err := Detach(dev.Path, ownerOf(dev)); !errors.Is(err, ErrNotAttached) && !errors.Is(err, ErrNotOwned) {
		t.Fatalf("second Detach = %v, want ErrNotAttached or ErrNotOwned", err)
	}
}

func TestAttachFlags(t *testing.T) {
	testutil.RequireRoot(t)
	tests := []struct {
		name string
		opts AttachOptions
	}{
		{"buffered", AttachOptions{}},
		{"read-only", AttachOptions{ReadOnly: true}},
		{"partscan", AttachOptions{Partscan: true}},
		{"direct-io-4k", AttachOptions{DirectIO: true, BlockSize: 4096}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path, _ := backingFile(t, 16<<20)
			dev := attach(t, path, tt.opts)
			if dev.ReadOnly() != tt.opts.ReadOnly || dev.Partscan() != tt.opts.Partscan {
				t.Fatalf("flags %#x do not match %+v", dev.Flags, tt.opts)
			}
			if tt.opts.BlockSize != 0 && dev.BlockSize != tt.opts.BlockSize {
				t.Fatalf("block size %d, want %d", dev.BlockSize, tt.opts.BlockSize)
			}
			// The backing filesystem here supports O_DIRECT; if the kernel
			// declined, the device must say so rather than claim it.
			if tt.opts.DirectIO {
				t.Logf("direct I/O on %s: %v", dev.Path, dev.DirectIO())
			}
		})
	}
}

func TestDetachRefusesMounted(t *testing.T) {
	testutil.RequireRoot(t)
	path, _ := backingFile(t, 64<<20)
	dev := attach(t, path, AttachOptions{})
	if out, err := exec.Command("mkfs.ext4", "-q", dev.Path).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v: %s", err, out)
	}
	mnt := t.TempDir()
	if err := unix.Mount(dev.Path, mnt, "ext4", 0, ""); err != nil {
		t.Fatal(err)
	}
	err := Detach(dev.Path, ownerOf(dev))
	unix.Unmount(mnt, 0)
	if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), mnt) {
		t.Fatalf("Detach of mounted device = %v, want ErrBusy naming %s", err, mnt)
	}
	if d, err := Get(dev.Path); err != nil || d.Autoclear() {
		t.Fatalf("refused detach changed the device: %+v, %v", d, err)
	}
}

func TestDetachDeferredWhenOpen(t *testing.T) {
	testutil.RequireRoot(t)
	path, id := backingFile(t, 16<<20)
	dev := attach(t, path, AttachOptions{})
	f, err := os.Open(dev.Path)
	if err != nil {
		t.Fatal(err)
	}
	err = Detach(dev.Path, ownerOf(dev))
	if !errors.Is(err, ErrDeferred) {
		f.Close()
		t.Fatalf("Detach while open = %v, want ErrDeferred", err)
	}
	f.Close()
	assertNotBoundTo(t, dev.Path, id)
}

func TestSetCapacity(t *testing.T) {
	testutil.RequireRoot(t)
	path, _ := backingFile(t, 16<<20)
	dev := attach(t, path, AttachOptions{})
	if err := os.Truncate(path, 32<<20); err != nil {
		t.Fatal(err)
	}
	_, other := backingFile(t, 1<<20)
	if err := SetCapacity(dev.Path, Owner{ID: other}); !errors.Is(err, ErrNotOwned) {
		t.Fatalf("SetCapacity(other) = %v", err)
	}
	if err := SetCapacity(dev.Path, ownerOf(dev)); err != nil {
		t.Fatal(err)
	}
	if size, _ := Size(dev.Path); size != 32<<20 {
		t.Fatalf("size after SetCapacity = %d", size)
	}
}

func TestParentOf(t *testing.T) {
	testutil.RequireRoot(t)
	path, _ := backingFile(t, 16<<20)
	dev := attach(t, path, AttachOptions{})
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dev.Path, link); err != nil {
		t.Fatal(err)
	}
	if got, err := ParentOf(link); err != nil || got != dev.Path {
		t.Fatalf("ParentOf(link) = %q, %v", got, err)
	}
	if _, err := ParentOf("/dev/null"); err == nil {
		t.Fatal("ParentOf(/dev/null) succeeded")
	}
}

func TestParseNumber(t *testing.T) {
	tests := []struct {
		in   string
		want int
		ok   bool
	}{
		{"/dev/loop0", 0, true},
		{"/dev/loop12", 12, true},
		{"loop3", 3, true},
		{"/dev/loop3p1", 0, false},
		{"/dev/sda", 0, false},
		{"/dev/loop-control", 0, false},
	}
	for _, tt := range tests {
		got, err := parseNumber(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("parseNumber(%q) = %d, %v", tt.in, got, err)
		}
	}
}

// TestMountPoints: a mount point with a space (mountinfo writes \040) is
// named as it is, by MountPoints and by Busy.
func TestMountPoints(t *testing.T) {
	testutil.RequireRoot(t)
	path, _ := backingFile(t, 16<<20)
	dev := attach(t, path, AttachOptions{})
	if out, err := exec.Command("mkfs.ext4", "-q", dev.Path).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v: %s", err, out)
	}
	mnt := filepath.Join(t.TempDir(), "a b")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dev.Path, mnt, "ext4", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, 0) })
	if got, err := MountPoints(dev.Path); err != nil || len(got) != 1 || got[0] != mnt {
		t.Fatalf("MountPoints = %q, %v; want [%q]", got, err, mnt)
	}
	if err := Busy(dev.Path); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), mnt) {
		t.Fatalf("Busy = %v, want ErrBusy naming %q", err, mnt)
	}
}

// TestConcurrentAttachWithForeignTools attaches files from many goroutines
// while losetup processes (which do not take our lock) grab free devices
// too: every attach must succeed on a device of its own.
func TestConcurrentAttachWithForeignTools(t *testing.T) {
	testutil.RequireRoot(t)
	const ours, theirs = 24, 8
	type res struct {
		dev *Device
		err error
	}
	results := make(chan res, ours)
	type bound struct{ dev, path string }
	foreign := make(chan bound, theirs)
	for i := 0; i < theirs; i++ {
		path, _ := backingFile(t, 1<<20)
		go func() {
			out, err := exec.Command("losetup", "--find", "--show", path).Output()
			if err != nil {
				foreign <- bound{}
				return
			}
			foreign <- bound{strings.TrimSpace(string(out)), path}
		}()
	}
	for i := 0; i < ours; i++ {
		path, _ := backingFile(t, 1<<20)
		go func() {
			dev, err := Attach(openFD(t, path), AttachOptions{Tag: "sparsevol:concurrency"})
			results <- res{dev, err}
		}()
	}
	seen := map[string]bool{}
	for i := 0; i < ours; i++ {
		r := <-results
		if r.err != nil {
			t.Errorf("Attach: %v", r.err)
			continue
		}
		if seen[r.dev.Path] {
			t.Errorf("device %s handed out twice", r.dev.Path)
		}
		seen[r.dev.Path] = true
		t.Cleanup(func() { Detach(r.dev.Path, ownerOf(r.dev)) })
	}
	for i := 0; i < theirs; i++ {
		if f := <-foreign; f.dev != "" {
			if seen[f.dev] {
				t.Errorf("device %s shared with losetup", f.dev)
			}
			t.Cleanup(func() { testutil.DetachIfServes(f.dev, f.path) })
		}
	}
}

// TestKeepBoundCancelsDeferredDetach: a detach deferred by an opener must
// not take the device away from a volume that was attached again since.
func TestKeepBoundCancelsDeferredDetach(t *testing.T) {
	testutil.RequireRoot(t)
	path, id := backingFile(t, 16<<20)
	dev := attach(t, path, AttachOptions{})
	f, err := os.Open(dev.Path)
	if err != nil {
		t.Fatal(err)
	}
	if err := Detach(dev.Path, ownerOf(dev)); !errors.Is(err, ErrDeferred) {
		f.Close()
		t.Fatalf("Detach while open = %v, want ErrDeferred", err)
	}
	kept, err := KeepBound(dev.Path, ownerOf(dev))
	if err != nil || kept.Autoclear() {
		f.Close()
		t.Fatalf("KeepBound = %+v, %v", kept, err)
	}
	f.Close()
	if d, err := Get(dev.Path); err != nil || d.Backing != id {
		t.Fatalf("device gone after last close although kept: %v", err)
	}
	_, other := backingFile(t, 1<<20)
	if _, err := KeepBound(dev.Path, Owner{ID: other}); !errors.Is(err, ErrNotOwned) {
		t.Fatalf("KeepBound(other) = %v", err)
	}
}

func TestHold(t *testing.T) {
	testutil.RequireRoot(t)
	path, id := backingFile(t, 16<<20)
	dev := attach(t, path, AttachOptions{})
	_, other := backingFile(t, 1<<20)
	if _, err := Hold(dev.Path, Owner{ID: other}); !errors.Is(err, ErrNotOwned) {
		t.Fatalf("Hold(other) = %v", err)
	}
	held, err := Hold(dev.Path, ownerOf(dev))
	if err != nil {
		t.Fatal(err)
	}
	// While held, a detach is only deferred: the number cannot be reused.
	if err := Detach(dev.Path, ownerOf(dev)); !errors.Is(err, ErrDeferred) {
		held.Close()
		t.Fatalf("Detach while held = %v, want ErrDeferred", err)
	}
	held.Close()
	held.Close() // a second Close must not close a reused fd number
	assertNotBoundTo(t, dev.Path, id)
}

// TestScanMatchesList: the sysfs-only scan must agree with the ioctls.
func TestScanMatchesList(t *testing.T) {
	testutil.RequireRoot(t)
	path, id := backingFile(t, 16<<20)
	attach(t, path, AttachOptions{DirectIO: true, Partscan: true, BlockSize: 4096})
	ro, roID := backingFile(t, 16<<20)
	attach(t, ro, AttachOptions{ReadOnly: true})
	scanned, err := Scan()
	if err != nil {
		t.Fatal(err)
	}
	listed, err := List()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []FileID{id, roID} {
		var s, l *Device
		for _, d := range scanned {
			if d.Backing == want {
				s = d
			}
		}
		for _, d := range listed {
			if d.Backing == want {
				l = d
			}
		}
		if s == nil || l == nil {
			t.Fatalf("device for %+v: scan %+v, list %+v", want, s, l)
		}
		if s.Path != l.Path || s.Flags != l.Flags || s.BlockSize != l.BlockSize {
			t.Fatalf("scan %+v != list %+v", s, l)
		}
	}
}

func TestNotifyChange(t *testing.T) {
	testutil.RequireRoot(t)
	path, _ := backingFile(t, 16<<20)
	dev := attach(t, path, AttachOptions{})
	if err := NotifyChange(dev.Path); err != nil {
		t.Fatal(err)
	}
	if err := NotifyChange("/dev/sda"); err == nil {
		t.Fatal("NotifyChange accepted a device that is not a loop device")
	}
}

// assertNotBoundTo fails unless path no longer serves the file id. Another
// package's test may have bound the freed number to its own file already.
func assertNotBoundTo(t *testing.T, path string, id FileID) {
	t.Helper()
	d, err := Get(path)
	if err == nil && d.Backing == id {
		t.Fatalf("%s still bound to the file", path)
	}
	if err != nil && !errors.Is(err, ErrNotAttached) {
		t.Fatal(err)
	}
}

// TestBindLeavesUdevWatchQuiet: udev re-probes a device whenever a writable
// fd on its /dev node is closed; binding must not cause that (the kernel
// already announces the bind). An inotify watch like udev's sees nothing
// from a bind, and does see a plain open-for-write of the same node, so
// the check can fail.
func TestBindLeavesUdevWatchQuiet(t *testing.T) {
	testutil.RequireRoot(t)
	// Whether or not udevd runs here, bind as if it did.
	path, want := backingFile(t, 4<<20)
	control, err := lockControl()
	if err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlRetInt(control, unix.LOOP_CTL_GET_FREE)
	if err != nil {
		unix.Close(control)
		t.Fatal(err)
	}
	watch, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		unix.Close(control)
		t.Fatal(err)
	}
	defer unix.Close(watch)
	if _, err := unix.InotifyAddWatch(watch, devicePath(n), unix.IN_CLOSE_WRITE); err != nil {
		unix.Close(control)
		t.Fatal(err)
	}
	dev, err := bindNumber(n, openFD(t, path), want, AttachOptions{QuietUdev: true})
	unix.Close(control)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = Detach(dev.Path, ownerOf(dev)) })

	closeWrites := func() int {
		buf := make([]byte, 4096)
		count := 0
		for {
			k, err := unix.Read(watch, buf)
			if k <= 0 || err != nil {
				return count
			}
			for off := 0; off+unix.SizeofInotifyEvent <= k; {
				ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
				if ev.Mask&unix.IN_CLOSE_WRITE != 0 {
					count++
				}
				off += unix.SizeofInotifyEvent + int(ev.Len)
			}
		}
	}
	if got := closeWrites(); got != 0 {
		t.Fatalf("binding %s closed a writable fd on its /dev node %d time(s): udev would probe it again", dev.Path, got)
	}
	if matches, _ := filepath.Glob(privateNodePrefix + "*"); len(matches) != 0 {
		t.Fatalf("private nodes left behind: %v", matches)
	}
	fd, err := unix.Open(dev.Path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	if got := closeWrites(); got != 1 {
		t.Fatalf("the watch saw %d close-after-write events of a plain open, want 1", got)
	}
}

// TestOwnerCheck: a device someone else bound to the volume's own file is
// not ours however much it looks like it: another window of the file
// (offset, size limit), read-only, or without our tag. Each is refused by
// every operation that changes a device, and left as it was.
func TestOwnerCheck(t *testing.T) {
	testutil.RequireRoot(t)
	const tag = "sparsevol:owner-check"
	tests := []struct {
		name    string
		losetup []string // foreign binding of the file
		tag     string   // what the owner proves
	}{
		{"offset", []string{"-o", "1048576"}, ""},
		{"size limit", []string{"--sizelimit", "8388608"}, ""},
		{"read-only", []string{"-r"}, ""},
		{"untagged", nil, ""},
		{"our tag but offset", []string{"-o", "33554432"}, tag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path, id := backingFile(t, 64<<20)
			foreign := testutil.Losetup(t, path, tt.losetup...)
			if tt.tag != "" {
				// Forge our tag onto the foreign window: the window must
				// still not pass.
				fd, err := unix.Open(foreign, unix.O_RDONLY|unix.O_CLOEXEC, 0)
				if err != nil {
					t.Fatal(err)
				}
				info, err := unix.IoctlLoopGetStatus64(fd)
				if err == nil {
					info.File_name = [unix.LO_NAME_SIZE]uint8{}
					copy(info.File_name[:], tt.tag)
					err = unix.IoctlLoopSetStatus64(fd, info)
				}
				unix.Close(fd)
				if err != nil {
					t.Fatal(err)
				}
			}
			owner := Owner{ID: id, Tag: tag}
			before, err := Get(foreign)
			if err != nil {
				t.Fatal(err)
			}
			if err := owner.Check(before); !errors.Is(err, ErrNotOwned) {
				t.Fatalf("Check(%+v) = %v, want ErrNotOwned", before, err)
			}
			found, err := Bound(id)
			if err != nil || len(found[id]) != 1 || found[id][0].Path != foreign {
				t.Fatalf("Bound = %v, %v; want the foreign %s (callers prove, Bound reports)", found, err, foreign)
			}
			for op, fn := range map[string]func() error{
				"Detach":      func() error { return Detach(foreign, owner) },
				"SetCapacity": func() error { return SetCapacity(foreign, owner) },
				"KeepBound":   func() error { _, err := KeepBound(foreign, owner); return err },
				"Hold": func() error {
					h, err := Hold(foreign, owner)
					if err == nil {
						h.Close()
					}
					return err
				},
			} {
				if err := fn(); !errors.Is(err, ErrNotOwned) {
					t.Errorf("%s of a foreign window = %v, want ErrNotOwned", op, err)
				}
			}
			after, err := Get(foreign)
			if err != nil || *after != *before {
				t.Fatalf("foreign device changed: %+v, %v; was %+v", after, err, before)
			}
		})
	}
}

// TestUnshared: a file no device holds is unshared; any device bound to
// it, read-write or read-only, ours or losetup's, and any other opener
// makes it shared; a detach makes it unshared again.
func TestUnshared(t *testing.T) {
	testutil.RequireRoot(t)
	tests := []struct {
		name  string
		bind  func(t *testing.T, path string) (undo func())
		flags int // how the caller opens the file to ask
		want  bool
	}{
		{"nothing bound", nil, unix.O_RDWR, true},
		{"nothing bound, asked read-only", nil, unix.O_RDONLY, true},
		{"our device", func(t *testing.T, path string) func() {
			fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			dev, err := Attach(fd, AttachOptions{Tag: "sparsevol:unshared"})
			unix.Close(fd) // the device holds the file, not this fd
			if err != nil {
				t.Fatal(err)
			}
			return func() {
				if err := Detach(dev.Path, ownerOf(dev)); err != nil {
					t.Fatal(err)
				}
			}
		}, unix.O_RDWR, false},
		{"losetup read-only", func(t *testing.T, path string) func() {
			dev := testutil.Losetup(t, path, "-r")
			return func() { testutil.DetachIfServes(dev, path) }
		}, unix.O_RDONLY, false},
		{"another opener", func(t *testing.T, path string) func() {
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			return func() { f.Close() }
		}, unix.O_RDWR, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path, _ := backingFile(t, 16<<20)
			ask := func() bool {
				t.Helper()
				fd, err := unix.Open(path, tt.flags|unix.O_CLOEXEC, 0)
				if err != nil {
					t.Fatal(err)
				}
				defer unix.Close(fd)
				free, err := Unshared(fd)
				if err != nil {
					t.Fatalf("Unshared: %v", err)
				}
				return free
			}
			var undo func()
			if tt.bind != nil {
				undo = tt.bind(t, path)
			}
			if got := ask(); got != tt.want {
				t.Fatalf("Unshared = %t, want %t", got, tt.want)
			}
			if undo != nil {
				undo()
				if !ask() {
					t.Fatal("Unshared = false once the device was gone")
				}
			}
		})
	}
}

// TestAttachPrefer: a preferred device is a hint. A free one is used; a
// bound one (someone else's), one that does not exist and anything that
// is no loop device are passed over for a free device, and what is bound
// is always the caller's file, proven.
func TestAttachPrefer(t *testing.T) {
	testutil.RequireRoot(t)
	tests := []struct {
		name   string
		prefer func(t *testing.T) (path string, used bool)
	}{
		{"free", func(t *testing.T) (string, bool) { return spareDevice(t), true }},
		{"bound to another file", func(t *testing.T) (string, bool) {
			other, _ := backingFile(t, 1<<20)
			return testutil.Losetup(t, other), false
		}},
		{"missing", func(*testing.T) (string, bool) { return "/dev/loop987654321", false }},
		{"no loop device", func(*testing.T) (string, bool) { return "/dev/null", false }},
		{"garbage", func(*testing.T) (string, bool) { return "loop-1\x00", false }},
		{"none", func(*testing.T) (string, bool) { return "", false }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefer, used := tt.prefer(t)
			var before *Device
			if !used && prefer != "" {
				before, _ = Get(prefer)
			}
			path, id := backingFile(t, 1<<20)
			dev := attach(t, path, AttachOptions{Tag: "sparsevol:prefer", Prefer: prefer})
			if err := (Owner{ID: id, Tag: "sparsevol:prefer"}).Check(dev); err != nil {
				t.Fatal(err)
			}
			if got := dev.Path == prefer; got != used {
				t.Errorf("bound %s, preferred %s: used %t, want %t", dev.Path, prefer, got, used)
			}
			if before != nil {
				if after, err := Get(prefer); err != nil || after.Backing != before.Backing || after.Tag != before.Tag {
					t.Errorf("%s was %+v, is %+v, %v", prefer, before, after, err)
				}
			}
		})
	}
}

// spareDevice adds an unbound loop device far above the existing ones,
// which no other test's search for a free device reaches, and removes it
// at cleanup.
func spareDevice(t *testing.T) string {
	t.Helper()
	highest := 0
	entries, _ := os.ReadDir("/sys/block")
	for _, e := range entries {
		if n, err := parseNumber(e.Name()); err == nil {
			highest = max(highest, n)
		}
	}
	control, err := lockControl()
	if err != nil {
		t.Fatal(err)
	}
	n := highest + 1000
	_, err = addDevice(control, n)
	unix.Close(control)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if fd, err := unix.Open(ControlPath, unix.O_RDWR|unix.O_CLOEXEC, 0); err == nil {
			unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.LOOP_CTL_REMOVE, uintptr(n))
			unix.Close(fd)
		}
	})
	return devicePath(n)
}

// Every bind takes a disk sequence number of its own, the one sysfs shows
// for the device while it is bound: the udev identity of a volume is keyed
// by it (volume/udevid.go), so a number must name one binding only.
func TestDiskSeqNamesTheBinding(t *testing.T) {
	testutil.RequireRoot(t)
	path, _ := backingFile(t, 16<<20)
	first := attach(t, path, AttachOptions{Tag: "sparsevol:seq"})
	if first.DiskSeq == 0 {
		t.Fatal("bound device has no disk sequence number (BLKGETDISKSEQ)")
	}
	sys, ok := readSysString("/sys/block/"+filepath.Base(first.Path)+"/diskseq", make([]byte, 32))
	if !ok || sys != strconv.FormatUint(first.DiskSeq, 10) {
		t.Fatalf("sysfs diskseq of %s = %q, device says %d", first.Path, sys, first.DiskSeq)
	}
	got, err := Get(first.Path)
	if err != nil || got.DiskSeq != first.DiskSeq {
		t.Fatalf("Get(%s).DiskSeq = %v, %v; want %d", first.Path, got, err, first.DiskSeq)
	}
	if err := Detach(first.Path, ownerOf(first)); err != nil {
		t.Fatal(err)
	}
	again := attach(t, path, AttachOptions{Tag: "sparsevol:seq"})
	if again.DiskSeq <= first.DiskSeq {
		t.Fatalf("rebinding %s gave disk sequence %d after %d: a number must not be reused", path, again.DiskSeq, first.DiskSeq)
	}
}

// TestBusySeesOpenersByAnyPath: a process that holds the device open is
// a user whatever path it opened it by: /dev/loopN, a node made with
// mknod elsewhere (as a container's /dev/xvda is), or one unlinked since.
func TestBusySeesOpenersByAnyPath(t *testing.T) {
	testutil.RequireRoot(t)
	path, _ := backingFile(t, 16<<20)
	dev := attach(t, path, AttachOptions{})
	devnum, err := dev.DevT()
	if err != nil {
		t.Fatal(err)
	}
	node := filepath.Join(t.TempDir(), "xvda")
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(devnum)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		path   string
		unlink bool
	}{
		{"by its own name", dev.Path, false},
		{"by another node", node, false},
		{"by a node unlinked since", node + "-gone", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.path != dev.Path && tc.path != node {
				if err := unix.Mknod(tc.path, unix.S_IFBLK|0o600, int(devnum)); err != nil {
					t.Fatal(err)
				}
			}
			f, err := os.OpenFile(tc.path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command("sleep", "60")
			cmd.ExtraFiles = []*os.File{f}
			err = cmd.Start()
			f.Close()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
			if tc.unlink {
				if err := os.Remove(tc.path); err != nil {
					t.Fatal(err)
				}
			}
			if err := Busy(dev.Path); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "pid "+strconv.Itoa(cmd.Process.Pid)) {
				t.Errorf("Busy while pid %d holds it open %s = %v, want ErrBusy naming it", cmd.Process.Pid, tc.name, err)
			}
			cmd.Process.Kill()
			cmd.Wait()
			if err := Busy(dev.Path); err != nil {
				t.Errorf("Busy once it is closed = %v, want nil", err)
			}
		})
	}
}
