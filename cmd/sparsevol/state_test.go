package main

import (
	"os"
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
