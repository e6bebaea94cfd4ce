package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/systemd"
)

// TestUnitsInstallBinaryInDefaultStore: a binary below the default store,
// with another store, keeps its own path in ExecStart= and ExecStop=.
func TestUnitsInstallBinaryInDefaultStore(t *testing.T) {
	unitDir := filepath.Join(t.TempDir(), "etc", "systemd", "system")
	args := []string{"--unit-dir", unitDir, "--root", "/srv/store", "units", "install", "--offline", "--binary", "/var/lib/sparsevol/bin/sparsevol"}
	var stdout, stderr bytes.Buffer
	if code := Main(args, &stdout, &stderr); code != ExitOK {
		t.Fatalf("sparsevol %q: exit %d: %s", args, code, stderr.String())
	}
	data, err := os.ReadFile(filepath.Join(unitDir, systemd.TemplateName))
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{
		"\nExecStart=/var/lib/sparsevol/bin/sparsevol --udev-timeout=80s attach %i\n",
		"\nExecStop=/var/lib/sparsevol/bin/sparsevol detach %i\n",
		"\nEnvironment=SPARSEVOL_ROOT=/srv/store\n",
		"\nRequiresMountsFor=/srv/store\n",
	} {
		if !bytes.Contains(data, []byte(w)) {
			t.Errorf("%s lacks %q:\n%s", systemd.TemplateName, strings.TrimSpace(w), data)
		}
	}
}
