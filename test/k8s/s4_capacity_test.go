//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 4: capacity. CSIStorageCapacity for the node and the class,
// published by the plugin pod's provisioner; a
// claim larger than the node can give stays Pending, with a clear event,
// and nothing is created on disk.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "4-capacity",
	Steps: []vmrun.Placed{
		vmrun.At("b1-setup", vmrun.Step{Name: "s4-capacity", Timeout: short, Script: `
	local i n files_before files_after msg
	for ((i = 0; i < 180; i++)); do
		n=$(k get csistoragecapacities -A -o json | jq '[.items[] | select(.storageClassName=="sparsevol-ext4")] | length')
		[ "${n:-0}" -gt 0 ] && break
		sleep 1
	done
	k get csistoragecapacities -A -o yaml
	fact capacity_objects "${n:-0}"
	fact capacity "$(k get csistoragecapacities -A -o json | jq -r '[.items[] | select(.storageClassName=="sparsevol-ext4")][0].capacity')"
	fact capacity_topology "$(k get csistoragecapacities -A -o json | jq -c '[.items[] | select(.storageClassName=="sparsevol-ext4")][0].nodeTopology')"
	# Published by the pod's provisioner: owned by its DaemonSet
	# (--capacity-ownerref-level=1), in the plugin's namespace.
	fact capacity_owner "$(k get csistoragecapacities -A -o json | jq -r '[.items[] | select(.storageClassName=="sparsevol-ext4")][0] | "\(.metadata.namespace)/\(.metadata.ownerReferences[0].kind)/\(.metadata.ownerReferences[0].name)"')"
	files_before=$(ls -A /var/lib/sparsevol | sort | tr '\n' ' ')
	pvc_manifest csi-huge sparsevol-ext4 100Ti fs | k apply -f - || die "apply pvc"
	pod_manifest pod-huge csi-huge fs "$(new_token)" | k apply -f - || die "apply pod"
	for ((i = 0; i < 120; i++)); do
		msg=$(k get events --field-selector involvedObject.name=pod-huge -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' 2>/dev/null | grep -i 'storage' | tail -n 1)
		[ -n "$msg" ] && break
		sleep 1
	done
	debug_pod pod-huge
	fact event_found "$([ -n "$msg" ] && echo yes || echo no)"
	fact event "$msg"
	sleep 10
	fact pvc_phase "$(k get pvc csi-huge -o jsonpath='{.status.phase}')"
	fact pod_phase "$(k get pod pod-huge -o jsonpath='{.status.phase}')"
	files_after=$(ls -A /var/lib/sparsevol | sort | tr '\n' ' ')
	fact store_unchanged "$([ "$files_before" = "$files_after" ] && echo yes || echo "no: [$files_before] -> [$files_after]")"
	k delete pod pod-huge --wait=true --timeout=60s
	k delete pvc csi-huge --wait=true --timeout=60s
`}),
	},
	Check: func(t *testing.T, r *run) {
		b1, ok := r.step(t, "s4-capacity")
		if !ok {
			return
		}
		f := b1.Step("s4-capacity").Facts
		if f["capacity_objects"] == "" || f["capacity_objects"] == "0" {
			vmrun.Expect(t, b1, "s4-capacity", "capacity_objects", "1 or more")
		}
		if vmrun.Expect(t, b1, "s4-capacity", "capacity_owner", "sparsevol/DaemonSet/sparsevol-csi",
			"event_found", "yes", "pvc_phase", "Pending", "store_unchanged", "yes") {
			r.fig("scenario 4 (capacity): %s CSIStorageCapacity object(s), capacity %s, topology %s; 100Ti claim %s, pod %s: %q; store unchanged: %s",
				f["capacity_objects"], f["capacity"], f["capacity_topology"], f["pvc_phase"], f["pod_phase"], f["event"], f["store_unchanged"])
		}
	},
})
