//go:build e2e

package vm

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 3: a hard reset. The same set as scenario 2; the host kills the
// VM right after the data is fsynced (no sync beyond the steps' own).
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "3-hard-reset",
	Steps: []vmrun.Placed{
		{Boot: "b3-after-clean-reboot", Then: vmrun.Kill,
			Step: vmrun.Step{Name: "s3-setup", Timeout: short, Script: `make_set s3 "" keep`}},
		vmrun.At("b4-after-hard-reset", vmrun.Step{Name: "s3-check", Timeout: short, Script: `check_set s3`}),
	},
	Check: func(t *testing.T, r *run) {
		if setup := r.ran(t, "s3-setup"); !setup.Killed {
			t.Errorf("boot %s was not ended by a hard reset", setup.Spec.Name)
		}
		checkSet(t, r, "s3-setup", "s3-check", "s3", 4)
	},
})
