//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 11: the plugin's pod is force-deleted (kubectl delete pod
// --force) while five claims are being provisioned. The DaemonSet brings a
// new pod; all five claims end Bound and their pods Ready with their data;
// no volume without a PV is left in the store, and no loop device backs a
// file the store does not know.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "11-plugin-killed-while-provisioning",
	Steps: []vmrun.Placed{
		vmrun.At("b2-after-reboot", vmrun.Step{Name: "s11-killed", Timeout: long, Script: `
	local i ready=0 data=0 bound=0 handles store backing old
	for i in 1 2 3 4 5; do
		pvc_manifest "kill-$i" sparsevol-ext4 32Mi fs | k apply -f - || die "apply pvc kill-$i"
		new_token >"$STATE/token-kill-$i"
		pod_manifest "pod-kill-$i" "kill-$i" fs "$(cat "$STATE/token-kill-$i")" | k apply -f - || die "apply pod-kill-$i"
	done
	# The scheduler picks the node, then the provisioner creates: kill
	# the plugin's pod (plugin and provisioner) as soon as one claim is
	# on its way.
	retry 120 sh -c "kubectl get pvc kill-1 kill-2 kill-3 kill-4 kill-5 -o jsonpath='{.items[*].metadata.annotations.volume\.kubernetes\.io/selected-node}' | grep -q ." || fail "no claim got a node"
	fact bound_at_kill "$(k get pvc kill-1 kill-2 kill-3 kill-4 kill-5 -o jsonpath='{.items[*].status.phase}' | tr ' ' '\n' | grep -c Bound)"
	old=$(plugin_pod)
	k -n "$PLUGIN_NS" delete pod -l "$PLUGIN_SELECTOR" --force --grace-period=0 || die "force-delete the plugin's pod"
	fact plugin_back "$(yesno wait_plugin 300 "$old")"
	for i in 1 2 3 4 5; do
		wait_pod_ready "pod-kill-$i" 600 || continue
		ready=$((ready + 1))
		[ "$(same_token "pod-kill-$i" fs "$(cat "$STATE/token-kill-$i")")" = same ] && data=$((data + 1))
	done
	bound=$(k get pvc kill-1 kill-2 kill-3 kill-4 kill-5 -o jsonpath='{.items[*].status.phase}' | tr ' ' '\n' | grep -c Bound)
	fact bound "$bound/5"
	fact ready "$ready/5"
	fact data "$data/5"
	# No debris: every CSI volume of the store is a PV's; every loop
	# device backs a file of a volume of the store, by name: a device the
	# plugin's pod attached shows its file as /<uuid> here (opened through
	# the pod's mount of the store). kubelet's own loop devices over a
	# block volume's device file (volumeDevices/) are not the plugin's.
	handles=$(k get pv -o jsonpath='{range .items[*]}{.spec.csi.volumeHandle}{"\n"}{end}' | grep . | sort -u)
	store=$(sparsevol list -o json | jq -r '.[] | select(.labels["sparsevol.io/managed-by"] != null) | .uuid' | sort -u)
	fact leaked_volumes "$(comm -13 <(echo "$handles") <(echo "$store") | grep . | oneline | grep . || echo none)"
	backing=$(sparsevol list -o json | jq -r '.[].backingFile' | xargs -rn1 basename | sort -u)
	fact leaked_devices "$(losetup -l -n -O BACK-FILE | sed 's/ *(deleted)$//; s/ *$//' | grep . |
		grep -v '^/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/' | xargs -rn1 basename | sort -u |
		comm -23 - <(echo "$backing") | oneline | grep . || echo none)"
	sparsevol list
	losetup -l -n
	plugin_log csi-provisioner 30
`}),
	},
	Check: func(t *testing.T, r *run) {
		b, ok := r.step(t, "s11-killed")
		if !ok {
			return
		}
		if vmrun.Expect(t, b, "s11-killed", "plugin_back", "yes", "bound", "5/5", "ready", "5/5", "data", "5/5",
			"leaked_volumes", "none", "leaked_devices", "none") {
			f := b.Step("s11-killed").Facts
			r.fig("scenario 11 (plugin pod force-deleted while provisioning, %s of 5 Bound then): 5/5 Bound, Ready with data; no leaked volume or device",
				f["bound_at_kill"])
		}
	},
})
