package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestBrokenVolumeCLI: a truncated <uuid>.json is listed (table and JSON)
// and shown as broken, naming the file; attach --all attaches the others
// and fails naming it; delete by UUID removes it; the rest of the store
// works throughout.
func TestBrokenVolumeCLI(t *testing.T) {
	root := newRoot(t)
	t.Cleanup(func() { sparsevol(t, root, nil, "detach", "--all") })
	create := func(name string) string {
		t.Helper()
		return strings.TrimSpace(mustRun(t, root, "create", name, "--size", "1M", "--mode", "block", "--no-partition", "--no-start"))
	}
	create("good")
	bad := create("bad")
	meta := filepath.Join(root, bad+".json")
	data, err := os.ReadFile(meta)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(meta, data[:len(data)/2], 0o600); err != nil {
		t.Fatal(err)
	}

	runSteps(t, root, []cliStep{
		{[]string{"list"}, 0, []string{"good", bad + "  " + bad, "broken", meta, "unexpected end of JSON input", "sparsevol delete " + bad}, nil, nil},
		{[]string{"list", "-o", "json"}, 0, []string{`"state": "broken"`, `"problem": "read metadata ` + meta}, nil, nil},
		{[]string{"status", bad}, 0, []string{"State:", "broken", meta}, nil, nil},
		{[]string{"status", "good"}, 0, []string{"ready"}, nil, nil},
		{[]string{"create", "other", "--size", "1M", "--mode", "block", "--no-partition", "--no-start"}, 0, nil, nil, nil},
		{[]string{"attach", bad}, 1, nil, []string{meta}, nil},
		{[]string{"attach", "--all"}, 1, []string{"good\t/dev/loop", "other\t/dev/loop"}, []string{meta}, []string{bad}},
		{[]string{"detach", "good", "other"}, 0, nil, nil, nil},
		{[]string{"delete", bad}, 0, nil, nil, nil},
		{[]string{"list"}, 0, []string{"good", "other"}, nil, []string{bad, "broken"}},
		{[]string{"delete", "good", "other"}, 0, nil, nil, nil},
	})

	for _, p := range []string{meta, filepath.Join(root, bad)} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s still there after delete (%v)", p, err)
		}
	}
}

// makeNewer rewrites the record at path as a newer sparsevol might write
// it: format volume.RecordFormat+1, with a state and a field shape this
// binary does not know.
func makeNewer(t *testing.T, path string) {
	t.Helper()
	testutil.EditJSON(t, path, func(rec map[string]any) {
		rec["format"] = volume.RecordFormat + 1
		rec["state"] = "migrating"
		rec["ioLimits"] = "per-tenant"
	})
}

// TestNewerRecordsCLI: a volume and a snapshot whose records a newer
// sparsevol wrote are listed and shown in state newer with the advice to
// upgrade; doctor fails on them without advising a delete; every command
// that would act on them exits 1 naming the newer format and changes
// nothing (record bytes, no device), delete --force included; a create of
// their names is refused as taken (exit 2); the volume beside them keeps
// working, and attach --all attaches it and names the newer one.
func TestNewerRecordsCLI(t *testing.T) {
	root := newRoot(t)
	t.Cleanup(func() { sparsevol(t, root, nil, "detach", "good") })
	raw := []string{"--size", "1M", "--mode", "block", "--no-partition", "--no-start"}
	goodVol := strings.TrimSpace(mustRun(t, root, append([]string{"create", "good"}, raw...)...))
	vol := strings.TrimSpace(mustRun(t, root, append([]string{"create", "new"}, raw...)...))
	snap := strings.TrimSpace(mustRun(t, root, "snapshot", "create", "good", "snew"))
	volMeta := filepath.Join(root, vol+".json")
	snapMeta := filepath.Join(root, ".snapshots", snap+".json")
	makeNewer(t, volMeta)
	makeNewer(t, snapMeta)
	format := fmt.Sprintf("format %d, newer than the %d this sparsevol reads", volume.RecordFormat+1, volume.RecordFormat)
	const upgrade = "upgrade sparsevol"

	runSteps(t, root, []cliStep{
		{args: []string{"list"}, stdout: []string{"good", vol, "newer", volMeta, format, upgrade}},
		{args: []string{"status", "new"}, stdout: []string{"State:", "newer", volMeta, format, upgrade}},
		{args: []string{"status", vol, "-o", "json"}, stdout: []string{`"state": "newer"`, volMeta, upgrade}},
		{args: []string{"snapshot", "list"}, stdout: []string{"snew", "newer"}},
		{args: []string{"doctor"}, code: 1,
			stdout:   []string{"[FAIL] volume new: written by a newer sparsevol", "[FAIL] snapshot snew", volMeta, snapMeta, upgrade},
			notInOut: []string{"delete " + vol, "delete " + snap, "delete new", "delete snew"}},
	})
	var sts []volume.Status
	if err := json.Unmarshal([]byte(mustRun(t, root, "list", "-o", "json")), &sts); err != nil {
		t.Fatal(err)
	}
	if len(sts) != 2 || sts[1].UUID != vol || sts[1].Name != "new" || sts[1].State != volume.StateNewer ||
		sts[1].Format != volume.RecordFormat+1 || !strings.Contains(sts[1].Problem, volMeta) || !strings.Contains(sts[1].Problem, upgrade) {
		t.Errorf("list -o json: %+v; want good, and new in state newer of format %d naming %s and the upgrade", sts, volume.RecordFormat+1, volMeta)
	}
	if sns := snapshots(t, root); len(sns) != 1 || sns[0].UUID != snap || sns[0].Name != "snew" || sns[0].State != volume.StateNewer ||
		!strings.Contains(sns[0].Problem, snapMeta) || !strings.Contains(sns[0].Problem, upgrade) {
		t.Errorf("snapshot list -o json: %+v; want snew in state newer naming %s and the upgrade", sns, snapMeta)
	}

	// What a refusal of the newer volume or snapshot says: its record, the
	// format, the upgrade.
	newerVol := []string{volMeta, format, upgrade}
	newerSnap := []string{snapMeta, format, upgrade}
	for _, tt := range []struct {
		name   string
		args   []string
		code   int
		stderr []string
	}{
		{"delete", []string{"delete", "new"}, 1, newerVol},
		{"delete by uuid", []string{"delete", vol}, 1, newerVol},
		{"delete --force", []string{"delete", "--force", "new"}, 1, newerVol},
		{"attach", []string{"attach", "new"}, 1, newerVol},
		{"detach", []string{"detach", "new"}, 1, newerVol},
		{"detach --force", []string{"detach", "--force", "new"}, 1, newerVol},
		{"expand", []string{"expand", "new", "--size", "2M"}, 1, newerVol},
		{"limit", []string{"limit", "new", "--write-bps", "1M"}, 1, newerVol},
		{"limit shown", []string{"limit", "new"}, 1, newerVol},
		{"limit --clear", []string{"limit", "new", "--clear"}, 1, newerVol},
		{"snapshot of it", []string{"snapshot", "create", "new", "s2"}, 1, newerVol},
		{"clone of it", []string{"create", "c", "--clone-of", "new"}, 1, newerVol},
		{"export", []string{"export", "new"}, 1, newerVol},
		// pv refuses every volume not ready alike, pointing at status.
		{"pv", []string{"pv", "new"}, 1, []string{"state newer", "sparsevol status " + vol}},
		{"create of its name", append([]string{"create", "new"}, raw...), 2, []string{`"new"`, "exists"}},
		{"snapshot delete", []string{"snapshot", "delete", "snew"}, 1, newerSnap},
		{"snapshot delete by uuid", []string{"snapshot", "delete", snap}, 1, newerSnap},
		{"create --from-snapshot", []string{"create", "r", "--from-snapshot", "snew"}, 1, newerSnap},
		{"export the snapshot", []string{"export", "snew"}, 1, newerSnap},
		{"snapshot of its name", []string{"snapshot", "create", "good", "snew"}, 2, append([]string{`"snew" is taken: snapshot ` + snap}, newerSnap...)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			before := snapshot(t, root)
			runSteps(t, root, []cliStep{{args: tt.args, code: tt.code, stderr: tt.stderr}})
			if after := snapshot(t, root); after != before {
				t.Errorf("the refused %v changed the store:\nbefore:\n%s\nafter:\n%s", tt.args, before, after)
			}
		})
	}

	runSteps(t, root, []cliStep{
		{args: []string{"attach", "--all"}, code: 1, stdout: []string{"good\t/dev/loop"}, stderr: []string{volMeta, format}, notInOut: []string{"new"}},
		{args: []string{"status", "good"}, stdout: []string{"Attached:", "true"}},
		{args: []string{"expand", "good", "--size", "2M"}},
		{args: []string{"detach", "good"}},
	})
	// Beside another volume, delete refuses the newer one before it acts
	// on any (eachVolume): both are kept as they were.
	records := map[string][]byte{}
	for _, p := range []string{volMeta, snapMeta, filepath.Join(root, goodVol+".json")} {
		records[p], _ = os.ReadFile(p)
	}
	for _, args := range [][]string{{"delete", "good", "new"}, {"detach", "good", "new"}, {"trim", "good", "new"}} {
		runSteps(t, root, []cliStep{{args: args, code: 1, stderr: newerVol}})
	}
	runSteps(t, root, []cliStep{
		{args: []string{"status", "new"}, stdout: []string{"newer"}},
		{args: []string{"status", "good"}, stdout: []string{"ready"}},
	})
	for p, want := range records {
		if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s after the refused deletes: %q, %v; want it unchanged: %q", p, got, err, want)
		}
	}
	if devs := devicesUnder(root); len(devs) != 0 {
		t.Errorf("devices left bound: %v", devs)
	}
}
