package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/iolimit"
	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// The test binary doubles as the CLI: with asCLI set it runs main's logic,
// so the tests drive real processes (which can be killed mid-operation)
// without a separate build step.
const asCLI = "SPARSEVOL_TEST_AS_CLI"

func TestMain(m *testing.M) {
	if os.Getenv(asCLI) == "1" {
		os.Exit(run(os.Args))
	}
	os.Exit(m.Run())
}

type result struct {
	code           int
	signaled       bool
	stdout, stderr string
}

// sparsevol runs the CLI against store root with extra environment.
func sparsevol(t *testing.T, root string, env []string, args ...string) result {
	t.Helper()
	return sparsevolIn(t, root, nil, env, args...)
}

// concurrently runs procs CLI processes at once, the i-th with args(i),
// and returns their results in order.
func concurrently(t *testing.T, root string, procs int, args func(i int) []string) []result {
	t.Helper()
	var wg sync.WaitGroup
	results := make([]result, procs)
	for i := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = sparsevol(t, root, nil, args(i)...)
		}()
	}
	wg.Wait()
	return results
}

func mustRun(t *testing.T, root string, args ...string) string {
	t.Helper()
	r := sparsevol(t, root, nil, args...)
	if r.code != 0 {
		t.Fatalf("sparsevol %v: exit %d: %s", args, r.code, r.stderr)
	}
	return r.stdout
}

// newRoot makes a store directory and fails the test at cleanup if any
// loop device of its volumes is left.
func newRoot(t *testing.T) string {
	t.Helper()
	testutil.RequireRoot(t)
	root := t.TempDir()
	t.Cleanup(func() { checkNoLeaks(t, root) })
	return root
}

// checkNoLeaks fails the test for any loop device whose backing file lies
// in root, including files deleted since (sysfs shows them "(deleted)").
func checkNoLeaks(t *testing.T, root string) {
	t.Helper()
	for _, dev := range devicesUnder(root) {
		exec.Command("losetup", "-d", dev).Run()
		t.Errorf("leaked loop device %s with a backing file in %s", dev, root)
	}
}

// devicesUnder lists the loop devices whose backing file path is in dir.
func devicesUnder(dir string) []string {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(string(b), dir+"/") {
			out = append(out, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return out
}

// assertEmptyStore fails the test for anything in root but its lock
// directory.
func assertEmptyStore(t *testing.T, root string) {
	t.Helper()
	entries, _ := os.ReadDir(root)
	for _, e := range entries {
		if e.Name() != ".locks" {
			t.Errorf("left in store: %s", e.Name())
		}
	}
}

func statuses(t *testing.T, root string) []volume.Status {
	t.Helper()
	var sts []volume.Status
	if err := json.Unmarshal([]byte(mustRun(t, root, "list", "-o", "json")), &sts); err != nil {
		t.Fatal(err)
	}
	return sts
}

// snapshot renders everything a rejected command must leave alone: the
// store's files and metadata, and the loop devices of the machine.
func snapshot(t *testing.T, root string) string {
	t.Helper()
	var b strings.Builder
	filepath.Walk(root, func(path string, fi os.FileInfo, err error) error {
		if err != nil || strings.Contains(path, "/.locks") {
			return nil
		}
		data := ""
		if strings.HasSuffix(path, ".json") {
			d, _ := os.ReadFile(path)
			data = string(d)
		}
		fmt.Fprintf(&b, "%s %s %d %s\n", path, fi.Mode(), fi.Size(), data)
		return nil
	})
	// Only this store's devices: other tests attach and detach theirs
	// concurrently.
	for _, dev := range devicesUnder(root) {
		d, _ := loop.Get(dev)
		fmt.Fprintf(&b, "%s %+v\n", dev, d)
	}
	return b.String()
}

func TestBadInputExitsTwoAndChangesNothing(t *testing.T) {
	root := newRoot(t)
	uuid := strings.TrimSpace(mustRun(t, root, "create", "existing", "--size", "8M"))
	mustRun(t, root, "create", "small", "--size", "32M", "--no-start")
	snapUUID := strings.TrimSpace(mustRun(t, root, "snapshot", "create", "small", "snap"))
	// A volume the CSI driver made: its PV is the driver's.
	csiUUID := strings.TrimSpace(mustRun(t, root, "create", "bycsi", "--size", "8M", "--no-start"))
	testutil.EditJSON(t, filepath.Join(root, csiUUID+".json"), func(rec map[string]any) {
		rec["labels"] = map[string]any{volume.LabelManagedBy: volume.ManagedByCSI, "sparsevol.io/csi-name": "pvc-1"}
	})
	oldDir := t.TempDir()
	junk := filepath.Join(oldDir, "junk")
	os.WriteFile(junk, bytes.Repeat([]byte("x"), 2<<20), 0o600)
	outside := filepath.Join(t.TempDir(), "vol")
	os.WriteFile(outside, nil, 0o600)
	os.Truncate(outside, 16<<20)
	exec.Command("mkfs.ext4", "-q", outside).Run()
	// Values a refusal must not echo as they are: a forged line with a
	// terminal escape, and kilobytes.
	const hostile = "no\x1b[2K\nsparsevol: pe"
	long := strings.Repeat("n", 5000)
	readOnly := t.TempDir()
	if err := unix.Mount("tmpfs", readOnly, "tmpfs", unix.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(readOnly, 0) })

	tests := []struct {
		name string
		root string // default: the test store
		args []string
		env  []string
	}{
		{"empty name", "", []string{"create", "", "--size", "8M"}, nil},
		{"name too long", "", []string{"create", strings.Repeat("n", 254), "--size", "8M"}, nil},
		{"name with slash", "", []string{"create", "a/b", "--size", "8M"}, nil},
		{"name with dotdot", "", []string{"create", "..", "--size", "8M"}, nil},
		{"name with space", "", []string{"create", "a b", "--size", "8M"}, nil},
		{"existing name", "", []string{"create", "existing", "--size", "8M"}, nil},
		{"existing uuid", "", []string{"create", "other", "--size", "8M", "--uuid", uuid}, nil},
		{"malformed uuid", "", []string{"create", "other", "--size", "8M", "--uuid", "not-a-uuid"}, nil},
		{"malformed uuid, control characters", "", []string{"create", "other", "--size", "8M", "--uuid", hostile}, nil},
		{"malformed uuid, long", "", []string{"create", "other", "--size", "8M", "--uuid", long}, nil},
		{"a snapshot's uuid", "", []string{"create", "other", "--size", "8M", "--uuid", snapUUID}, nil},
		{"a snapshot's uuid in upper case", "", []string{"create", "other", "--size", "8M", "--uuid", strings.ToUpper(snapUUID)}, nil},
		{"size zero", "", []string{"create", "other", "--size", "0"}, nil},
		{"size negative", "", []string{"create", "other", "--size", "-1G"}, nil},
		{"size not numeric", "", []string{"create", "other", "--size", "big"}, nil},
		{"size missing", "", []string{"create", "other"}, nil},
		{"ext4 below minimum", "", []string{"create", "other", "--size", "1M"}, nil},
		{"xfs below minimum", "", []string{"create", "other", "--size", "100M", "--fs", "xfs"}, nil},
		{"beyond overcommit", "", []string{"create", "other", "--size", "1P"}, nil},
		{"unknown fs", "", []string{"create", "other", "--size", "8M", "--fs", "btrfs"}, nil},
		{"unknown mode", "", []string{"create", "other", "--size", "8M", "--mode", "file"}, nil},
		{"fs with block mode", "", []string{"create", "other", "--size", "8M", "--mode", "block", "--fs", "ext4"}, nil},
		{"no-partition without block", "", []string{"create", "other", "--size", "8M", "--no-partition"}, nil},
		{"unknown flag", "", []string{"create", "other", "--size", "8M", "--colour"}, nil},
		{"shrink", "", []string{"expand", "small", "--size", "16M"}, nil},
		{"expand beyond overcommit", "", []string{"expand", "small", "--size", "1P"}, nil},
		{"attach missing volume", "", []string{"attach", "nope"}, nil},
		{"attach some missing", "", []string{"attach", "small", "nope"}, nil},
		{"detach missing volume", "", []string{"detach", "nope"}, nil},
		{"delete missing volume", "", []string{"delete", "small", "nope"}, nil},
		{"delete one volume twice", "", []string{"delete", "small", "small"}, nil},
		{"delete one volume by name and uuid", "", []string{"delete", "existing", uuid}, nil},
		{"detach one volume twice", "", []string{"detach", "existing", "existing"}, nil},
		{"delete snapshots some missing", "", []string{"snapshot", "delete", "snap", "nope"}, nil},
		{"delete one snapshot twice", "", []string{"snapshot", "delete", "snap", snapUUID}, nil},
		{"delete missing volume with control characters", "", []string{"delete", "small", "no\x1b[2K\nsparsevol: pe"}, nil},
		{"expand missing volume", "", []string{"expand", "nope", "--size", "1G"}, nil},
		{"status missing volume, long reference", "", []string{"status", long}, nil},
		{"export missing, control characters", "", []string{"export", hostile}, nil},
		{"export missing, long reference", "", []string{"export", long}, nil},
		{"snapshot of missing volume, control characters", "", []string{"snapshot", "create", hostile, "snap2"}, nil},
		{"snapshot of missing volume, long reference", "", []string{"snapshot", "create", long, "snap2"}, nil},
		{"status missing volume", "", []string{"status", "nope"}, nil},
		{"pv missing volume", "", []string{"pv", "nope"}, nil},
		{"pv of a CSI volume", "", []string{"pv", "bycsi", "--node", "node-1"}, nil},
		{"pv of a CSI volume, another name", "", []string{"pv", "bycsi", "--node", "node-1", "--name", "static"}, nil},
		{"attach without volume", "", []string{"attach"}, nil},
		{"attach volume and all", "", []string{"attach", "small", "--all"}, nil},
		{"bad output format", "", []string{"list", "-o", "yaml"}, nil},
		{"missing store", "/nonexistent/store", []string{"list"}, nil},
		{"unwritable store", readOnly, []string{"create", "other", "--size", "8M"}, nil},
		{"adopt non-volume", "", []string{"adopt", junk}, nil},
		{"adopt outside dir", "", []string{"adopt", "--dir", oldDir, outside}, nil},
		{"adopt nothing", "", []string{"adopt"}, nil},
		{"adopt path too long", "", []string{"adopt", "/" + long}, nil},
		{"adopt path with control characters", "", []string{"adopt", filepath.Join(oldDir, hostile)}, nil},
		{"adopt dir with control characters", "", []string{"adopt", "--dir", filepath.Join(oldDir, hostile), junk}, nil},
		{"adopt name too long", "", []string{"adopt", filepath.Join(oldDir, strings.Repeat("n", 300))}, nil},
		{"adopt dir too long", "", []string{"adopt", "--dir", "/" + long, junk}, nil},
		{"root too long", "/" + long, []string{"list"}, nil},
		{"name is another volume's uuid", "", []string{"create", uuid, "--size", "8M"}, nil},
		{"name is an upper-case uuid", "", []string{"create", strings.ToUpper(uuid), "--size", "8M"}, nil},
		{"name with right-to-left override", "", []string{"create", "a\u202eb", "--size", "8M"}, nil},
		{"name with no-break space", "", []string{"create", "a\u00a0b", "--size", "8M"}, nil},
		{"name not ascii", "", []string{"create", strings.Repeat("é", 100), "--size", "8M"}, nil},
		{"name starting with dash", "", []string{"create", "--size", "8M", "--", "-x"}, nil},
		{"nil uuid", "", []string{"create", "niluuid", "--size", "8M", "--uuid", "00000000-0000-0000-0000-000000000000"}, nil},
		{"size with i and no unit", "", []string{"create", "size1", "--size", "10iB", "--mode", "block", "--no-partition"}, nil},
		{"size with underscores", "", []string{"create", "size2", "--size", "1_000_000_000", "--mode", "block", "--no-partition"}, nil},
		{"size with exponent", "", []string{"create", "size3", "--size", "1e7", "--mode", "block", "--no-partition"}, nil},
		{"mkfs copies a host directory", "", []string{"create", "mkfs1", "--size", "16M", "--mkfs-option", "-d " + oldDir}, nil},
		{"mkfs random uuid", "", []string{"create", "mkfs2", "--size", "8M", "--mkfs-option", "-Urandom"}, nil},
		{"mkfs dry run", "", []string{"create", "mkfs3", "--size", "8M", "--mkfs-option", "-n"}, nil},
		{"mkfs xfs uuid", "", []string{"create", "mkfs4", "--size", "320M", "--fs", "xfs", "--mkfs-option", "-muuid=11111111-1111-1111-1111-111111111111"}, nil},
		{"mkfs xfs external log", "", []string{"create", "mkfs5", "--size", "320M", "--fs", "xfs", "--mkfs-option", "-l logdev=" + junk + ",size=64m"}, nil},
		{"mkfs xfs data file", "", []string{"create", "mkfs6", "--size", "320M", "--fs", "xfs", "--mkfs-option", "-d name=" + junk}, nil},
		{"mkfs unknown option", "", []string{"create", "mkfs7", "--size", "8M", "--mkfs-option", "-V"}, nil},
		{"unknown subcommand", "", []string{"frobnicate"}, nil},
		{"unknown subcommand, long", "", []string{long}, nil},
		{"unknown flag, control characters", "", []string{"--x" + hostile, "list"}, nil},
		{"unknown shorthand flag, control characters", "", []string{"-Z" + hostile, "list"}, nil},
		{"bad flag syntax, control characters", "", []string{"---" + hostile, "list"}, nil},
		{"udev timeout long", "", []string{"--udev-timeout", long, "list"}, nil},
		{"overcommit long", "", []string{"--overcommit-ratio", long, "list"}, nil},
		{"direct-io long", "", []string{"create", "other", "--size", "8M", "--direct-io=" + long}, nil},
		{"output format long", "", []string{"list", "-o", long}, nil},
		{"pv name long", "", []string{"pv", "existing", "--name", long}, nil},
		{"pv storage class long", "", []string{"pv", "existing", "--storage-class", long}, nil},
		{"pv node long", "", []string{"pv", "existing", "--node", long}, nil},
		{"unknown units subcommand", "", []string{"units", "frobnicate"}, nil},
		{"overcommit NaN", "", []string{"--overcommit-ratio", "NaN", "list"}, nil},
		{"overcommit Inf", "", []string{"--overcommit-ratio", "Inf", "list"}, nil},
		{"overcommit negative", "", []string{"--overcommit-ratio=-1", "list"}, nil},
		{"overcommit garbage", "", []string{"--overcommit-ratio", "abc", "list"}, nil},
		{"overcommit env garbage", "", []string{"list"}, []string{"SPARSEVOL_OVERCOMMIT_RATIO=abc"}},
		{"overcommit env NaN", "", []string{"list"}, []string{"SPARSEVOL_OVERCOMMIT_RATIO=NaN"}},
		{"overcommit env Inf", "", []string{"list"}, []string{"SPARSEVOL_OVERCOMMIT_RATIO=Inf"}},
		{"overcommit env long", "", []string{"list"}, []string{"SPARSEVOL_OVERCOMMIT_RATIO=" + long}},
		{"write-bps negative", "", []string{"create", "lim1", "--size", "8M", "--write-bps", "-1"}, nil},
		{"read-bps garbage", "", []string{"create", "lim2", "--size", "8M", "--read-bps", "10 MB/s"}, nil},
		{"read-bps beyond range", "", []string{"create", "lim3", "--size", "8M", "--read-bps", "99999999P"}, nil},
		{"read-iops zero", "", []string{"create", "lim4", "--size", "8M", "--read-iops", "0"}, nil},
		{"write-iops beyond 32 bits", "", []string{"create", "lim5", "--size", "8M", "--write-iops", "4294967295"}, nil},
		{"write-iops overflow", "", []string{"create", "lim6", "--size", "8M", "--write-iops", "18446744073709551616"}, nil},
		{"limit negative", "", []string{"limit", "small", "--write-iops", "-3"}, nil},
		{"limit clear and a value", "", []string{"limit", "small", "--clear", "--write-bps", "1M"}, nil},
		{"limit missing volume", "", []string{"limit", "nope", "--write-bps", "1M"}, nil},
		{"pods cgroup escapes", "", []string{"--pods-cgroup", "../x", "list"}, nil},
		{"pods cgroup absolute", "", []string{"list"}, []string{"SPARSEVOL_PODS_CGROUP=/kubepods"}},
		{"cgroup mount relative", "", []string{"--cgroup-mount", "sys/fs/cgroup", "list"}, nil},
		{"cgroup mount long", "", []string{"--cgroup-mount", long, "list"}, nil},
		{"cgroup mount control characters", "", []string{"--cgroup-mount", "/sys/fs/" + hostile, "list"}, nil},
		{"pods cgroup new line", "", []string{"--pods-cgroup", "a\nb", "list"}, nil},
		{"pods cgroup env control characters", "", []string{"list"}, []string{"SPARSEVOL_PODS_CGROUP=kubepods" + hostile}},
		{"empty unit dir", "", []string{"--unit-dir", "", "list"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r0 := root
			if tt.root != "" {
				r0 = tt.root
			}
			before := snapshot(t, root)
			r := sparsevol(t, r0, tt.env, tt.args...)
			if r.code != 2 {
				t.Fatalf("exit %d, want 2; stderr: %s", r.code, r.stderr)
			}
			lines := strings.Split(strings.TrimSpace(r.stderr), "\n")
			if len(lines) != 1 || !strings.HasPrefix(lines[0], "sparsevol: ") {
				t.Fatalf("want one error line, got %q", r.stderr)
			}
			checkShownLine(t, lines[0])
			if after := snapshot(t, root); after != before {
				t.Fatalf("rejected command changed state:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
	mustRun(t, root, "snapshot", "delete", "snap")
	mustRun(t, root, "delete", "existing", "small", "bycsi")
}

// maxErrorLine bounds a refusal's line: it shows a refused value only as
// volume.Quote's short prefix.
const maxErrorLine = 512

// checkShownLine fails the test if line, a refusal, holds a control
// character (a value echoed raw) or is longer than maxErrorLine (a value
// echoed whole).
func checkShownLine(t *testing.T, line string) {
	t.Helper()
	if i := strings.IndexFunc(line, func(r rune) bool { return r < 0x20 || r == 0x7f }); i >= 0 {
		t.Errorf("control character %q at byte %d of the error line %q", line[i], i, line)
	}
	if len(line) > maxErrorLine {
		t.Errorf("error line of %d bytes, at most %d wanted: %.200q...", len(line), maxErrorLine, line)
	}
}

func TestConcurrentAttachSameVolume(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "shared", "--size", "8M", "--no-start")
	const procs = 32
	results := concurrently(t, root, procs, func(i int) []string { return []string{"attach", "shared"} })
	devices := map[string]bool{}
	for _, r := range results {
		if r.code != 0 {
			t.Fatalf("attach failed: %s", r.stderr)
		}
		devices[strings.Fields(r.stdout)[1]] = true
	}
	st := statuses(t, root)[0]
	if len(devices) != 1 || len(st.ExtraDevices) != 0 {
		t.Fatalf("%d processes attached %v (extra %v): want exactly one device", procs, devices, st.ExtraDevices)
	}
	mustRun(t, root, "delete", "shared")
}

func TestConcurrentCreates(t *testing.T) {
	root := newRoot(t)
	const procs = 64
	results := concurrently(t, root, procs, func(i int) []string { return []string{"create", fmt.Sprintf("v%02d", i), "--size", "4M"} })
	for i, r := range results {
		if r.code != 0 {
			t.Fatalf("create v%02d: exit %d: %s", i, r.code, r.stderr)
		}
	}
	sts := statuses(t, root)
	devices := map[string]bool{}
	var names []string
	for _, st := range sts {
		if st.State != volume.StateReady || !st.Attached {
			t.Errorf("volume %s: state %s, attached %v", st.Name, st.State, st.Attached)
		}
		devices[st.Device] = true
		names = append(names, st.Name)
	}
	sort.Strings(names)
	if len(sts) != procs || len(devices) != procs {
		t.Fatalf("%d volumes on %d devices, want %d on %d", len(sts), len(devices), procs, procs)
	}
	args := append([]string{"delete"}, names...)
	mustRun(t, root, args...)
}

func TestCommandsEndToEnd(t *testing.T) {
	root := newRoot(t)
	for _, tc := range []struct{ name, fs string }{{"e", "ext4"}, {"x", "xfs"}} {
		size := "32M"
		if tc.fs == "xfs" {
			size = "300M"
		}
		uuid := strings.TrimSpace(mustRun(t, root, "create", tc.name, "--size", size, "--fs", tc.fs, "--mkfs-option", "-L "+tc.name))
		var st volume.Status
		json.Unmarshal([]byte(mustRun(t, root, "status", tc.name, "-o", "json")), &st)
		if st.UUID != uuid || !st.Attached || st.FSType != tc.fs || st.AllocatedBytes == 0 || st.StablePath != "/dev/disk/by-uuid/"+uuid {
			t.Fatalf("status: %+v", st)
		}
		label, _ := exec.Command("blkid", "-s", "LABEL", "-o", "value", st.Device).Output()
		if strings.TrimSpace(string(label)) != tc.name {
			t.Fatalf("--mkfs-option not passed: label %q", label)
		}
		pv := mustRun(t, root, "pv", tc.name, "--node", "node-1", "--storage-class", "local")
		for _, want := range []string{`"kind": "PersistentVolume"`, `"path": "/dev/disk/by-uuid/` + uuid + `"`, `"node-1"`, `"volumeMode": "Filesystem"`, `"fsType": "` + tc.fs + `"`, `"storageClassName": "local"`} {
			if !strings.Contains(pv, want) {
				t.Fatalf("pv manifest lacks %q:\n%s", want, pv)
			}
		}
	}
	raw := strings.TrimSpace(mustRun(t, root, "create", "r", "--size", "8M", "--mode", "block", "--no-partition"))
	if pv := mustRun(t, root, "pv", "r"); !strings.Contains(pv, `"volumeMode": "Block"`) || !strings.Contains(pv, "/dev/sparsevol/"+raw) {
		t.Fatalf("raw pv:\n%s", pv)
	}
	table := mustRun(t, root, "list")
	for _, want := range []string{"NAME", "e ", "x ", "r ", "block (whole)"} {
		if !strings.Contains(table, want) {
			t.Fatalf("list lacks %q:\n%s", want, table)
		}
	}
	mustRun(t, root, "detach", "--all")
	for _, st := range statuses(t, root) {
		if st.Attached {
			t.Fatalf("%s attached after detach --all", st.Name)
		}
	}
	mustRun(t, root, "attach", "--all")
	for _, st := range statuses(t, root) {
		if !st.Attached {
			t.Fatalf("%s detached after attach --all", st.Name)
		}
	}
	mustRun(t, root, "expand", "e", "--size", "64M")
	if doctor := sparsevol(t, root, nil, "doctor"); !strings.Contains(doctor.stdout, "loop") || !strings.Contains(doctor.stdout, "space") {
		t.Fatalf("doctor output:\n%s%s", doctor.stdout, doctor.stderr)
	}
	mustRun(t, root, "delete", "e", "x", "r")
}

// TestConcurrentIdenticalCreates: a retried create running next to the
// first one must not format the volume again; exactly one wins.
func TestConcurrentIdenticalCreates(t *testing.T) {
	root := newRoot(t)
	const procs = 8
	results := concurrently(t, root, procs, func(i int) []string {
		return []string{"create", "same", "--size", "64M", "--uuid", "0b7e4bd6-1c2b-4a57-9d6a-0e5d7f4e2f10"}
	})
	ok := 0
	for _, r := range results {
		switch r.code {
		case 0:
			ok++
		case 2:
		default:
			t.Fatalf("create: exit %d: %s", r.code, r.stderr)
		}
	}
	if ok != 1 {
		t.Fatalf("%d identical creates succeeded, want exactly 1", ok)
	}
	mustRun(t, root, "delete", "same")
}

// TestDetachAfterBackingFileRemoved: a volume whose file was deleted behind
// our back still has its device detached (found by the recorded identity
// and the tag), by detach and by delete.
// TestOrphanedVolume: a backing file removed while attached leaves the
// data only on the device. Detach and delete refuse to lose it; recover
// copies it back; --force gives it up.
func TestOrphanedVolume(t *testing.T) {
	tests := []struct {
		name    string
		refused [][]string // each must exit 1 and leave the device
		then    [][]string // then these succeed
		recover bool       // the data comes back
	}{
		{"recover", [][]string{{"detach", "gone"}, {"detach", "--all"}, {"delete", "gone"}, {"attach", "gone"}},
			[][]string{{"recover", "gone"}}, true},
		{"detach --force", nil, [][]string{{"detach", "--force", "gone"}, {"delete", "gone"}}, false},
		{"detach --all --force", nil, [][]string{{"detach", "--all", "--force"}, {"delete", "gone"}}, false},
		{"delete --force", nil, [][]string{{"delete", "--force", "gone"}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := newRoot(t)
			mustRun(t, root, "create", "gone", "--size", "16M")
			st := statuses(t, root)[0]
			mnt := t.TempDir()
			if err := unix.Mount(st.DataDevice, mnt, "ext4", 0, ""); err != nil {
				t.Fatal(err)
			}
			data := []byte("only on the device now\n")
			err := os.WriteFile(filepath.Join(mnt, "data"), data, 0o600)
			if uerr := unix.Unmount(mnt, 0); err != nil || uerr != nil {
				t.Fatal(err, uerr)
			}
			if err := os.Remove(st.BackingFile); err != nil {
				t.Fatal(err)
			}
			if got := statuses(t, root)[0]; got.State != volume.StateOrphaned || got.Device != st.Device {
				t.Fatalf("after the file went: state %s device %q, want orphaned on %s", got.State, got.Device, st.Device)
			}
			for _, args := range tt.refused {
				r := sparsevol(t, root, nil, args...)
				if r.code != 1 || !strings.Contains(r.stderr, "recover") {
					t.Fatalf("%v: exit %d %q, want 1 naming recover", args, r.code, r.stderr)
				}
				if devs := devicesUnder(root); len(devs) != 1 {
					t.Fatalf("%v left devices %v, want the orphan's", args, devs)
				}
			}
			for _, args := range tt.then {
				mustRun(t, root, args...)
			}
			if !tt.recover {
				if devs := devicesUnder(root); len(devs) > 0 {
					t.Fatalf("%v left %v bound", tt.then, devs)
				}
				return
			}
			got := statuses(t, root)[0]
			if got.State != volume.StateReady || !got.Attached || got.FileMissing {
				t.Fatalf("after recover: %+v", got)
			}
			if err := unix.Mount(got.DataDevice, mnt, "ext4", unix.MS_RDONLY, ""); err != nil {
				t.Fatal(err)
			}
			back, err := os.ReadFile(filepath.Join(mnt, "data"))
			unix.Unmount(mnt, 0)
			if err != nil || !bytes.Equal(back, data) {
				t.Fatalf("recovered data = %q, %v", back, err)
			}
			mustRun(t, root, "delete", "gone")
		})
	}
}

// TestAttachCancelsDeferredDetach: a detach deferred because a process
// held the device must not make a later attach report a device that then
// disappears.
func TestAttachCancelsDeferredDetach(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "d", "--size", "8M")
	st := statuses(t, root)[0]
	f, err := os.Open(st.Device)
	if err != nil {
		t.Fatal(err)
	}
	if r := sparsevol(t, root, nil, "detach", "d"); r.code != 1 || !strings.Contains(r.stderr, "deferred") {
		f.Close()
		t.Fatalf("detach while open: exit %d %s", r.code, r.stderr)
	}
	mustRun(t, root, "attach", "d")
	f.Close()
	if st := statuses(t, root)[0]; !st.Attached {
		t.Fatal("volume lost its device when the opener closed, after attach reported it attached")
	}
	mustRun(t, root, "delete", "d")
}

// cliStep is one CLI call of a scripted test and what it must show: its
// exit code, text its stdout and stderr must contain, and text stdout must
// not contain.
type cliStep struct {
	args     []string
	code     int
	stdout   []string
	stderr   []string
	notInOut []string
}

// runSteps runs the steps in order against root, reporting every miss.
func runSteps(t *testing.T, root string, steps []cliStep) {
	t.Helper()
	for _, st := range steps {
		r := sparsevol(t, root, nil, st.args...)
		if r.code != st.code {
			t.Errorf("sparsevol %v: exit %d, want %d; stderr %s", st.args, r.code, st.code, r.stderr)
		}
		for _, w := range st.stdout {
			if !strings.Contains(r.stdout, w) {
				t.Errorf("sparsevol %v: stdout lacks %q:\n%s", st.args, w, r.stdout)
			}
		}
		for _, w := range st.stderr {
			if !strings.Contains(r.stderr, w) {
				t.Errorf("sparsevol %v: stderr lacks %q:\n%s", st.args, w, r.stderr)
			}
		}
		for _, w := range st.notInOut {
			if strings.Contains(r.stdout, w) {
				t.Errorf("sparsevol %v: stdout has %q:\n%s", st.args, w, r.stdout)
			}
		}
	}
}

// TestLimitCommand: limits set at create and changed by limit where the
// host has cgroup v2's io controller (a private cgroup of the test's own);
// elsewhere both exit 1 naming cgroup v2 and change nothing. Either way
// status and limit show them.
func TestLimitCommand(t *testing.T) {
	root := newRoot(t)
	m, cg := testutil.PrivateCgroup2(t)
	at := []string{"--cgroup-mount", m, "--pods-cgroup", cg}
	args := func(a ...string) []string { return append(slices.Clone(at), a...) }
	mustRun(t, root, args("create", "plain", "--size", "8M", "--mode", "block", "--no-partition")...)
	if testutil.HostLacks(t, testutil.FeatureIOLimits, iolimit.Config{Mount: m, Cgroup: cg}.Supported()) {
		runSteps(t, root, []cliStep{
			{args: args("create", "lim", "--size", "8M", "--write-bps", "10M"), code: 1, stderr: []string{"cgroup v2", "io controller"}},
			{args: args("limit", "plain", "--write-iops", "100"), code: 1, stderr: []string{"cgroup v2"}},
			{args: args("limit", "plain"), stdout: []string{"plain\tnone"}},
			{args: args("status", "plain"), stdout: []string{"I/O limits:", "none"}},
			{args: args("list"), notInOut: []string{"lim\t", "lim "}},
		})
		// Limits recorded where they could be enforced (the store came
		// from another host): doctor fails and says what to do.
		uuid := statuses(t, root)[0].UUID
		meta := filepath.Join(root, uuid+".json")
		data, err := os.ReadFile(meta)
		if err != nil {
			t.Fatal(err)
		}
		data = bytes.Replace(data, []byte(`"uuid":`), []byte(`"ioLimits": {"writeIOPS": 100}, "uuid":`), 1)
		if err := os.WriteFile(meta, data, 0o600); err != nil {
			t.Fatal(err)
		}
		runSteps(t, root, []cliStep{
			{args: args("doctor"), code: 1, stdout: []string{"[FAIL] I/O limits", "1 volume(s) have limits", "--clear"}},
			{args: args("limit", "plain", "--clear"), stdout: []string{"plain\tnone"}},
		})
		mustRun(t, root, "delete", "plain")
		return
	}
	runSteps(t, root, []cliStep{
		{args: args("create", "lim", "--size", "8M", "--mode", "block", "--no-partition", "--write-bps", "10M")},
		{args: args("status", "lim"), stdout: []string{"write 10Mi/s"}},
		{args: args("limit", "plain", "--write-iops", "100", "--read-bps", "1Mi")},
		{args: args("limit", "plain"), stdout: []string{"read 1Mi/s, write 100 IOPS"}},
		{args: args("limit", "plain", "--read-bps", "max"), stdout: []string{"write 100 IOPS"}, notInOut: []string{"read"}},
		{args: args("limit", "plain", "--clear"), stdout: []string{"plain\tnone"}},
	})
	mustRun(t, root, "delete", "plain", "lim")
}

// TestLimitKeepsAConcurrentChange: `limit` changes the limits its flags
// name over those the volume has under its lock, so a change of another
// limit made after `limit` read the volume (a CSI ModifyVolume, another
// `limit`) stays. The test holds the volume's lock until `limit` waits
// for it, and makes the other change meanwhile.
func TestLimitKeepsAConcurrentChange(t *testing.T) {
	root := newRoot(t)
	m, cg := testutil.PrivateCgroup2(t)
	at := []string{"--cgroup-mount", m, "--pods-cgroup", cg}
	enforced := !testutil.HostLacks(t, testutil.FeatureIOLimits, iolimit.Config{Mount: m, Cgroup: cg}.Supported())
	for _, tc := range []struct {
		name      string
		enforced  bool // needs a host that enforces limits
		before    map[string]any
		flags     []string
		meanwhile func(limits map[string]any)
		want      volume.IOLimits
	}{
		{"lift one while another is lifted", false, map[string]any{"writeIOPS": 100, "readIOPS": 50},
			[]string{"--write-iops", "max"}, func(l map[string]any) { delete(l, "readIOPS") }, volume.IOLimits{}},
		{"set one while another is set", true, map[string]any{},
			[]string{"--write-iops", "100"}, func(l map[string]any) { l["readBytesPerSecond"] = 1 << 20 }, volume.IOLimits{WriteIOPS: 100, ReadBPS: 1 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.enforced && !enforced {
				t.Skip("no io controller here; the VM suite's guest run has one and runs this")
			}
			mustRun(t, root, "create", "plain", "--size", "8M", "--mode", "block", "--no-partition")
			t.Cleanup(func() { sparsevol(t, root, nil, "delete", "plain") })
			uuid := statuses(t, root)[0].UUID
			meta := filepath.Join(root, uuid+".json")
			testutil.EditJSON(t, meta, func(rec map[string]any) { rec["ioLimits"] = tc.before })
			unlock := holdLock(t, filepath.Join(root, ".locks", uuid))
			cmd := exec.Command(os.Args[0], append(append([]string{"--root", root}, at...), append([]string{"limit", "plain"}, tc.flags...)...)...)
			cmd.Env = append(os.Environ(), asCLI+"=1")
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			waitForLockWaiter(t, cmd.Process.Pid, filepath.Join(root, ".locks", uuid), done)
			testutil.EditJSON(t, meta, func(rec map[string]any) {
				l, _ := rec["ioLimits"].(map[string]any)
				tc.meanwhile(l)
			})
			unlock()
			if err := <-done; err != nil {
				t.Fatalf("sparsevol limit plain %v: %v: %s", tc.flags, err, stderr.String())
			}
			var got volume.IOLimits
			if err := json.Unmarshal([]byte(mustRun(t, root, "status", "plain", "-o", "json")), &struct {
				IOLimits *volume.IOLimits `json:"ioLimits"`
			}{&got}); err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("limits after limit %v and a change meanwhile = %+v, want %+v (stdout %q)", tc.flags, got, tc.want, stdout.String())
			}
		})
	}
}

// holdLock takes the flock of the lock file path (made if missing), as a
// store operation on its volume would, until the returned func is called
// (or the test ends).
func holdLock(t *testing.T, path string) func() {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	unlock := sync.OnceFunc(func() { f.Close() })
	t.Cleanup(unlock)
	return unlock
}

// waitForLockWaiter returns once process pid waits for the flock of the
// lock file path (/proc/locks shows it blocked, "->"); it fails the test
// if the process ends first (done) or does not wait within ten seconds.
func waitForLockWaiter(t *testing.T, pid int, path string, done chan error) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	ino := fmt.Sprintf(":%d", st.Ino)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		select {
		case err := <-done:
			done <- err
			t.Errorf("process %d ended (%v) before it waited for %s", pid, err, path)
			return
		default:
		}
		locks, err := os.ReadFile("/proc/locks")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(locks), "\n") {
			f := strings.Fields(line)
			if slices.Contains(f, "->") && slices.Contains(f, strconv.Itoa(pid)) && slices.ContainsFunc(f, func(s string) bool { return strings.HasSuffix(s, ino) }) {
				return
			}
		}
	}
	t.Fatalf("process %d did not wait for %s within ten seconds", pid, path)
}
