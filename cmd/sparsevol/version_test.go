package main

import (
	"regexp"
	"testing"
)

// TestVersion: version and --version say what was built.
func TestVersion(t *testing.T) {
	root := t.TempDir()
	want := regexp.MustCompile(`^sparsevol \S+ \(commit \S+, go1\.\d+`)
	for _, args := range [][]string{{"version"}, {"--version"}} {
		if out := mustRun(t, root, args...); !want.MatchString(out) {
			t.Errorf("sparsevol %v = %q, want %s", args, out, want)
		}
	}
}
