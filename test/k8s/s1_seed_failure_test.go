//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 1: the seed's failure, reproduced with Kubernetes. A node-mode
// volume whose unit is disabled (nothing re-attaches it at boot): its pod
// runs before the reboot; after it the pod is stuck and kubelet says why.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "1-seed-failure-reproduced",
	Steps: []vmrun.Placed{
		vmrun.At("b1-setup", vmrun.Step{Name: "s1-setup", Timeout: short, Script: `node_mode_setup s1 no`}),
		vmrun.At("b2-after-reboot", vmrun.Step{Name: "s1-check", Timeout: short, Script: `
	local uuid i msg
	uuid=$(sparsevol status s1 -o json | jq -r .uuid)
	fact attached "$(sparsevol status s1 -o json | jq -r .attached)"
	fact stable_path_exists "$(yesno test -e "/dev/disk/by-uuid/$uuid")"
	for ((i = 0; i < 240; i++)); do
		msg=$(k get events --field-selector involvedObject.name=pod-s1 -o jsonpath='{range .items[*]}{.message}{"\n"}{end}' 2>/dev/null |
			grep -F "/dev/disk/by-uuid/$uuid" | grep -F 'does not exist' | tail -n 1)
		[ -n "$msg" ] && break
		sleep 1
	done
	debug_pod pod-s1
	fact event_found "$([ -n "$msg" ] && echo yes || echo no)"
	fact event_uptime "$(up)"
	fact event "$msg"
	fact pod_ready "$(yesno pod_ready_this_boot pod-s1)"
	fact phase "$(k get pod pod-s1 -o jsonpath='{.status.phase}')"
	fact waiting_reason "$(k get pod pod-s1 -o jsonpath='{.status.containerStatuses[0].state.waiting.reason}')"
	return 0
`}),
	},
	Check: func(t *testing.T, r *run) {
		b1, ok1 := r.step(t, "s1-setup")
		b2, ok2 := r.step(t, "s1-check")
		if !ok1 || !ok2 {
			return
		}
		vmrun.Expect(t, b1, "s1-setup", "unit_enabled", "disabled", "pod_ready", "yes", "data", "same")
		// After the reboot the volume is not back, and kubelet says why.
		vmrun.Expect(t, b2, "s1-check", "stable_path_exists", "no", "pod_ready", "no", "event_found", "yes")
		f := b2.Step("s1-check").Facts
		vmrun.Logf(t, "scenario 1: unit %s; after the reboot pod-s1 is %s/%s; kubelet at %ss: %s",
			b1.Step("s1-setup").Facts["unit_enabled"], f["phase"], f["waiting_reason"], f["event_uptime"], f["event"])
	},
})
