//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 12: uninstall and install again. Scenario 3's pods go, then
// kubectl delete -k removes the driver (DaemonSet, CSIDriver, classes,
// RBAC, namespace); the volumes and their data stay in the store. kubectl
// apply -k again: the same claims' new pods start with their data.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "12-uninstall-keeps-data",
	Steps: []vmrun.Placed{
		vmrun.At("b1-setup", s3Setup),
		vmrun.At("b2-after-reboot", vmrun.Step{Name: "s12-uninstall", Timeout: long, Script: `
	local mode h kept=0 handles="" attached
	for mode in fs xfs block; do
		handles="$handles $(k get pv "$(k get pvc "csi-$mode" -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.volumeHandle}')"
	done
	# The pods first: unmounting their volumes is the plugin's work.
	k delete pod pod-csi-fs pod-csi-xfs pod-csi-block --ignore-not-found --wait=true --timeout=180s || fail "delete scenario 3's pods"
	for h in $handles; do
		retry 120 sh -c "[ \"\$(sparsevol status $h -o json | jq -r .attached)\" = false ]" || echo "volume $h still attached"
	done
	if k delete -k "$OVERLAY" --wait=true --timeout=300s; then fact uninstalled yes; else fact uninstalled no; fi
	fact driver_gone "$(yesno retry 120 sh -c '! kubectl get csidriver sparsevol.csi.io >/dev/null 2>&1 && ! kubectl get ns sparsevol >/dev/null 2>&1')"
	for h in $handles; do
		sparsevol status "$h" >/dev/null && [ -e "$(sparsevol status "$h" -o json | jq -r .backingFile)" ] && kept=$((kept + 1))
	done
	fact volumes_kept "$kept/3"
	sparsevol list
	k apply -k "$OVERLAY" || die "kubectl apply -k again"
	fact reinstalled "$(yesno wait_plugin 600)"
	for mode in fs xfs block; do
		pod_manifest "pod-csi-$mode" "csi-$mode" "$(kind_of "$mode")" "$(cat "$STATE/token-csi-$mode")" | k apply -f - || die "apply pod-csi-$mode"
	done
	for mode in fs xfs block; do
		if wait_pod_ready "pod-csi-$mode" 600; then
			fact "${mode}_data" "$(found_same_token "pod-csi-$mode" "$(kind_of "$mode")" "$(cat "$STATE/token-csi-$mode")")"
		else
			fact "${mode}_data" "pod not Ready"
		fi
	done
`}),
	},
	Check: func(t *testing.T, r *run) {
		b, ok := r.step(t, "s12-uninstall")
		if !ok {
			return
		}
		if vmrun.Expect(t, b, "s12-uninstall", "uninstalled", "yes", "driver_gone", "yes", "volumes_kept", "3/3",
			"reinstalled", "yes", "fs_data", "same", "xfs_data", "same", "block_data", "same") {
			r.fig("scenario 12 (kubectl delete -k, then apply -k): 3/3 volumes kept in the store; the claims' new pods found their data")
		}
	},
})
