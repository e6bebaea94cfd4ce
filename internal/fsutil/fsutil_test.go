package fsutil

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestReplaceFile(t *testing.T) {
	for _, flush := range []Flush{FlushAll, FlushNone, FlushOnce} {
		t.Run(fmt.Sprint(flush), func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "f")
			for _, content := range []string{"one", "two, longer"} {
				if err := ReplaceFile(path, []byte(content), 0o640, flush); err != nil {
					t.Fatal(err)
				}
				got, err := os.ReadFile(path)
				if err != nil || string(got) != content {
					t.Fatalf("read %q, %v; want %q", got, err, content)
				}
				if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o640 {
					t.Errorf("mode %v, want 0640", fi.Mode().Perm())
				}
			}
			if entries, _ := os.ReadDir(dir); len(entries) != 1 {
				t.Errorf("temporary files left: %v", entries)
			}
		})
	}
}

func TestReplaceSymlink(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(dir, "sub", "link") // directory made on demand
	for _, target := range []string{"/dev/loop1", "/dev/loop1", "/dev/loop2"} {
		if err := ReplaceSymlink(target, link); err != nil {
			t.Fatal(err)
		}
		if got, err := os.Readlink(link); err != nil || got != target {
			t.Fatalf("link -> %q, %v; want %q", got, err, target)
		}
	}
	if entries, _ := os.ReadDir(filepath.Dir(link)); len(entries) != 1 {
		t.Errorf("temporary links left: %v", entries)
	}
}

// TestReadRegular: ReadRegular returns what os.ReadFile does, an empty
// file and one larger than its first read included; a missing file is
// fs.ErrNotExist; a symbolic link, a FIFO (without blocking), a directory
// and a file over the limit are refused.
func TestReadRegular(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []int{0, 1, 4096, 1 << 20} {
		path := filepath.Join(dir, fmt.Sprint(n))
		want := make([]byte, n)
		for i := range want {
			want[i] = byte(i * 7)
		}
		if err := os.WriteFile(path, want, 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := ReadRegular(path, 1<<20)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%d bytes: read %d, %v", n, len(got), err)
		}
	}
	if _, err := ReadRegular(filepath.Join(dir, "missing"), 1<<20); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("missing file: %v, want fs.ErrNotExist", err)
	}
	refused := t.TempDir()
	link, fifo := filepath.Join(refused, "link"), filepath.Join(refused, "fifo")
	if err := os.Symlink(filepath.Join(dir, "1"), link); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name, path string
		limit      int64
	}{
		{"symbolic link", link, 1 << 20},
		{"FIFO", fifo, 1 << 20},
		{"directory", refused, 1 << 20},
		{"over the limit", filepath.Join(dir, "4096"), 4095},
	} {
		if data, err := ReadRegular(tt.path, tt.limit); err == nil {
			t.Errorf("%s: read %d bytes, want a refusal", tt.name, len(data))
		}
	}
	f, err := OpenDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if names, err := f.Readdirnames(-1); err != nil || len(names) != 4 {
		t.Fatalf("OpenDir: entries %v, %v", names, err)
	}
	if _, err := OpenDir(filepath.Join(dir, "0")); err == nil {
		t.Fatal("OpenDir opened a regular file")
	}
}

// ReadOwnRegular reads only a file ReplaceFile could have left: this
// user's, one link, writable by no one else.
func TestReadOwnRegular(t *testing.T) {
	tests := []struct {
		name string
		make func(t *testing.T, path string)
		ok   bool
	}{
		{"own file", func(t *testing.T, path string) {}, true},
		{"group writable", func(t *testing.T, path string) { mustDo(t, os.Chmod(path, 0o664)) }, false},
		{"world writable", func(t *testing.T, path string) { mustDo(t, os.Chmod(path, 0o646)) }, false},
		{"second link", func(t *testing.T, path string) { mustDo(t, os.Link(path, path+".2")) }, false},
		{"another owner", func(t *testing.T, path string) {
			if os.Geteuid() != 0 {
				t.Skip("needs root to chown")
			}
			mustDo(t, os.Chown(path, 65534, 65534))
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "f")
			if err := ReplaceFile(path, []byte("data"), 0o644, FlushNone); err != nil {
				t.Fatal(err)
			}
			tt.make(t, path)
			got, err := ReadOwnRegular(path, 16)
			if tt.ok && (err != nil || string(got) != "data") {
				t.Errorf("ReadOwnRegular = %q, %v; want data", got, err)
			}
			if !tt.ok && !errors.Is(err, errNotOwn) {
				t.Errorf("ReadOwnRegular = %q, %v; want errNotOwn", got, err)
			}
		})
	}
}

func mustDo(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestCreateMarker: a missing marker is made, a regular file left as it
// is; a symbolic link (dangling or not) is refused without creating or
// truncating its target, a FIFO without blocking, a directory too.
func TestCreateMarker(t *testing.T) {
	dir := t.TempDir()
	victim, absent := filepath.Join(dir, "victim"), filepath.Join(dir, "absent")
	if err := os.WriteFile(victim, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		make   func(path string) error
		refuse bool
	}{
		{"missing", func(string) error { return nil }, false},
		{"regular file", func(p string) error { return os.WriteFile(p, []byte("kept"), 0o600) }, false},
		{"link to a file", func(p string) error { return os.Symlink(victim, p) }, true},
		{"dangling link", func(p string) error { return os.Symlink(absent, p) }, true},
		{"FIFO", func(p string) error { return unix.Mkfifo(p, 0o600) }, true},
		{"directory", func(p string) error { return os.Mkdir(p, 0o700) }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "marker")
			if err := tt.make(path); err != nil {
				t.Fatal(err)
			}
			var before []byte
			if !tt.refuse {
				before, _ = os.ReadFile(path)
			}
			err := CreateMarker(path)
			if tt.refuse {
				if err == nil {
					t.Error("made a marker over it, want a refusal")
				}
			} else if fi, serr := os.Lstat(path); err != nil || serr != nil || !fi.Mode().IsRegular() {
				t.Errorf("CreateMarker = %v; marker %v, %v", err, fi, serr)
			} else if after, _ := os.ReadFile(path); !bytes.Equal(after, before) {
				t.Errorf("marker now holds %q, was %q", after, before)
			}
			if got, err := os.ReadFile(victim); err != nil || string(got) != "kept" {
				t.Errorf("victim now %q, %v", got, err)
			}
			if _, err := os.Lstat(absent); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("a link's target was created (%v)", err)
			}
		})
	}
}

// TestCreateMarkerOpensNothingElse: CreateMarker refuses a FIFO at the
// marker's path without opening it, which a device node's open would
// notice alike (a watchdog armed by an open for writing): a reader
// blocked in opening the FIFO is not woken, as a writer's open would
// wake it.
func TestCreateMarkerOpensNothingElse(t *testing.T) {
	fifo, woken := waitingFIFO(t, unix.O_RDONLY)
	if err := CreateMarker(fifo); !errors.Is(err, errNotRegular) {
		t.Errorf("CreateMarker on a FIFO = %v, want errNotRegular", err)
	}
	if woken() {
		t.Errorf("CreateMarker opened the FIFO: its reader's open returned")
	}
}

// TestCheckFD: a passing check hands the fd back open; a failing one
// returns its error with the fd closed.
func TestCheckFD(t *testing.T) {
	for _, pass := range []bool{true, false} {
		fd, err := unix.Open(t.TempDir(), unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		refused := errors.New("refused")
		got, err := CheckFD(fd, func(st *unix.Stat_t) error {
			if !pass || st.Mode&unix.S_IFMT != unix.S_IFDIR {
				return refused
			}
			return nil
		})
		var st unix.Stat_t
		open := unix.Fstat(fd, &st) == nil
		if pass && (err != nil || got != fd || !open) {
			t.Errorf("passing check: fd %d, %v, open %t; want %d, nil, open", got, err, open, fd)
		}
		if !pass && (!errors.Is(err, refused) || got != -1 || open) {
			t.Errorf("failing check: fd %d, %v, open %t; want -1, refused, closed", got, err, open)
		}
		if open {
			unix.Close(fd)
		}
	}
}

// TestOverwrite: a regular file is written over in place (the same
// inode, cut to the new length); a symbolic link, a second link, a FIFO
// or nothing at all is refused and what it leads to is left alone.
func TestOverwrite(t *testing.T) {
	tests := []struct {
		name  string
		setup func(t *testing.T, path, other string)
		ok    bool
	}{
		{"regular", func(t *testing.T, path, other string) {
			if err := os.WriteFile(path, []byte("the old, longer content"), 0o600); err != nil {
				t.Fatal(err)
			}
		}, true},
		{"symlink", func(t *testing.T, path, other string) {
			if err := os.Symlink(other, path); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"hard link", func(t *testing.T, path, other string) {
			if err := os.Link(other, path); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"fifo", func(t *testing.T, path, other string) {
			if err := unix.Mkfifo(path, 0o600); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"missing", func(t *testing.T, path, other string) {}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			path, other := filepath.Join(dir, "f"), filepath.Join(dir, "other")
			if err := os.WriteFile(other, []byte("another file"), 0o600); err != nil {
				t.Fatal(err)
			}
			tt.setup(t, path, other)
			before, _ := os.Lstat(path)
			err := Overwrite(path, []byte("new"))
			if got, _ := os.ReadFile(other); string(got) != "another file" {
				t.Errorf("the other file holds %q", got)
			}
			if !tt.ok {
				if err == nil {
					t.Fatal("Overwrite succeeded, want a refusal")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			after, _ := os.Lstat(path)
			if got, _ := os.ReadFile(path); string(got) != "new" || !os.SameFile(before, after) {
				t.Errorf("file holds %q, same inode %v; want \"new\" in place", got, os.SameFile(before, after))
			}
		})
	}
}

// TestReadRegularOpensNothingElse: the readers refuse a FIFO without
// opening it, which a device node's open would notice alike (a watchdog
// armed, a loop device held, a terminal made the controlling one): a
// writer blocked in opening the FIFO is not woken, as a reader's open
// would wake it.
func TestReadRegularOpensNothingElse(t *testing.T) {
	readers := []struct {
		name string
		read func(path string) ([]byte, error)
	}{
		{"ReadRegular", func(p string) ([]byte, error) { return ReadRegular(p, 1<<20) }},
		{"ReadOwnRegular", func(p string) ([]byte, error) { return ReadOwnRegular(p, 1<<20) }},
		{"ReadRegularFollowing", func(p string) ([]byte, error) { return ReadRegularFollowing(p, 1<<20) }},
	}
	for _, r := range readers {
		t.Run(r.name, func(t *testing.T) {
			fifo, woken := waitingFIFO(t, unix.O_WRONLY)
			if data, err := r.read(fifo); !errors.Is(err, errNotRegular) {
				t.Errorf("read FIFO = %d bytes, %v; want errNotRegular", len(data), err)
			}
			if woken() {
				t.Errorf("reading the FIFO opened it: its writer's open returned")
			}
		})
	}
}

// waitingFIFO makes a FIFO with a partner blocked in opening it with
// flags (O_WRONLY or O_RDONLY), which only an open of the other end
// wakes. woken reports whether that happened since.
func waitingFIFO(t *testing.T, flags int) (fifo string, woken func() bool) {
	t.Helper()
	fifo = filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	opened := make(chan int, 1)
	go func() {
		fd, _ := unix.Open(fifo, flags|unix.O_CLOEXEC, 0) // blocks for the other end
		opened <- fd
	}()
	t.Cleanup(func() {
		// Release the partner if it still waits: a reader's open
		// never blocks with O_NONBLOCK, a writer's fails without a
		// reader, so the partner's end is opened as the releaser.
		other := unix.O_RDONLY | unix.O_NONBLOCK
		if flags == unix.O_RDONLY {
			other = unix.O_WRONLY | unix.O_NONBLOCK
		}
		if fd, err := unix.Open(fifo, other|unix.O_CLOEXEC, 0); err == nil {
			if pfd := <-opened; pfd >= 0 {
				unix.Close(pfd)
			}
			unix.Close(fd)
		}
	})
	time.Sleep(100 * time.Millisecond) // the partner is waiting in open
	return fifo, func() bool {
		select {
		case fd := <-opened:
			opened <- fd
			return true
		case <-time.After(200 * time.Millisecond):
			return false
		}
	}
}

// BenchmarkReadRegular reads a record-sized file the way readMeta reads
// each volume's record at boot.
func BenchmarkReadRegular(b *testing.B) {
	path := filepath.Join(b.TempDir(), "r.json")
	if err := os.WriteFile(path, make([]byte, 700), 0o600); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := ReadRegular(path, 1<<20); err != nil {
			b.Fatal(err)
		}
	}
}
