package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// fsRoot makes a store on a loop-mounted filesystem of fsType made for
// the test (xfs with reflink, or ext4) and checks for leaked devices at
// cleanup.
func fsRoot(t *testing.T, fsType string) string {
	t.Helper()
	root := testutil.FilesystemDir(t, fsType, 3<<30)
	t.Cleanup(func() { checkNoLeaks(t, root) })
	return root
}

// sparsevolIn runs the CLI against store root with stdin from in (nil:
// /dev/null) and extra environment.
func sparsevolIn(t *testing.T, root string, in []byte, env []string, args ...string) result {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"--root", root}, args...)...)
	cmd.Env = append(os.Environ(), append([]string{asCLI + "=1"}, env...)...)
	if in != nil {
		cmd.Stdin = bytes.NewReader(in)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	r := result{stdout: stdout.String(), stderr: stderr.String()}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			r.signaled = true
		}
	} else if err != nil {
		t.Fatalf("run sparsevol %v: %v", args, err)
	}
	return r
}

func snapshots(t *testing.T, root string) []volume.Snapshot {
	t.Helper()
	var sns []volume.Snapshot
	if err := json.Unmarshal([]byte(mustRun(t, root, "snapshot", "list", "-o", "json")), &sns); err != nil {
		t.Fatal(err)
	}
	return sns
}

func blkidUUID(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("blkid", "-p", "-s", "UUID", "-o", "value", path).Output()
	if err != nil {
		t.Fatalf("blkid %s: %v", path, err)
	}
	return strings.TrimSpace(string(out))
}

// TestSnapshotCLI drives the snapshot commands on a reflink (XFS) and a
// copy (ext4) store: snapshot, list, restore, clone, export and import;
// every copy has its own identity (blkid); hostile streams are refused
// with exit 2 and change nothing.
func TestSnapshotCLI(t *testing.T) {
	for _, tc := range []struct {
		fs     string
		method volume.CopyMethod
	}{{"xfs", volume.CopyReflink}, {"ext4", volume.CopySparse}} {
		t.Run(tc.fs+"-store", func(t *testing.T) {
			root := fsRoot(t, tc.fs)
			uuid := strings.TrimSpace(mustRun(t, root, "create", "v", "--size", "64M"))
			mustRun(t, root, "snapshot", "create", "v", "s")
			mustRun(t, root, "snapshot", "create", "v", "s") // idempotent
			sns := snapshots(t, root)
			if len(sns) != 1 || sns[0].Name != "s" || sns[0].SourceUUID != uuid || sns[0].Method != tc.method || !sns[0].ReadyToUse {
				t.Fatalf("snapshot list: %+v", sns)
			}
			runSteps(t, root, []cliStep{
				{args: []string{"snapshot", "list"}, stdout: []string{"NAME", "s", "v", "64Mi", "quiet", "ready"}},
				{args: []string{"snapshot", "create", "nope", "t"}, code: 2, stderr: []string{"not found"}},
				{args: []string{"snapshot", "create", "v", "../t"}, code: 2},
				{args: []string{"create", "r", "--from-snapshot", "s", "--size", "32M"}, code: 2, stderr: []string{"below the source"}},
				{args: []string{"create", "r", "--from-snapshot", "s", "--fs", "xfs"}, code: 2},
				{args: []string{"create", "r", "--from-snapshot", "s"}},
				{args: []string{"create", "c", "--clone-of", "v", "--size", "128M"}},
				{args: []string{"snapshot", "delete", "nope"}, code: 2},
			})
			seen := map[string]bool{}
			for _, st := range statuses(t, root) {
				if got := blkidUUID(t, st.BackingFile); got != st.UUID || seen[got] {
					t.Fatalf("volume %s: filesystem UUID %s, want its own %s", st.Name, got, st.UUID)
				}
				seen[st.UUID] = true
			}

			// export | import, of a snapshot and of a volume not in use.
			mustRun(t, root, "detach", "v")
			for _, ref := range []string{"s", "v"} {
				r := sparsevol(t, root, nil, "export", ref)
				if r.code != 0 {
					t.Fatalf("export %s: exit %d: %s", ref, r.code, r.stderr)
				}
				stream := []byte(r.stdout)
				name := "imported-" + ref
				r = sparsevolIn(t, root, stream, nil, "import", name)
				if r.code != 0 {
					t.Fatalf("import %s: exit %d: %s", name, r.code, r.stderr)
				}
				if got := blkidUUID(t, filepath.Join(root, strings.TrimSpace(r.stdout))); got != strings.TrimSpace(r.stdout) {
					t.Fatalf("imported volume's filesystem UUID %s, want %s", got, r.stdout)
				}
				// --keep-uuid is refused where the node has the UUID.
				if r := sparsevolIn(t, root, stream, nil, "import", name+"-kept", "--keep-uuid"); r.code != 2 || !strings.Contains(r.stderr, "taken") {
					t.Fatalf("import --keep-uuid of a UUID the node has: exit %d: %s", r.code, r.stderr)
				}
			}

			// --keep-uuid where the node does not have the UUID: another
			// store, the source detached (no link of it anywhere).
			other := newRoot(t)
			stream := []byte(sparsevol(t, root, nil, "export", "v").stdout)
			if r := sparsevolIn(t, other, stream, nil, "import", "kept", "--keep-uuid", "--no-start"); r.code != 0 || strings.TrimSpace(r.stdout) != uuid {
				t.Fatalf("import --keep-uuid into another store: exit %d, uuid %q, want %s: %s", r.code, r.stdout, uuid, r.stderr)
			}
			if got := blkidUUID(t, filepath.Join(other, uuid)); got != uuid {
				t.Fatalf("kept filesystem UUID %s, want %s", got, uuid)
			}
			mustRun(t, other, "delete", "kept")

			// export refuses a terminal as stdout, writing nothing.
			if r := exportToTerminal(t, root, "s"); r.code != 2 || !strings.Contains(r.stderr, "redirect stdout") {
				t.Fatalf("export to a terminal: exit %d: %s", r.code, r.stderr)
			}

			// Hostile streams: refused, nothing changes.
			stream = []byte(sparsevol(t, root, nil, "export", "s").stdout)
			before := snapshot(t, root)
			for name, bad := range hostileStreams(stream) {
				r := sparsevolIn(t, root, bad, nil, "import", "hostile")
				if r.code != 2 {
					t.Errorf("%s: import exit %d, want 2: %s", name, r.code, r.stderr)
				}
			}
			if after := snapshot(t, root); after != before {
				t.Errorf("refused imports changed the store:\nbefore %s\nafter  %s", before, after)
			}

			// The volume goes, its snapshot stays and still restores.
			mustRun(t, root, "delete", "v")
			mustRun(t, root, "create", "late", "--from-snapshot", "s", "--no-start")
			mustRun(t, root, "snapshot", "delete", "s")
			if sns := snapshots(t, root); len(sns) != 0 {
				t.Fatalf("snapshots left: %+v", sns)
			}
			for _, st := range statuses(t, root) {
				mustRun(t, root, "delete", st.Name)
			}
		})
	}
}

// exportToTerminal runs export with a pseudo-terminal as stdout.
func exportToTerminal(t *testing.T, root, ref string) result {
	t.Helper()
	ptmx, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ptmx.Close()
	if err := unix.IoctlSetPointerInt(int(ptmx.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(ptmx.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	pts, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer pts.Close()
	return exportTo(t, root, ref, pts)
}

// exportTo runs export with out as stdout.
func exportTo(t *testing.T, root, ref string, out *os.File) result {
	t.Helper()
	cmd := exec.Command(os.Args[0], "--root", root, "export", ref)
	cmd.Env = append(os.Environ(), asCLI+"=1")
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = out, &stderr
	err := cmd.Run()
	r := result{stderr: stderr.String()}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	}
	return r
}

// TestExportRefusesStoreFileAsStdout: export whose stdout is a file of
// the store (the exported volume's own backing file, opened without
// truncation as `1<>` or `>>` do, another volume's, a snapshot's, a
// record) exits 2 and leaves the file as it was.
func TestExportRefusesStoreFileAsStdout(t *testing.T) {
	root := newRoot(t)
	uuid := strings.TrimSpace(mustRun(t, root, "create", "v", "--size", "8M", "--mode", "block", "--no-partition", "--no-start"))
	other := strings.TrimSpace(mustRun(t, root, "create", "w", "--size", "8M", "--mode", "block", "--no-partition", "--no-start"))
	snap := strings.TrimSpace(mustRun(t, root, "snapshot", "create", "v", "s"))
	backing := filepath.Join(root, uuid)
	f, err := os.OpenFile(backing, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{7}, 1<<20), 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	tests := []struct {
		name, ref, path string
		flag            int
	}{
		{"own backing file", "v", backing, os.O_RDWR},
		{"own backing file, appended", "v", backing, os.O_WRONLY | os.O_APPEND},
		{"another volume's file", "v", filepath.Join(root, other), os.O_RDWR},
		{"a record", "v", filepath.Join(root, uuid+".json"), os.O_WRONLY | os.O_APPEND},
		{"the snapshot's own file", "s", filepath.Join(root, ".snapshots", snap), os.O_RDWR},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before, err := os.ReadFile(tt.path)
			if err != nil {
				t.Fatal(err)
			}
			out, err := os.OpenFile(tt.path, tt.flag, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			r := exportTo(t, root, tt.ref, out)
			if r.code != 2 || !strings.Contains(r.stderr, "file of the store") {
				t.Errorf("export %s into %s: exit %d, want 2 naming the store's file: %s", tt.ref, tt.path, r.code, r.stderr)
			}
			if after, err := os.ReadFile(tt.path); err != nil || !bytes.Equal(after, before) {
				t.Errorf("%s changed: %d bytes, were %d (%v)", tt.path, len(after), len(before), err)
			}
		})
	}
	// A file elsewhere on the store's filesystem is fine.
	out, err := os.Create(filepath.Join(t.TempDir(), "v.svs"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if r := exportTo(t, root, "v", out); r.code != 0 {
		t.Errorf("export into a file outside the store: exit %d: %s", r.code, r.stderr)
	}
	mustRun(t, root, "snapshot", "delete", "s")
	mustRun(t, root, "delete", "v", "w")
}

// hostileStreams derives broken streams from a good one.
func hostileStreams(good []byte) map[string][]byte {
	flip := func(i int) []byte {
		b := bytes.Clone(good)
		b[i] ^= 0x40
		return b
	}
	hdrLen := int(good[20])<<24 | int(good[21])<<16 | int(good[22])<<8 | int(good[23])
	first := 24 + hdrLen // the first record
	return map[string][]byte{
		"empty":             {},
		"truncated":         good[:len(good)/2],
		"no end":            good[:len(good)-49],
		"trailing data":     append(bytes.Clone(good), 0),
		"bad magic":         flip(0),
		"bad version":       flip(19),
		"huge header":       flip(20),
		"header altered":    bytes.Replace(good, []byte(`"mode":"filesystem"`), []byte(`"mode":"filesystex"`), 1),
		"size altered":      bytes.Replace(good, []byte(`"sizeBytes":67108864`), []byte(`"sizeBytes":67108865`), 1),
		"offset beyond":     flip(first + 1),
		"length huge":       flip(first + 9),
		"data altered":      flip(first + 13 + 100),
		"checksum altered":  flip(len(good) - 1),
		"unknown record":    flip(first),
		"header not json":   bytes.Replace(good, []byte(`{"name"`), []byte(`["name"`), 1),
		"header extra keys": bytes.Replace(good, []byte(`{"name"`), []byte(`{"x":1,"name"`), 1),
	}
}

// TestDoctorKnowsSnapshots: doctor fails on a snapshot whose metadata is
// unreadable and warns of a stray file in the snapshot directory; snapshot
// delete removes the broken one.
func TestDoctorKnowsSnapshots(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "v", "--size", "8M", "--mode", "block", "--no-start")
	uuid := strings.TrimSpace(mustRun(t, root, "snapshot", "create", "v", "s"))
	meta := filepath.Join(root, ".snapshots", uuid+".json")
	if err := os.Truncate(meta, 10); err != nil {
		t.Fatal(err)
	}
	stray := filepath.Join(root, ".snapshots", "stray")
	if err := os.WriteFile(stray, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	r := sparsevol(t, root, nil, "doctor")
	if r.code != 1 || !strings.Contains(r.stdout, "[FAIL] snapshot "+uuid) || !strings.Contains(r.stdout, meta) ||
		!strings.Contains(r.stdout, "[WARN] snapshots: "+stray) {
		t.Errorf("doctor: exit %d, want 1, a failure naming %s and a warning naming %s:\n%s%s", r.code, meta, stray, r.stdout, r.stderr)
	}
	mustRun(t, root, "snapshot", "delete", uuid)
	os.Remove(stray)
	if r := sparsevol(t, root, nil, "doctor"); strings.Contains(r.stdout, "snapshot "+uuid) {
		t.Errorf("doctor still reports the deleted snapshot:\n%s", r.stdout)
	}
	mustRun(t, root, "delete", "v")
}

// An empty store lists as a JSON array, not null, for every list command.
func TestEmptyListsAreJSONArrays(t *testing.T) {
	root := t.TempDir()
	for _, args := range [][]string{
		{"list", "-o", "json"},
		{"snapshot", "list", "-o", "json"},
	} {
		if out := strings.TrimSpace(mustRun(t, root, args...)); out != "[]" {
			t.Errorf("sparsevol %v on an empty store: %q, want []", args, out)
		}
	}
}
