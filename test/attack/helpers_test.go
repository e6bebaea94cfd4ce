package attack

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// replaceWithSymlink swaps a volume's backing file for a symlink to target.
func replaceWithSymlink(t *testing.T, file, target string) {
	t.Helper()
	// The file is kept, out of the store: removed, its inode (which the
	// record names) would be free for a file of a test running beside
	// this one, and a loop device bound to that file would show up as
	// a foreign device of the volume.
	if err := os.Rename(file, filepath.Join(t.TempDir(), "replaced")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, file); err != nil {
		t.Fatal(err)
	}
}

// rewriteRecord sets fields of the JSON record at path, as a hand or a
// release other than this one might.
func rewriteRecord(t *testing.T, path string, fields map[string]any) {
	t.Helper()
	testutil.EditJSON(t, path, func(rec map[string]any) { maps.Copy(rec, fields) })
}

// foreignBinding is a loop device someone else made on a volume's file.
type foreignBinding struct {
	name      string
	offset    uint64
	sizelimit uint64
	readOnly  bool
	ourTag    bool // lo_file_name forged as sparsevol:<uuid>
}

var foreignBindings = []foreignBinding{
	{name: "ro offset 1M sizelimit 8M", offset: 1 << 20, sizelimit: 8 << 20, readOnly: true},
	{name: "rw offset 32M", offset: 32 << 20},
	{name: "rw untagged", offset: 0},
	{name: "ro with our tag", readOnly: true, ourTag: true},
	{name: "rw offset 1M with our tag", offset: 1 << 20, ourTag: true},
	{name: "rw sizelimit 8M with our tag", sizelimit: 8 << 20, ourTag: true},
}

func (c *kase) bindForeign(file, uuid string, fb foreignBinding) string {
	c.t.Helper()
	tag := ""
	if fb.ourTag {
		tag = "sparsevol:" + uuid
	}
	return c.foreignLoop(file, fb.offset, fb.sizelimit, fb.readOnly, tag)
}

// mountTmpfs mounts a tmpfs of size bytes (mode 0700) at a directory of
// the case: a store filesystem that fills up. Cleanup unmounts it.
func (c *kase) mountTmpfs(name string, size int64) string {
	c.t.Helper()
	dir := c.mkdir(name)
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d,mode=0700", size)); err != nil {
		c.t.Fatalf("mount tmpfs at %s: %v", dir, err)
	}
	return dir
}

// deviceDigest hashes what a block device holds.
func deviceDigest(t *testing.T, dev string) string {
	t.Helper()
	f, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// mountForeignTmpfs mounts a tmpfs (with a file in it) at dir: something
// that is not any volume's.
func (c *kase) mountForeignTmpfs(dir string) {
	c.t.Helper()
	if err := os.MkdirAll(dir, 0o750); err != nil {
		c.t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		c.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "foreign"), []byte("not a volume's"), 0o600); err != nil {
		c.t.Fatal(err)
	}
	c.watch(dir)
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// childNamed returns the pid of a child of parent with that command name.
func childNamed(parent int, name string) int {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		s := string(b)
		open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || end < 0 || s[open+1:end] != name {
			continue
		}
		f := strings.Fields(s[end+1:])
		if len(f) > 1 && f[1] == strconv.Itoa(parent) {
			pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
			return pid
		}
	}
	return 0
}

// running reports whether pid exists and is not a zombie.
func running(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(f) > 0 && f[0] != "Z" && f[0] != "X"
}

// expandNegative asks ControllerExpandVolume (or NodeExpandVolume, if
// node) for negative sizes of a staged volume: InvalidArgument, and
// nothing changes.
func expandNegative(t *testing.T, node bool) {
	for _, tc := range []struct {
		name     string
		required int64
		limit    int64
	}{
		{"required -1Mi", -1 << 20, 0},
		{"limit -1Mi", 32 << 20, -1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			id := p.createVolume("pvc-expand", 16<<20, nil)
			staging := p.mustStage(id)
			before := c.snapshot()
			rng := &csi.CapacityRange{RequiredBytes: tc.required, LimitBytes: tc.limit}
			var err error
			if node {
				_, err = p.node.NodeExpandVolume(ctx(t), &csi.NodeExpandVolumeRequest{
					VolumeId: id, VolumePath: staging, StagingTargetPath: staging, CapacityRange: rng, VolumeCapability: mountCap("ext4"),
				})
			} else {
				_, err = p.ctrl.ControllerExpandVolume(ctx(t), &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: rng})
			}
			c.expectGRPC(err, codes.InvalidArgument)
			c.unchanged(before)
		})
	}
}

// advisesDetach reports whether doctor's output tells to detach dev.
func advisesDetach(out, dev string) bool {
	return regexp.MustCompile(`losetup -d ` + regexp.QuoteMeta(dev) + `(\s|$)`).MatchString(out)
}
