package volume

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// newStore opens a store in a fresh directory and, at cleanup, fails the
// test if any loop device of its volumes is left behind.
func newStore(t *testing.T, opts Options) *Store {
	t.Helper()
	testutil.RequireRoot(t)
	root := t.TempDir()
	s, err := Open(root, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Any device whose backing file lies in the store is a leak, also
		// one bound to a file deleted since ("... (deleted)" in sysfs).
		files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
		for _, f := range files {
			if b, err := os.ReadFile(f); err == nil && strings.HasPrefix(string(b), root+"/") {
				dev := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(f)))
				exec.Command("losetup", "-d", dev).Run()
				t.Errorf("leaked loop device %s: %s", dev, b)
			}
		}
	})
	return s
}

func mustCreate(t *testing.T, s *Store, req CreateRequest) *Volume {
	t.Helper()
	v, err := s.Create(context.Background(), req)
	if err != nil {
		t.Fatalf("Create(%+v): %v", req, err)
	}
	return v
}

func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v: %s", name, args, err, out)
	}
	return string(out)
}

// mountTemp mounts device and unmounts it at cleanup.
func mountTemp(t *testing.T, device, fstype string) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount(device, dir, fstype, 0, ""); err != nil {
		t.Fatalf("mount %s: %v", device, err)
	}
	t.Cleanup(func() { unix.Unmount(dir, 0) })
	return dir
}

func TestLifecycle(t *testing.T) {
	tests := []struct {
		name string
		req  CreateRequest
	}{
		{"ext4", CreateRequest{SizeBytes: 64 << 20}},
		{"xfs", CreateRequest{SizeBytes: 320 << 20, FSType: "xfs"}},
		{"raw-whole", CreateRequest{SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true}},
		{"raw-gpt", CreateRequest{SizeBytes: 16 << 20, Mode: ModeBlock}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			req := tt.req
			req.Name = "vol-" + tt.name
			v := mustCreate(t, s, req)
			if v.State != StateReady {
				t.Fatalf("state %s after create", v.State)
			}
			// A fresh volume is sparse: far less allocated than its size.
			if a := allocated(t, v.BackingFile); a >= v.SizeBytes/2 {
				t.Fatalf("allocated %d of %d bytes: not sparse", a, v.SizeBytes)
			}
			// Identity on disk is the volume UUID.
			switch {
			case v.Mode == ModeFilesystem:
				got := strings.TrimSpace(run(t, "blkid", "-p", "-s", "UUID", "-o", "value", v.BackingFile))
				if got != v.UUID {
					t.Fatalf("filesystem UUID %s, want %s", got, v.UUID)
				}
			case v.Partitioned:
				if got := run(t, "sfdisk", "--json", v.BackingFile); !strings.Contains(strings.ToLower(got), v.UUID) {
					t.Fatalf("partition GUID %s not in table: %s", v.UUID, got)
				}
			}
			st, err := s.Attach(ctx, v.Name)
			if err != nil {
				t.Fatal(err)
			}
			again, err := s.Attach(ctx, v.UUID)
			if err != nil || again.Device != st.Device {
				t.Fatalf("second attach = %+v, %v; want the same device %s", again, err, st.Device)
			}
			if link, err := os.Readlink(filepath.Join(LinkDir, v.UUID)); v.Partitioned {
				// The host kernel may show no partitions; then no link.
				_ = link
			} else if err != nil || link != st.Device {
				t.Fatalf("link %s -> %q, %v; want %s", v.UUID, link, err, st.Device)
			}

			payload := make([]byte, 1<<20)
			rand.Read(payload)
			writeData(t, v, st, payload)
			if err := s.Detach(v.Name, DetachOptions{}); err != nil {
				t.Fatal(err)
			}
			if err := s.Detach(v.Name, DetachOptions{}); err != nil {
				t.Fatalf("second detach: %v", err)
			}
			if st, _ := s.Status(v.Name); st.Attached {
				t.Fatalf("still attached after detach: %+v", st)
			}
			if _, err := os.Lstat(filepath.Join(LinkDir, v.UUID)); err == nil {
				t.Fatal("link left after detach")
			}

			// Expand offline, then check the data survived and the size grew.
			grown, err := s.Expand(ctx, v.Name, v.SizeBytes+64<<20, ExpandOptions{})
			if err != nil {
				t.Fatal(err)
			}
			st, err = s.Attach(ctx, v.Name)
			if err != nil {
				t.Fatal(err)
			}
			if size, _ := loop.Size(st.Device); int64(size) != grown.SizeBytes {
				t.Fatalf("device size %d after expand, want %d", size, grown.SizeBytes)
			}
			if got := readData(t, v, st, len(payload)); !bytes.Equal(got, payload) {
				t.Fatal("data changed across detach, expand and attach")
			}
			if v.Mode == ModeFilesystem {
				dir := mountTemp(t, st.DataDevice, v.FSType)
				var sfs unix.Statfs_t
				unix.Statfs(dir, &sfs)
				if total := int64(sfs.Blocks) * sfs.Bsize; total < v.SizeBytes {
					t.Fatalf("filesystem is %d bytes after expand to %d", total, grown.SizeBytes)
				}
				if err := s.Delete(ctx, v.Name, DetachOptions{}); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), dir) {
					t.Fatalf("Delete of a mounted volume = %v, want ErrBusy naming %s", err, dir)
				}
				if err := s.Detach(v.Name, DetachOptions{}); !errors.Is(err, ErrBusy) {
					t.Fatalf("Detach of a mounted volume = %v, want ErrBusy", err)
				}
				unix.Unmount(dir, 0)
			}
			if err := s.Delete(ctx, v.Name, DetachOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(v.BackingFile); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("backing file left after delete: %v", err)
			}
			if _, err := s.Get(v.UUID); !errors.Is(err, ErrNotFound) {
				t.Fatalf("Get after delete = %v", err)
			}
		})
	}
}

// writeData writes payload at the start of the volume's data: into a file
// for filesystems, straight onto the device for raw volumes.
func writeData(t *testing.T, v *Volume, st *Status, payload []byte) {
	t.Helper()
	if v.Mode == ModeFilesystem {
		dir := mountTemp(t, st.DataDevice, v.FSType)
		if err := os.WriteFile(filepath.Join(dir, "data"), payload, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := unix.Unmount(dir, 0); err != nil {
			t.Fatal(err)
		}
		return
	}
	dev := st.Device
	off := int64(0)
	if v.Partitioned {
		off = 2048 * 512 // first partition's start; the host may not show loopNp1
	}
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(payload, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

func readData(t *testing.T, v *Volume, st *Status, n int) []byte {
	t.Helper()
	if v.Mode == ModeFilesystem {
		dir := mountTemp(t, st.DataDevice, v.FSType)
		b, err := os.ReadFile(filepath.Join(dir, "data"))
		if err != nil {
			t.Fatal(err)
		}
		unix.Unmount(dir, 0)
		return b
	}
	off := int64(0)
	if v.Partitioned {
		off = 2048 * 512
	}
	f, err := os.Open(st.Device)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestCreateRejectsDuplicatesAndOvercommit(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	v := mustCreate(t, s, CreateRequest{Name: "a", SizeBytes: 8 << 20})
	tests := []struct {
		name string
		req  CreateRequest
		want error
	}{
		{"same name", CreateRequest{Name: "a", SizeBytes: 8 << 20}, ErrExists},
		{"same uuid", CreateRequest{Name: "b", SizeBytes: 8 << 20, UUID: v.UUID}, ErrExists},
		{"beyond free space", CreateRequest{Name: "c", SizeBytes: 1 << 50}, ErrNoSpace},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := listing(t, s.Root())
			if _, err := s.Create(ctx, tt.req); !errors.Is(err, tt.want) {
				t.Fatalf("Create = %v, want %v", err, tt.want)
			}
			if after := listing(t, s.Root()); after != before {
				t.Fatalf("store changed by a rejected create:\n%s\nvs\n%s", before, after)
			}
		})
	}
	if err := s.Delete(ctx, "a", DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestOvercommitRatio(t *testing.T) {
	probe := newStore(t, Options{})
	sp, err := probe.Space()
	if err != nil {
		t.Fatal(err)
	}
	// A volume 1.5 times the free space: refused at ratio 1, allowed at 2.
	size := RoundUpMiB(sp.FreeBytes * 3 / 2)
	ctx := context.Background()
	if _, err := probe.Create(ctx, CreateRequest{Name: "big", SizeBytes: size, Mode: ModeBlock, NoPartition: true}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("ratio 1: Create = %v, want ErrNoSpace", err)
	}
	s := newStore(t, Options{OvercommitRatio: 2})
	mustCreate(t, s, CreateRequest{Name: "big", SizeBytes: size, Mode: ModeBlock, NoPartition: true})
	if err := s.Delete(ctx, "big", DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestPreallocate(t *testing.T) {
	s := newStore(t, Options{})
	v := mustCreate(t, s, CreateRequest{Name: "thick", SizeBytes: 32 << 20, Preallocate: true})
	if a := allocated(t, v.BackingFile); a < v.SizeBytes {
		t.Fatalf("thick volume has %d of %d bytes allocated", a, v.SizeBytes)
	}
	if err := s.Delete(context.Background(), "thick", DetachOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestExpandRejectsShrink(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	mustCreate(t, s, CreateRequest{Name: "a", SizeBytes: 32 << 20})
	for _, size := range []int64{16 << 20, 31 << 20} {
		if _, err := s.Expand(ctx, "a", size, ExpandOptions{}); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Expand to %d = %v, want ErrInvalid", size, err)
		}
	}
	if _, err := s.Expand(ctx, "a", 1<<50, ExpandOptions{}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Expand beyond space = %v, want ErrNoSpace", err)
	}
	if v, _ := s.Get("a"); v.SizeBytes != 32<<20 || v.ExpandingTo != 0 {
		t.Fatalf("rejected expand changed the volume: %+v", v)
	}
	s.Delete(ctx, "a", DetachOptions{})
}

func TestAttachAll(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	for _, name := range []string{"a", "b", "c"} {
		mustCreate(t, s, CreateRequest{Name: name, SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
	}
	if _, err := s.Attach(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	sts, err := s.AttachAll(ctx)
	if err != nil || len(sts) != 3 {
		t.Fatalf("AttachAll = %d, %v", len(sts), err)
	}
	devs := map[string]bool{}
	for _, st := range sts {
		devs[st.Device] = true
	}
	if len(devs) != 3 {
		t.Fatalf("devices %v: want 3 distinct", devs)
	}
	if _, err := s.AttachAll(ctx); err != nil {
		t.Fatal(err)
	}
	all, _ := s.Statuses()
	for _, st := range all {
		if len(st.ExtraDevices) > 0 {
			t.Fatalf("volume %s attached twice: %v", st.Name, st.ExtraDevices)
		}
	}
	if err := s.DetachAll(DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"a", "b", "c"} {
		s.Delete(ctx, name, DetachOptions{})
	}
}

func TestAdopt(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	old := t.TempDir()
	fsUUID, ptUUID := NewUUID(), NewUUID()
	fsFile := filepath.Join(old, fsUUID)
	ptFile := filepath.Join(old, ptUUID)
	for _, f := range []string{fsFile, ptFile} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		os.Truncate(f, 32<<20)
	}
	run(t, "mkfs.ext4", "-q", "-U", fsUUID, fsFile)
	run(t, "sgdisk", "--largest-new=1", "--partition-guid=1:"+ptUUID, "--change-name=1:bar", ptFile)
	junk := filepath.Join(old, "junk")
	os.WriteFile(junk, bytes.Repeat([]byte{1}, 2<<20), 0o600)
	outside := filepath.Join(t.TempDir(), "outside")
	os.WriteFile(outside, nil, 0o600)
	os.Truncate(outside, 32<<20)
	run(t, "mkfs.ext4", "-q", outside)

	bad := []struct {
		name  string
		paths []string
		dir   string
	}{
		{"not a volume", []string{fsFile, junk}, ""},
		{"outside dir", []string{outside}, old},
		{"missing file", []string{filepath.Join(old, "nope")}, ""},
		{"directory", []string{old}, ""},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			before := listing(t, s.Root())
			if _, err := s.Adopt(ctx, tt.paths, tt.dir); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Adopt = %v, want ErrInvalid", err)
			}
			if after := listing(t, s.Root()); after != before {
				t.Fatal("rejected adopt changed the store")
			}
		})
	}
	os.Remove(junk)
	sumBefore := run(t, "sha256sum", fsFile, ptFile)
	vols, err := s.Adopt(ctx, nil, old)
	if err != nil || len(vols) != 2 {
		t.Fatalf("Adopt(dir) = %v, %v", vols, err)
	}
	byUUID := map[string]*Volume{}
	for _, v := range vols {
		byUUID[v.UUID] = v
	}
	// Moved into the store by rename: the same files, nothing rewritten.
	if v := byUUID[fsUUID]; v == nil || v.FSType != "ext4" || v.BackingFile != filepath.Join(s.Root(), fsUUID) {
		t.Fatalf("filesystem file adopted as %+v", v)
	}
	if v := byUUID[ptUUID]; v == nil || !v.Partitioned || v.Mode != ModeBlock {
		t.Fatalf("GPT file adopted as %+v", v)
	}
	for _, f := range []string{fsFile, ptFile} {
		if _, err := os.Lstat(f); !os.IsNotExist(err) {
			t.Fatalf("%s still there after adopt: %v", f, err)
		}
	}
	fsFile, ptFile = filepath.Join(s.Root(), fsUUID), filepath.Join(s.Root(), ptUUID)
	if sumAfter := strings.ReplaceAll(run(t, "sha256sum", fsFile, ptFile), s.Root(), old); sumAfter != sumBefore {
		t.Fatalf("adopt rewrote data:\n%s\n%s", sumAfter, sumBefore)
	}
	// Idempotent.
	if again, err := s.Adopt(ctx, []string{fsFile}, ""); err != nil || len(again) != 1 || again[0].UUID != fsUUID {
		t.Fatalf("second Adopt = %v, %v", again, err)
	}
	st, err := s.Attach(ctx, fsUUID)
	if err != nil {
		t.Fatal(err)
	}
	// The adopted filesystem mounts as it is.
	dir := mountTemp(t, st.DataDevice, "ext4")
	if err := unix.Unmount(dir, 0); err != nil {
		t.Fatal(err)
	}
	for _, u := range []string{fsUUID, ptUUID} {
		if err := s.Delete(ctx, u, DetachOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// listing renders a directory tree (names, sizes, modes) to compare
// before and after an operation that must change nothing.
func listing(t *testing.T, root string) string {
	t.Helper()
	var b strings.Builder
	filepath.Walk(root, func(path string, fi os.FileInfo, err error) error {
		if err != nil || strings.Contains(path, "/"+lockDir) {
			return nil
		}
		data := ""
		if strings.HasSuffix(path, metaExt) {
			d, _ := os.ReadFile(path)
			data = string(d)
		}
		fmt.Fprintf(&b, "%s %s %d %s\n", path, fi.Mode(), fi.Size(), data)
		return nil
	})
	return b.String()
}

// TestRefusalShowsReferenceBounded: a refusal of a reference or name a
// caller gave shows it only through Quote: no control character reaches
// the message, and a long one is cut.
func TestRefusalShowsReferenceBounded(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	for _, ref := range []string{"no\x1b[2K\nsparsevol: pe", strings.Repeat("n", 5000)} {
		for _, tt := range []struct {
			name string
			call func() error
		}{
			{"get", func() error { _, err := s.Get(ref); return err }},
			{"create", func() error {
				_, err := s.Create(ctx, CreateRequest{Name: ref, SizeBytes: MiB, Mode: ModeBlock, NoPartition: true})
				return err
			}},
			{"import", func() error { _, err := s.Import(ctx, strings.NewReader(""), ImportRequest{Name: ref}); return err }},
			{"export", func() error { _, err := s.Export(ctx, ref, io.Discard, StreamOptions{}); return err }},
			{"expand", func() error { _, err := s.Expand(ctx, ref, 0, ExpandOptions{}); return err }},
			{"snapshot", func() error { _, err := s.CreateSnapshot(ctx, ref, "snap", SnapshotOptions{}); return err }},
			{"snapshot with a bad name", func() error { _, err := s.CreateSnapshot(ctx, ref, "a b", SnapshotOptions{}); return err }},
			{"snapshot delete", func() error { return s.DeleteSnapshot(ctx, ref) }},
			{"change", func() error { _, err := s.Change(ref, Change{Labels: map[string]string{"k": "v"}}); return err }},
		} {
			t.Run(fmt.Sprintf("%s/%.8q", tt.name, ref), func(t *testing.T) {
				err := tt.call()
				if err == nil {
					t.Fatal("accepted")
				}
				if msg := err.Error(); strings.ContainsAny(msg, "\n\x1b") || len(msg) > 512 {
					t.Errorf("error of %d bytes shows the reference raw or whole: %.300q", len(msg), msg)
				}
			})
		}
	}
}

// TestCheck: Check answers for a store of any size without reading the
// store directory or a record (a liveness probe calls it), and fails
// for a store that cannot serve: mounted read-only, or replaced since
// Open.
func TestCheck(t *testing.T) {
	tests := []struct {
		name   string
		meddle func(t *testing.T, s *Store)
		want   error // nil: Check passes
	}{
		{"serving", func(*testing.T, *Store) {}, nil},
		{"read-only", func(t *testing.T, s *Store) {
			mustDo(t, unix.Mount("", s.Root(), "", unix.MS_REMOUNT|unix.MS_RDONLY, ""))
		}, unix.EROFS},
		{"replaced", func(t *testing.T, s *Store) {
			mustDo(t, unix.Unmount(s.Root(), unix.MNT_DETACH))
		}, ErrUnsafe},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := tmpfsStore(t, "16m", Options{})
			for _, name := range []string{"a", "b", "c"} {
				mustCreate(t, s, CreateRequest{Name: name, SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
			}
			tt.meddle(t, s)
			before := countScans()
			err := s.Check()
			if !errors.Is(err, tt.want) || (tt.want == nil) != (err == nil) {
				t.Errorf("Check: %v, want %v", err, tt.want)
			}
			if countScans().dir != before.dir {
				t.Errorf("Check read the store directory")
			}
		})
	}
}
