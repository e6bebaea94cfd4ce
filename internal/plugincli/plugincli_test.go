package plugincli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/cli"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// TestMainRefusesAtStart runs the plugin's command line with a driver
// name that would lead the registration socket out of its directory, and
// with sockets another plugin listens on: each is refused with its exit
// code before anything is made (the store directory stays missing) and
// the other plugin's socket keeps answering.
func TestMainRefusesAtStart(t *testing.T) {
	tests := []struct {
		name string
		// args get --root (DIR/store, or DIR/root when given), --node-id
		// and --endpoint (DIR is the test's directory); live are paths
		// below DIR another plugin listens on.
		root string
		args []string
		live []string
		code int
		says string
	}{
		{"driver name escapes the registration directory", "",
			[]string{"--driver-name", "../escaped", "--kubelet-registration-path", "DIR/reg/"},
			[]string{"escaped-reg.sock"}, cli.ExitInvalid, "driver name"},
		{"driver name with a slash", "", []string{"--driver-name", "a/b"}, nil, cli.ExitInvalid, "driver name"},
		{"driver name too long", "", []string{"--driver-name", strings.Repeat("d", 64)}, nil, cli.ExitInvalid, "driver name"},
		{"CSI socket in use", "", nil, []string{"csi.sock"}, cli.ExitFailure, "another plugin is listening"},
		{"registration socket in use", "",
			[]string{"--kubelet-registration-path", "DIR/reg/"},
			[]string{"reg/sparsevol.csi.io-reg.sock"}, cli.ExitFailure, "another plugin is listening"},
		{"store root units cannot name", "st ore", nil, nil, cli.ExitInvalid, "U+0020"},
		{"store root with a specifier", "st%Hore", nil, nil, cli.ExitInvalid, "%"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir, err := os.MkdirTemp("", "svcli") // short: sun_path is 108 bytes
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			for _, p := range tc.live {
				testutil.LiveSocket(t, filepath.Join(dir, p))
			}
			root := filepath.Join(dir, "store")
			if tc.root != "" {
				root = filepath.Join(dir, tc.root)
			}
			args := []string{"--root", root, "--node-id", "n", "--endpoint", "unix://" + filepath.Join(dir, "csi.sock")}
			for _, a := range tc.args {
				args = append(args, strings.ReplaceAll(a, "DIR", dir))
			}
			var stderr bytes.Buffer
			if code := Main(args, &bytes.Buffer{}, &stderr); code != tc.code {
				t.Errorf("exit %d, want %d; stderr: %s", code, tc.code, &stderr)
			}
			if !strings.Contains(stderr.String(), tc.says) {
				t.Errorf("stderr %q does not say %q", &stderr, tc.says)
			}
			if _, err := os.Lstat(root); !os.IsNotExist(err) {
				t.Errorf("the store directory was made: %v", err)
			}
		})
	}
}
