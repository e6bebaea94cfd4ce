package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
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

	tests := []struct {
		args     []string
		code     int
		stdout   []string // each must appear
		stderr   []string
		notInOut []string
	}{
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
	}
	for _, tt := range tests {
		r := sparsevol(t, root, nil, tt.args...)
		if r.code != tt.code {
			t.Errorf("sparsevol %v: exit %d, want %d; stderr %s", tt.args, r.code, tt.code, r.stderr)
		}
		for _, w := range tt.stdout {
			if !strings.Contains(r.stdout, w) {
				t.Errorf("sparsevol %v: stdout lacks %q:\n%s", tt.args, w, r.stdout)
			}
		}
		for _, w := range tt.stderr {
			if !strings.Contains(r.stderr, w) {
				t.Errorf("sparsevol %v: stderr lacks %q:\n%s", tt.args, w, r.stderr)
			}
		}
		for _, w := range tt.notInOut {
			if strings.Contains(r.stdout, w) {
				t.Errorf("sparsevol %v: stdout has %q:\n%s", tt.args, w, r.stdout)
			}
		}
	}
	for _, p := range []string{meta, filepath.Join(root, bad)} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s still there after delete (%v)", p, err)
		}
	}
}

// TestExpandStatesCLI: an expand whose first step fails (EFBIG: the file
// size limit stands for a size the filesystem cannot hold) leaves nothing
// pending; one that stopped after the file grew is listed and shown as
// expanding with its target, and can be abandoned or finished.
func TestExpandStatesCLI(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "v", "--size", "32M", "--mode", "block", "--no-partition", "--no-start")
	file := func() int64 {
		t.Helper()
		sts := statuses(t, root)
		return sts[0].FileSizeBytes
	}

	// The first step fails: EFBIG.
	cmd := exec.Command("prlimit", "--fsize=67108864", "--", os.Args[0], "--root", root, "--overcommit-ratio", "1e9", "expand", "v", "--size", "20T")
	cmd.Env = append(os.Environ(), asCLI+"=1")
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(string(out), "file too large") {
		t.Fatalf("expand beyond the file size limit: %v: %s; want exit 1, file too large", err, out)
	}
	if st := statuses(t, root)[0]; st.State != "ready" || st.ExpandingTo != 0 || file() != 32<<20 {
		t.Fatalf("after a failed first step: state %s, pending %d, file %d; want ready, nothing pending, 32 MiB", st.State, st.ExpandingTo, file())
	}
	mustRun(t, root, "create", "w", "--size", "1M", "--mode", "block", "--no-partition", "--no-start")

	crash := func() {
		t.Helper()
		r := sparsevol(t, root, []string{"SPARSEVOL_TEST_CRASH_AT=expand:file"}, "expand", "v", "--size", "48M")
		if !r.signaled {
			t.Fatalf("crash point not reached: exit %d %s", r.code, r.stderr)
		}
	}
	crash()
	tests := []struct {
		args   []string
		code   int
		stdout []string
	}{
		{[]string{"list"}, 0, []string{"32Mi->48Mi", "expanding", "--abandon"}},
		{[]string{"list", "-o", "json"}, 0, []string{`"state": "expanding"`, `"expandingTo": 50331648`}},
		{[]string{"status", "v"}, 0, []string{"expanding", "Expanding to:", "48Mi", "backing file 50331648 bytes"}},
		{[]string{"expand", "v", "--size", "40M"}, 2, nil},
		{[]string{"expand", "v"}, 2, nil},
		{[]string{"expand", "v", "--size", "48M", "--abandon"}, 2, nil},
		{[]string{"expand", "v", "--abandon"}, 0, []string{"v\t32Mi"}},
		{[]string{"status", "v"}, 0, []string{"ready", "32Mi"}},
		{[]string{"expand", "v", "--abandon"}, 2, nil},
	}
	for _, tt := range tests {
		r := sparsevol(t, root, nil, tt.args...)
		if r.code != tt.code {
			t.Errorf("sparsevol %v: exit %d, want %d; stderr %s", tt.args, r.code, tt.code, r.stderr)
		}
		for _, w := range tt.stdout {
			if !strings.Contains(r.stdout, w) {
				t.Errorf("sparsevol %v: stdout lacks %q:\n%s", tt.args, w, r.stdout)
			}
		}
	}
	if got := file(); got != 32<<20 {
		t.Errorf("backing file %d bytes after abandon, want %d", got, 32<<20)
	}
	crash()
	if out := mustRun(t, root, "expand", "v", "--size", "48M"); out != "v\t48Mi\n" {
		t.Errorf("finishing: %q", out)
	}
	if st := statuses(t, root)[0]; st.State != "ready" || st.SizeBytes != 48<<20 || file() != 48<<20 {
		t.Errorf("after finishing: state %s size %d file %d", st.State, st.SizeBytes, file())
	}
}
