//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 2: the fix in node mode. The same volume with its unit enabled
// is back after the reboot, and so is its pod with the data.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "2-node-mode-fix",
	Steps: []vmrun.Placed{
		vmrun.At("b1-setup", vmrun.Step{Name: "s2-setup", Timeout: short, Script: `node_mode_setup s2 yes`}),
		vmrun.At("b2-after-reboot", vmrun.Step{Name: "s2-check", Timeout: short, Script: `
	local token
	token=$(cat "$STATE/token-s2")
	if ! wait_pod_ready pod-s2 600; then
		fact pod_ready no
		return 0
	fi
	fact pod_ready yes
	fact pod_ready_uptime "$(uptime_at "$(k get pod pod-s2 -o jsonpath='{.status.conditions[?(@.type=="Ready")].lastTransitionTime}')")"
	fact started_uptime "$(uptime_at "$(k get pod pod-s2 -o jsonpath='{.status.containerStatuses[0].state.running.startedAt}')")"
	fact data "$(found_same_token pod-s2 fs "$token")"
	k logs pod-s2 | head -n 3
	# The unit's own verdict at boot (the pod can come back even when the
	# unit failed late, e.g. on the udev wait).
	fact unit_state "$(systemctl show -p ActiveState,Result "sparsevol@$(sparsevol status s2 -o json | jq -r .uuid).service" | tr '\n' ' ')"
	journalctl -b --no-pager -u "sparsevol@$(sparsevol status s2 -o json | jq -r .uuid).service" | tail -n 5
`}),
	},
	Check: func(t *testing.T, r *run) {
		b1, ok1 := r.step(t, "s2-setup")
		b2, ok2 := r.step(t, "s2-check")
		if !ok1 || !ok2 {
			return
		}
		vmrun.Expect(t, b1, "s2-setup", "unit_enabled", "enabled", "pod_ready", "yes", "data", "same")
		if vmrun.Expect(t, b2, "s2-check", "pod_ready", "yes", "data", "same") {
			f := b2.Step("s2-check").Facts
			r.fig("scenario 2 (node mode, unit enabled): pod Ready %ss after boot (container started at %ss), data %s; unit %s",
				f["pod_ready_uptime"], f["started_uptime"], f["data"], f["unit_state"])
		}
	},
})
