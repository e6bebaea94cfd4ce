//go:build e2e

package vm

import (
	"fmt"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 5: stop and delete. The volumes of scenario 2, once back after
// their reboot, are restarted (after the boot is marked done), stopped and
// deleted; one more reboot must not bring anything back.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "5-stop-and-delete",
	Steps: []vmrun.Placed{
		vmrun.At("b2-baseline", s2Setup),
		vmrun.At("b3-after-clean-reboot", s2Check),
		vmrun.At("b3-after-clean-reboot", vmrun.Step{Name: "s5-stop-delete", Timeout: short, Script: `
			local n uuid link
			# The units came up in boot mode (no process of their own); once the
			# boot is over a restart must run their own detach and attach again.
			run systemctl start sparsevol-boot-done.service
			fact s5.bootDone "$(yesno test -e /run/sparsevol/boot-done)"
			for n in $(vols_of s2); do
				uuid=$(vget "$n" uuid)
				link=$(link_of "$n")
				run systemctl restart "sparsevol@$uuid.service"
				fact "$n.restartExit" "$?"
				fact "$n.afterRestart.loops" "$(losetup --list --noheadings --raw --output NAME,BACK-FILE | grep -F "$uuid" | oneline)"
				[ -n "$link" ] && fact "$n.afterRestart.link" "$(yesno test -e "$link")"
				run systemctl stop "sparsevol@$uuid.service"
				fact "$n.stopExit" "$?"
				run udevadm settle
				fact "$n.afterStop.unitActive" "$(systemctl is-active "sparsevol@$uuid.service")"
				fact "$n.afterStop.loops" "$(losetup --list --noheadings --raw --output NAME,BACK-FILE | grep -F "$uuid" | oneline)"
				[ -n "$link" ] && fact "$n.afterStop.link" "$(yesno test -e "$link")"
				status_facts "$n" "$n.afterStop"
				sv "$n" delete "$uuid"
				fact "$n.deleteExit" "$?"
				run udevadm settle
				gone_facts "$n" "$n.afterDelete"
			done
		`}),
		vmrun.At("b4-after-hard-reset", vmrun.Step{Name: "s5-check-gone", Timeout: short, Script: `
			local n
			run udevadm settle
			for n in $(vols_of s2); do gone_facts "$n" "$n.afterReboot"; done
		`}),
	},
	Check: checkStopDelete,
})

func checkStopDelete(t *testing.T, r *run) {
	setup := r.ran(t, "s2-setup")
	mid := r.ran(t, "s5-stop-delete")
	after := r.ran(t, "s5-check-gone")
	names := volumesOf(setup, "s2")
	if len(names) != 4 {
		t.Errorf("boot %s made %d volumes (%v), want 4", setup.Spec.Name, len(names), names)
	}
	for _, n := range names {
		uuid := setup.Facts[n+".uuid"]
		kind := setup.Facts[n+".kind"]
		checkBack(t, setup, mid, n)
		var problems []string
		add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
		f := mid.Facts
		if f["s5.bootDone"] != "yes" {
			add("the boot was not marked done after %s ran", "sparsevol-boot-done.service")
		}
		if f[n+".restartExit"] != "0" || f[n+".afterRestart.loops"] == "" {
			add("systemctl restart after the boot exited %s and left loop devices %q; want the volume attached again", f[n+".restartExit"], f[n+".afterRestart.loops"])
		}
		if f[n+".afterRestart.link"] == "no" {
			add("after restart %s is missing", linkOf(kind, uuid))
		}
		if f[n+".stopExit"] != "0" {
			add("systemctl stop exited %s", f[n+".stopExit"])
		}
		if st := f[n+".afterStop.unitActive"]; st != "inactive" {
			add("after stop the unit is %q, want inactive", st)
		}
		if l := f[n+".afterStop.loops"]; l != "" {
			add("after stop a loop device is still attached: %s", l)
		}
		if f[n+".afterStop.link"] == "yes" {
			add("after stop %s still exists", linkOf(kind, uuid))
		}
		if a := f[n+".afterStop.attached"]; a != "false" {
			add("after stop sparsevol status says attached=%s", a)
		}
		if f[n+".deleteExit"] != "0" {
			add("sparsevol delete exited %s", f[n+".deleteExit"])
		}
		problems = append(problems, goneProblems(f, n+".afterDelete", "after delete")...)
		problems = append(problems, goneProblems(after.Facts, n+".afterReboot", "after one more reboot")...)
		unit := "sparsevol@" + uuid + ".service"
		if after.kubelet.ran {
			if st, ok := after.kubelet.units[unit]; ok && st != "inactive" {
				add("after one more reboot, at kubelet start, unit %s is %s", unit, st)
			}
			for l := range after.kubelet.links {
				if strings.Contains(l, uuid) {
					add("after one more reboot, at kubelet start, %s exists", l)
				}
			}
		}
		if len(problems) > 0 {
			t.Errorf("volume %s (%s, uuid %s):\n  - %s\n  journal of %s in boot %s:\n%s", n, kind, uuid,
				strings.Join(problems, "\n  - "), unit, mid.Spec.Name, mid.journal(uuid))
		} else {
			t.Logf("volume %s (%s): stop detached it, delete removed it, nothing left after a reboot", n, kind)
		}
	}
}

// goneProblems lists the traces a deleted volume left, from the facts
// gone_facts recorded under p.
func goneProblems(f map[string]string, p, when string) []string {
	var out []string
	add := func(format string, args ...any) { out = append(out, when+": "+fmt.Sprintf(format, args...)) }
	if st := f[p+".unitActive"]; st == "active" || st == "activating" || st == "" {
		add("unit is %q", st)
	}
	if st := f[p+".unitEnabled"]; st == "enabled" || st == "enabled-runtime" || st == "" {
		add("unit is-enabled says %q", st)
	}
	if l := f[p+".unitLinks"]; l != "" {
		add("unit links remain: %s", l)
	}
	if f[p+".fileExists"] != "no" {
		add("backing file exists=%s", f[p+".fileExists"])
	}
	if s := f[p+".storeFiles"]; s != "" {
		add("files of the volume remain in the store: %s", s)
	}
	if l := f[p+".loops"]; l != "" {
		add("loop devices remain: %s", l)
	}
	if l := f[p+".links"]; l != "" {
		add("stale /dev/disk links: %s", l)
	}
	if l := f[p+".listed"]; l != "0" {
		add("sparsevol list shows it (%s)", l)
	}
	return out
}
