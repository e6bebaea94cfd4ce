//go:build e2e

package vm

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 2: a clean reboot. One volume of every kind (ext4, xfs,
// partitioned block, whole raw block) with data; the filesystems stay
// mounted over the reboot, as a node's pod volumes would be. Scenario 5
// reuses these volumes.
var (
	s2Setup = vmrun.Step{Name: "s2-setup", Timeout: short, Script: `make_set s2 "" keep`}
	s2Check = vmrun.Step{Name: "s2-check", Timeout: short, Script: `check_set s2`}
)

var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "2-clean-reboot",
	Steps: []vmrun.Placed{
		vmrun.At("b2-baseline", s2Setup),
		vmrun.At("b3-after-clean-reboot", s2Check),
	},
	Check: func(t *testing.T, r *run) { checkSet(t, r, "s2-setup", "s2-check", "s2", 4) },
})
