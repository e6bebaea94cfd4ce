package cli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestTrimTableShowsMountPoints: a mount point comes from the mount table,
// and the directories on its way are named by whoever owns them: one
// holding an escape sequence or a newline is shown escaped, as status
// shows it, never written to the terminal raw.
func TestTrimTableShowsMountPoints(t *testing.T) {
	for _, tc := range []struct {
		name, mount, want string
	}{
		{"plain", "/mnt/data", "/mnt/data"},
		{"escape sequence", "/tmp/x\x1b]0;pwned\x07/d", `"/tmp/x\x1b]0;pwned\a/d"`},
		{"newline", "/tmp/a\nfake-row\t/d", `"/tmp/a\nfake-row\t/d"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			writeTrimTable(&globals{stdout: &out}, []*volume.TrimResult{{Name: "v", MountPoint: tc.mount}})
			got := out.String()
			if !strings.Contains(got, tc.want) {
				t.Errorf("trim table does not show %q as %s:\n%s", tc.mount, tc.want, got)
			}
			if strings.ContainsAny(got, "\x1b\x07") || strings.Count(got, "\n") != 2 {
				t.Errorf("trim table holds the mount point raw:\n%q", got)
			}
		})
	}
}
