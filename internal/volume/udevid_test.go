package volume

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/fsutil"
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

// Attach leaves udev the identity of its bindings, named by the binding's
// disk sequence number: a ready, unlabelled filesystem volume's type and
// UUID; for a raw volume a file that turns udev's probe off, and a
// partitioned one's partition entry (<seq>p1). Nothing for a labelled
// filesystem volume, nothing a create left behind, nothing for a device
// someone else bound to the same file; detach removes them.
func TestUdevIdentity(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "udev")
	s := newStore(t, Options{UdevIdentityDir: dir})
	vols := map[string]*Volume{
		"ext4":     mustCreate(t, s, CreateRequest{Name: "ext4", SizeBytes: 16 << 20}),
		"labelled": mustCreate(t, s, CreateRequest{Name: "labelled", SizeBytes: 16 << 20, MkfsOptions: []string{"-L", "data"}}),
		"raw":      mustCreate(t, s, CreateRequest{Name: "raw", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true}),
		"gpt":      mustCreate(t, s, CreateRequest{Name: "gpt", SizeBytes: 4 << 20, Mode: ModeBlock}),
	}
	if got := identities(t, dir); len(got) != 0 {
		t.Fatalf("create left udev identities %v", got)
	}
	head := func(name string) string { return "SPARSEVOL_VOLUME=" + vols[name].UUID + "\n" }
	wantFiles := func(t *testing.T) map[string]string {
		t.Helper()
		want := map[string]string{}
		for name := range vols {
			st, err := s.Status(name)
			if err != nil {
				t.Fatal(err)
			}
			dev, err := loop.Get(st.Device)
			if err != nil {
				t.Fatal(err)
			}
			seq := strconv.FormatUint(dev.DiskSeq, 10)
			u := vols[name].UUID
			switch name {
			case "ext4":
				want[seq] = head(name) + "ID_FS_TYPE=ext4\nID_FS_USAGE=filesystem\nID_FS_UUID=" + u + "\nID_FS_UUID_ENC=" + u + "\n"
			case "raw":
				want[seq] = head(name)
			case "gpt":
				want[seq] = head(name) + "ID_PART_TABLE_TYPE=gpt\n"
				want[seq+"p1"] = head(name) + "ID_PART_ENTRY_SCHEME=gpt\nID_PART_ENTRY_NUMBER=1\n" +
					"ID_PART_ENTRY_TYPE=0fc63daf-8483-4772-8e79-3d69d8477de4\nID_PART_ENTRY_UUID=" + u + "\n"
			}
		}
		return want
	}
	for _, attach := range []struct {
		name string
		do   func() error
	}{
		{"Attach", func() error {
			for name := range vols {
				if _, err := s.Attach(ctx, name); err != nil {
					return err
				}
			}
			return nil
		}},
		{"AttachAll", func() error { _, err := s.AttachAll(ctx); return err }},
	} {
		t.Run(attach.name, func(t *testing.T) {
			if err := attach.do(); err != nil {
				t.Fatal(err)
			}
			want := wantFiles(t)
			if got := identities(t, dir); !maps.Equal(got, want) {
				t.Errorf("udev identities %q, want %q", got, want)
			}
			// An attach that keeps the device puts back what went missing.
			for name := range want {
				os.Remove(filepath.Join(dir, name))
			}
			if _, err := s.AttachAll(ctx); err != nil {
				t.Fatal(err)
			}
			if got := identities(t, dir); !maps.Equal(got, want) {
				t.Errorf("after an attach that kept the devices: udev identities %q, want %q", got, want)
			}
			// Someone else's binding of the same file has a number of its own.
			file := filepath.Join(s.root, vols["ext4"].UUID)
			foreign := testutil.Losetup(t, file, "--read-only")
			fdev, err := loop.Get(foreign)
			testutil.DetachIfServes(foreign, file)
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := identities(t, dir)[strconv.FormatUint(fdev.DiskSeq, 10)]; ok {
				t.Errorf("a foreign binding (%s, diskseq %d) has a volume's identity", foreign, fdev.DiskSeq)
			}
			if err := s.DetachAll(DetachOptions{}); err != nil {
				t.Fatal(err)
			}
			if got := identities(t, dir); len(got) != 0 {
				t.Errorf("detach left udev identities %q", got)
			}
		})
	}
	for name := range vols {
		if err := s.Delete(ctx, name, DetachOptions{}); err != nil {
			t.Error(err)
		}
	}
}

// TestUdevIdentityNoWriteThrough: the identity file is written through a
// new temporary file: a name already in the directory, the temporary name
// of an earlier scheme or the final one, linked to another file (hard or
// symbolic), is never written through, and the identity is still left.
func TestUdevIdentityNoWriteThrough(t *testing.T) {
	const seq = 1 << 62
	tests := []struct {
		name  string
		plant func(dir, victim string) error
	}{
		{"hard link at <seq>.tmp", func(dir, victim string) error {
			return os.Link(victim, filepath.Join(dir, strconv.Itoa(seq)+".tmp"))
		}},
		{"symbolic link at <seq>.tmp", func(dir, victim string) error {
			return os.Symlink(victim, filepath.Join(dir, strconv.Itoa(seq)+".tmp"))
		}},
		{"hard link at <seq>", func(dir, victim string) error {
			return os.Link(victim, filepath.Join(dir, strconv.Itoa(seq)))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			top := t.TempDir()
			dir := filepath.Join(top, "udev")
			victim := filepath.Join(top, "victim")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(victim, []byte("kept"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := tt.plant(dir, victim); err != nil {
				t.Fatal(err)
			}
			s := newStore(t, Options{UdevIdentityDir: dir})
			v := mustCreate(t, s, CreateRequest{Name: "ext4", SizeBytes: 16 << 20})
			s.writeIdentity(v, &loop.Device{Path: "/dev/loop-test", DiskSeq: seq})
			if got, err := os.ReadFile(victim); err != nil || string(got) != "kept" {
				t.Errorf("victim now %q, %v", got, err)
			}
			disk, _ := identityFiles(v)
			want := string(disk)
			if got, err := fsutil.ReadRegular(filepath.Join(dir, strconv.Itoa(seq)), 1<<10); err != nil || string(got) != want {
				t.Errorf("identity %q, %v; want %q", got, err, want)
			}
		})
	}
}

// TestUdevIdentityOwnFileOnly: a file already at the identity's name is
// left in place only where it is one writeIdentity could have made: the
// identity's content in a file of this process's user, with one link and
// writable by no one else. One with the same content that someone else
// can still change (another owner, a mode that lets others write, a
// second name elsewhere) is replaced before udev reads it.
func TestUdevIdentityOwnFileOnly(t *testing.T) {
	const seq = 1 << 62
	tests := []struct {
		name  string
		plant func(t *testing.T, path string, data []byte)
	}{
		{"writable by others", func(t *testing.T, path string, data []byte) {
			if err := os.WriteFile(path, data, 0o666); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(path, 0o666); err != nil {
				t.Fatal(err)
			}
		}},
		{"another owner", func(t *testing.T, path string, data []byte) {
			if err := os.WriteFile(path, data, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(path, 65534, 65534); err != nil {
				t.Fatal(err)
			}
		}},
		{"a second name elsewhere", func(t *testing.T, path string, data []byte) {
			other := filepath.Join(filepath.Dir(filepath.Dir(path)), "other")
			if err := os.WriteFile(other, data, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Link(other, path); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "udev")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			s := newStore(t, Options{UdevIdentityDir: dir})
			v := mustCreate(t, s, CreateRequest{Name: "raw", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
			disk, _ := identityFiles(v)
			path := filepath.Join(dir, strconv.Itoa(seq))
			tt.plant(t, path, disk)
			s.writeIdentity(v, &loop.Device{Path: "/dev/loop-test", DiskSeq: seq})
			var st unix.Stat_t
			if err := unix.Lstat(path, &st); err != nil {
				t.Fatal(err)
			}
			if st.Uid != uint32(os.Geteuid()) || st.Mode&0o7777 != 0o644 || st.Nlink != 1 || st.Mode&unix.S_IFMT != unix.S_IFREG {
				t.Errorf("identity file kept: uid %d, mode %o, %d links; want a new one of this user, 0644, one link", st.Uid, st.Mode, st.Nlink)
			}
			if got, err := fsutil.ReadRegular(path, 1<<10); err != nil || string(got) != string(disk) {
				t.Errorf("identity %q, %v; want %q", got, err, disk)
			}
		})
	}
}

// TestUdevIdentityStaysWhileBound: a detach the kernel defers (the device
// is still open) leaves the device bound to the volume's file, its
// content the volume user's, until the last close: its identity stays,
// so that an event of the device meanwhile (any `udevadm trigger`) finds
// it and does not probe that content. A detach that leaves the device
// bound for good (busy) keeps it too.
func TestUdevIdentityStaysWhileBound(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "udev")
	s := newStore(t, Options{UdevIdentityDir: dir})
	for _, tc := range []struct {
		name  string
		flags int
		err   error
	}{
		{"deferred", unix.O_RDONLY, loop.ErrDeferred},
		{"busy", unix.O_RDONLY | unix.O_EXCL, ErrBusy},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := mustCreate(t, s, CreateRequest{Name: "held-" + tc.name, SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
			t.Cleanup(func() { s.Delete(context.Background(), v.UUID, DetachOptions{}) })
			st, err := s.Attach(context.Background(), v.UUID)
			if err != nil {
				t.Fatal(err)
			}
			dev, err := loop.Get(st.Device)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(dir, strconv.FormatUint(dev.DiskSeq, 10))
			fd, err := unix.Open(st.Device, tc.flags|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			err = s.Detach(v.UUID, DetachOptions{})
			_, serr := os.Lstat(path)
			unix.Close(fd)
			if !errors.Is(err, tc.err) {
				t.Fatalf("Detach while %s = %v, want %v", tc.name, err, tc.err)
			}
			if serr != nil {
				t.Errorf("a detach that left %s bound removed its identity: %v", st.Device, serr)
			}
		})
	}
}

// TestUdevIdentityDirTrusted: identity files are written only into a
// directory no one else can write: where someone else could, udev's rule
// would import whatever they put beside or over them, so nothing is
// written (udev probes instead, which a raw volume's attach catches) and
// the log says what to fix. A missing directory is made.
func TestUdevIdentityDirTrusted(t *testing.T) {
	const seq = 1 << 62
	tests := []struct {
		name    string
		prepare func(t *testing.T, dir string)
		ok      bool
	}{
		{"missing", func(t *testing.T, dir string) {}, true},
		{"own, 0755", func(t *testing.T, dir string) { mustMkdir(t, dir, 0o755) }, true},
		{"writable by all", func(t *testing.T, dir string) { mustMkdir(t, dir, 0o777) }, false},
		{"writable by its group", func(t *testing.T, dir string) { mustMkdir(t, dir, 0o775) }, false},
		{"another owner", func(t *testing.T, dir string) {
			mustMkdir(t, dir, 0o755)
			if err := os.Chown(dir, 65534, 65534); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"a symbolic link", func(t *testing.T, dir string) {
			target := dir + ".target"
			mustMkdir(t, target, 0o755)
			if err := os.Symlink(target, dir); err != nil {
				t.Fatal(err)
			}
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "udev")
			tt.prepare(t, dir)
			s := newStore(t, Options{UdevIdentityDir: dir})
			v := mustCreate(t, s, CreateRequest{Name: "raw", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
			s.writeIdentity(v, &loop.Device{Path: "/dev/loop-test", DiskSeq: seq})
			_, err := os.Stat(filepath.Join(dir, strconv.Itoa(seq)))
			if tt.ok && err != nil {
				t.Errorf("no identity written: %v", err)
			}
			if !tt.ok && err == nil {
				t.Errorf("an identity written into a directory someone else can write")
			}
		})
	}
}

func mustMkdir(t *testing.T, dir string, mode os.FileMode) {
	t.Helper()
	if err := os.Mkdir(dir, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, mode); err != nil { // past the umask
		t.Fatal(err)
	}
}

// A filesystem volume made with a label is probed (its /dev/disk/by-label
// link), however its record spells the option: mkfs gets "-L data" as two
// tokens (mkfsTokens), and so does the check.
func TestIdentityFilesLabelled(t *testing.T) {
	for _, opts := range [][]string{{"-L", "data"}, {"-L data"}, {"-E lazy_itable_init=1 -L data"}} {
		v := &Volume{UUID: "0f0e0d0c-0b0a-4908-8706-050403020100", Mode: ModeFilesystem, FSType: "ext4", State: StateReady, MkfsOptions: opts}
		if disk, part := identityFiles(v); disk != nil || part != nil {
			t.Errorf("identity of a volume made with %q: %q; want none (udev probes the label)", opts, disk)
		}
	}
}
