//go:build e2e

package vm

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// untrackedRule keeps PID 1 from tracking sparsevol's loop devices: udev
// tags every block device "systemd" (99-systemd.rules), and PID 1 then
// makes a device unit for it and one per /dev link. Nothing of sparsevol
// or kubelet waits for those units.
const untrackedRule = `SUBSYSTEM=="block", KERNEL=="loop[0-9]*", ENV{DEVTYPE}=="disk", ATTR{loop/backing_file}=="/var/lib/sparsevol/*", TAG-="systemd"
`

// Scenario 9: what PID 1's device tracking costs at boot. After the seed
// boot, sparsevol's scale set is enabled again with untrackedRule
// installed; the boot cost is compared with scenario 7's boot.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "9-untracked-devices",
	Steps: []vmrun.Placed{
		vmrun.At("b5-scale", vmrun.Step{Name: "s9-tracked", Timeout: short, Script: `
			fact s9.deviceUnits "$(systemctl list-units --all --no-legend --plain '*.device' | grep -c loop)"
		`}),
		vmrun.At("b7-scale-untracked", vmrun.Step{Name: "s9-untracked", Timeout: short, Script: `
			fact s9.deviceUnits "$(systemctl list-units --all --no-legend --plain '*.device' | grep -c loop)"
			sparsevol list -o json >"$OUT/s9-list.json"
			fact s9.attached "$(jq '[.[] | select((.name | startswith("s7-")) and .attached)] | length' "$OUT/s9-list.json")"
		`}),
	},
	After: map[string]func(t *testing.T, r *run){
		"b6-seed-scale": func(t *testing.T, r *run) {
			err := r.WithRoot(false, func(mnt string) error {
				seeds, err := filepath.Glob(filepath.Join(mnt, "etc/systemd/system/multi-user.target.wants/seed-volume@*.service"))
				if err != nil {
					return err
				}
				for _, l := range seeds {
					if err := os.Remove(l); err != nil {
						return err
					}
				}
				for l, target := range r.disabled {
					if err := os.Symlink(target, l); err != nil {
						return err
					}
				}
				return vmrun.WriteFile(filepath.Join(mnt, "etc/udev/rules.d/99-zz-sparsevol-untracked.rules"), []byte(untrackedRule), 0o644)
			})
			if err != nil {
				t.Errorf("back to sparsevol, untracked: %v", err)
			}
		},
	},
	Check: func(t *testing.T, r *run) {
		base := r.ran(t, "baseline")
		tracked := r.ran(t, "s9-tracked")
		untracked := r.ran(t, "s9-untracked")
		set := r.scaleSet(t)
		if set == nil {
			t.Fatal("no scale set")
		}
		missing := 0
		for _, n := range set.names {
			if _, ok := untracked.kubelet.links["/dev/disk/by-uuid/"+set.uuids[n]]; !ok {
				missing++
			}
			if st := untracked.kubelet.units["sparsevol@"+set.uuids[n]+".service"]; st != "active" {
				t.Errorf("%s: unit %q at kubelet start", n, st)
			}
		}
		if missing > 0 {
			t.Errorf("untracked: %d of %d links missing at kubelet start", missing, len(set.names))
		}
		k0, _ := base.kubeletDelay()
		k1, _ := tracked.kubeletDelay()
		k2, _ := untracked.kubeletDelay()
		r.figures = append(r.figures, fmt.Sprintf("untracked devices: boot cost %s with PID 1 tracking the devices (%s loop device units), %s without (%s loop device units)",
			secs(k1-k0), tracked.Facts["s9.deviceUnits"], secs(k2-k0), untracked.Facts["s9.deviceUnits"]))
		if c0, c1 := base.kubelet.cpu, untracked.kubelet.cpu; c0["busy"] > 0 && c1["busy"] > 0 {
			delta := func(k string) string { return fmt.Sprintf("%+.2f s", (c1[k] - c0[k]).Seconds()) }
			r.figures = append(r.figures, fmt.Sprintf(
				"untracked devices: CPU time until kubelet start, with - without volumes: all CPUs busy %s; systemd (PID 1) %s, udevd %s; sparsevol-boot.service %s",
				delta("busy"), delta("init.scope"), delta("systemd-udevd.service"), secs(c1["sparsevol-boot.service"])))
		}
	},
})
