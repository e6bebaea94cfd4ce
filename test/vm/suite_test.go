//go:build e2e

package vm

import (
	"embed"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// The suite's guest side: its step bodies (steps.sh), their helpers
// (lib.sh) and the kubelet stand-in.
//
//go:embed guest
var guestFiles embed.FS

// config holds this suite's own settings; vmrun.Config the shared ones.
type config struct {
	only       map[string]bool
	scaleCount int
	scaleSize  string
	scaleGuest bool // create the scale set in the guest instead of offline
}

func loadConfig(t *testing.T) config {
	t.Helper()
	c := config{
		scaleCount: vmrun.EnvInt(t, "SCALE", 100),
		scaleSize:  vmrun.Env("SCALE_SIZE", "16M"),
		scaleGuest: vmrun.EnvSet("SCALE_IN_GUEST"),
	}
	if only := vmrun.Env("ONLY", ""); only != "" {
		c.only = map[string]bool{}
		for _, s := range strings.Split(only, ",") {
			c.only[strings.TrimSpace(s)] = true
		}
	}
	return c
}

// suite is what test/vm adds to a run: the store disk of scenario 4, the
// kubelet stand-in, and sparsevol installed unless only scenario 1 runs.
func suite(install bool) vmrun.Suite {
	return vmrun.Suite{
		Name:     "e2e",
		Guest:    guestFiles,
		Disks:    []vmrun.Disk{{Name: "store.img", Size: "2G"}},
		Install:  install,
		Journals: []string{"sparsevol-boot.service"},
		Prepare: func(t testing.TB, root string) error {
			if err := vmrun.InstallFiles(guestFiles, root,
				vmrun.File{Src: "guest/kubelet.sh", Dst: "usr/local/lib/sparsevol-e2e/kubelet.sh", Mode: 0o755},
				vmrun.File{Src: "guest/kubelet.service", Dst: "etc/systemd/system/kubelet.service", Mode: 0o644},
			); err != nil {
				return err
			}
			return vmrun.EnableUnits(root, "kubelet.service")
		},
	}
}

// run is one execution of the suite.
type run struct {
	*vmrun.Run
	cfg      config
	results  map[string]*bootView
	figures  []string
	scale    *scaleSet
	scaleErr error
}

// boot runs one boot and reads the stand-in's view and the units'
// properties and journals the collect step saved.
func (r *run) boot(t *testing.T, spec vmrun.BootSpec) *bootView {
	t.Helper()
	b := newView(r.Boot(t, spec))
	r.results[spec.Name] = b
	return b
}
