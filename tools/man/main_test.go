package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestManPages: the pages come from the command trees: one for sparsevol
// and one per subcommand, and one for sparsevol-csi, each naming its
// examples; hidden commands get none.
func TestManPages(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "man8")
	if err := write(dir); err != nil {
		t.Fatal(err)
	}
	for page, wants := range map[string][]string{
		"sparsevol.8":         {".TH \"SPARSEVOL\" \"8\"", "sparsevol-create(8)"},
		"sparsevol-create.8":  {"--mkfs-option", "EXAMPLE"},
		"sparsevol-recover.8": {"orphaned", "EXAMPLE"},
		"sparsevol-csi.8":     {".TH \"SPARSEVOL\" \"8\"", "--node-id", "--root", "EXAMPLE"},
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
	if b, err := os.ReadFile(filepath.Join(dir, "sparsevol.8")); err == nil && strings.Contains(string(b), "sparsevol-csi(8)") {
		t.Errorf("sparsevol.8 lists the hidden csi command as a subcommand")
	}
}
