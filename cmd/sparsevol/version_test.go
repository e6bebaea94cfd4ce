package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestVersionAndManPages: version and --version say what was built, and
// the manual pages come from the command tree: one for sparsevol and one
// per subcommand, each naming its examples.
func TestVersionAndManPages(t *testing.T) {
	root := t.TempDir()
	want := regexp.MustCompile(`^sparsevol \S+ \(commit \S+, go1\.\d+`)
	for _, args := range [][]string{{"version"}, {"--version"}} {
		if out := mustRun(t, root, args...); !want.MatchString(out) {
			t.Errorf("sparsevol %v = %q, want %s", args, out, want)
		}
	}
	dir := filepath.Join(t.TempDir(), "man8")
	mustRun(t, root, "man", "--dir", dir)
	for page, wants := range map[string][]string{
		"sparsevol.8":         {".TH \"SPARSEVOL\" \"8\"", "sparsevol-create(8)"},
		"sparsevol-create.8":  {"--mkfs-option", "EXAMPLE"},
		"sparsevol-recover.8": {"orphaned", "EXAMPLE"},
	} {
		b, err := os.ReadFile(filepath.Join(dir, page))
		if err != nil {
			t.Errorf("man page %s: %v", page, err)
			continue
		}
		for _, w := range wants {
			if !strings.Contains(string(b), w) {
				t.Errorf("man page %s lacks %q", page, w)
			}
		}
	}
}
