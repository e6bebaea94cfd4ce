//go:build e2e

package vm

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 4: the store on its own disk (/dev/vdb), mounted from
// /etc/fstab. The volumes' units are ordered after the store's mount and
// start after it mounted.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "4-store-on-own-disk",
	Steps: []vmrun.Placed{
		vmrun.At("b2-baseline", vmrun.Step{Name: "s4-setup", Timeout: short, Script: `
			run mkfs.ext4 -q -F -L e2e-store /dev/vdb || die "mkfs store"
			echo "LABEL=e2e-store $STORE ext4 defaults 0 2" >>/etc/fstab
			mkdir -p "$STORE"
			run systemctl daemon-reload
			run mount "$STORE" || die "mount store"
			create_vol s4-ext4 ext4 64M "$STORE" && write_data s4-ext4
			create_vol s4-block block 64M "$STORE" && write_data s4-block
			sync
		`}),
		vmrun.At("b3-after-clean-reboot", vmrun.Step{Name: "s4-check", Timeout: short, Script: `
			fact s4.storeMounted "$(findmnt -n -o SOURCE "$STORE" | oneline)"
			check_set s4
		`}),
	},
	Check: func(t *testing.T, r *run) {
		checkSet(t, r, "s4-setup", "s4-check", "s4", 2)
		setup := r.ran(t, "s4-setup")
		after := r.ran(t, "s4-check")
		if after.Facts["s4.storeMounted"] == "" {
			t.Errorf("%s is not mounted after the reboot", storeDir)
		}
		mountUnit := `srv-sparsevol\x2dstore.mount`
		mount := after.mounts[mountUnit]
		mounted, _ := vmrun.Monotonic(mount["ActiveEnterTimestampMonotonic"])
		for _, n := range volumesOf(setup, "s4") {
			unit := "sparsevol@" + setup.Facts[n+".uuid"] + ".service"
			props, ok := after.units[unit]
			if !ok {
				t.Errorf("%s: unit %s not loaded", n, unit)
				continue
			}
			if !containsUnit(props["After"], mountUnit) {
				t.Errorf("%s: unit %s is not ordered after %s (RequiresMountsFor=%q)", n, unit, mountUnit, props["RequiresMountsFor"])
			}
			started, ok := vmrun.Monotonic(props["InactiveExitTimestampMonotonic"])
			if ok && mounted > 0 && started < mounted {
				t.Errorf("%s: unit %s started at %s, before the store was mounted at %s", n, unit, started, mounted)
			}
		}
	},
})
