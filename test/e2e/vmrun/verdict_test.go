package vmrun

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// recorder is a testing.TB that keeps what a check reports.
type recorder struct {
	testing.TB
	errs []string
}

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, a ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, a...))
}

// fakeBoot writes what the guest driver would have written for one step.
func fakeBoot(t *testing.T, rc, facts string) *Result {
	t.Helper()
	out := t.TempDir()
	for name, content := range map[string]string{
		"s.rc": rc, "s.ms": "12\n", "s.facts": facts, "s.log": "step output\nlast log line\n",
		"journal/plugin.log": "plugin said something\n",
	} {
		if err := WriteFile(filepath.Join(out, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b := &Result{Spec: BootSpec{Name: "b1", Steps: []Step{{Name: "s"}}}, OutDir: out, Journal0: "plugin"}
	b.load()
	return b
}

func TestVerdicts(t *testing.T) {
	for _, tc := range []struct {
		name  string
		rc    string
		facts string
		check func(tb testing.TB, b *Result) bool
		want  []string // in the one message; none: the check passes
	}{
		{"step passed", "0\n", "data=same\n", func(tb testing.TB, b *Result) bool { return NeedStep(tb, b, "s") }, nil},
		{"exit code", "1\n", "", func(tb testing.TB, b *Result) bool { return NeedStep(tb, b, "s") },
			[]string{"step s exited 1", "last log line", "plugin said something"}},
		{"failure recorded, exit 0", "0\n", "fail=apply pvc\n", func(tb testing.TB, b *Result) bool { return NeedStep(tb, b, "s") },
			[]string{"step s exited 0", "- apply pvc", "last log line", "journal of plugin"}},
		{"step did not run", "", "", func(tb testing.TB, b *Result) bool { return NeedStep(tb, b, "other") },
			[]string{"step other did not run"}},
		{"fact matches", "0\n", "data=same\ngrown=yes\n", func(tb testing.TB, b *Result) bool {
			return Expect(tb, b, "s", "data", "same", "grown", "yes")
		}, nil},
		{"fact differs", "0\n", "data=different: [x]\ngrown=yes\n", func(tb testing.TB, b *Result) bool {
			return Expect(tb, b, "s", "data", "same", "grown", "yes")
		}, []string{`fact data = "different: [x]", want "same"`, "plugin said something"}},
		{"fact missing", "0\n", "", func(tb testing.TB, b *Result) bool { return Expect(tb, b, "s", "grown", "yes") },
			[]string{`fact grown not recorded, want "yes"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := fakeBoot(t, tc.rc, tc.facts)
			if tc.rc == "" {
				os.Remove(filepath.Join(b.OutDir, "s.rc"))
			}
			rec := &recorder{}
			ok := tc.check(rec, b)
			if ok != (tc.want == nil) || len(rec.errs) != map[bool]int{true: 0, false: 1}[tc.want == nil] {
				t.Fatalf("check = %v with errors %q; want pass = %v", ok, rec.errs, tc.want == nil)
			}
			for _, w := range tc.want {
				if !strings.Contains(rec.errs[0], w) {
					t.Errorf("message lacks %q:\n%s", w, rec.errs[0])
				}
			}
		})
	}
}

func TestNeedBoot(t *testing.T) {
	rec := &recorder{}
	if NeedStep(rec, nil, "s") || len(rec.errs) != 1 || !strings.Contains(rec.errs[0], "did not run") {
		t.Errorf("nil boot: %q", rec.errs)
	}
	rec = &recorder{}
	b := &Result{Spec: BootSpec{Name: "b2"}, Err: fmt.Errorf("timed out"), Console: "/nonexistent"}
	if NeedStep(rec, b, "s") || len(rec.errs) != 1 || !strings.Contains(rec.errs[0], "boot b2 failed: timed out") {
		t.Errorf("failed boot: %q", rec.errs)
	}
}
