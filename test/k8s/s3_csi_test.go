//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 3: CSI mode, the plugin as the DaemonSet's pod. Dynamically
// provisioned volumes (WaitForFirstConsumer): ext4, XFS and block, through
// deploy/kubernetes' StorageClasses; their pods are back after the reboot
// with their data. Scenario 3b grows the ext4 one.
var (
	s3Setup = vmrun.Step{Name: "s3-setup", Timeout: short, Script: `
	local mode token
	for mode in fs xfs block; do
		pvc_manifest "csi-$mode" "$(sc_of "$mode")" "$(size_of "$mode")" "$(kind_of "$mode")" | k apply -f - || die "apply pvc csi-$mode"
		token=$(new_token)
		echo "$token" >"$STATE/token-csi-$mode"
		pod_manifest "pod-csi-$mode" "csi-$mode" "$(kind_of "$mode")" "$token" | k apply -f - || die "apply pod-csi-$mode"
	done
	for mode in fs xfs block; do
		if ! wait_pod_ready "pod-csi-$mode" 300; then
			fact "${mode}_ready" no
			continue
		fi
		fact "${mode}_ready" yes
		fact "${mode}_ready_uptime" "$(up)"
		fact "${mode}_data" "$(same_token "pod-csi-$mode" "$(kind_of "$mode")" "$(cat "$STATE/token-csi-$mode")")"
		fact "${mode}_volume" "$(k get pv "$(k get pvc "csi-$mode" -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.volumeHandle}')"
	done
	sparsevol list
`}
	s3Check = vmrun.Step{Name: "s3-check", Timeout: short, Script: `
	local mode
	for mode in fs xfs block; do
		if ! wait_pod_ready "pod-csi-$mode" 600; then
			fact "${mode}_ready" no
			continue
		fi
		fact "${mode}_ready" yes
		fact "${mode}_ready_uptime" "$(uptime_at "$(k get pod "pod-csi-$mode" -o jsonpath='{.status.conditions[?(@.type=="Ready")].lastTransitionTime}')")"
		fact "${mode}_data" "$(found_same_token "pod-csi-$mode" "$(kind_of "$mode")" "$(cat "$STATE/token-csi-$mode")")"
	done
`}
)

var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID:    "3-csi-mode",
	Steps: []vmrun.Placed{vmrun.At("b1-setup", s3Setup), vmrun.At("b2-after-reboot", s3Check)},
	Check: func(t *testing.T, r *run) {
		b1, ok1 := r.step(t, "s3-setup")
		b2, ok2 := r.step(t, "s3-check")
		if !ok1 || !ok2 {
			return
		}
		all := []string{"fs_ready", "yes", "fs_data", "same", "xfs_ready", "yes", "xfs_data", "same", "block_ready", "yes", "block_data", "same"}
		vmrun.Expect(t, b1, "s3-setup", all...)
		if vmrun.Expect(t, b2, "s3-check", all...) {
			f := b2.Step("s3-check").Facts
			r.fig("scenario 3 (CSI, plugin pod): ext4 pod Ready %ss after boot (data %s), XFS %ss (%s), block %ss (%s)",
				f["fs_ready_uptime"], f["fs_data"], f["xfs_ready_uptime"], f["xfs_data"], f["block_ready_uptime"], f["block_data"])
		}
	},
})

// Scenario 3b: node expansion without external-resizer. The test plays the
// resizer's part for a volume whose plugin needs no controller-side work
// (it does the file, loop and filesystem growth at NodeExpandVolume):
// raise the PVC, set the PV's capacity and mark the claim as waiting for
// the node, then kubelet calls NodeExpandVolume and records the new size.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "3b-csi-node-expansion",
	Steps: []vmrun.Placed{
		vmrun.At("b1-setup", s3Setup),
		vmrun.At("b2-after-reboot", s3Check),
		vmrun.At("b2-after-reboot", vmrun.Step{Name: "s3-expand", Timeout: short, Script: `
	local pv before after i
	pv=$(k get pvc csi-fs -o jsonpath='{.spec.volumeName}')
	before=$(k exec pod-csi-fs -- df -k /data | awk 'NR==2{print $2}')
	fact size_before_kib "$before"
	k patch pvc csi-fs --type merge -p '{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}' || die "raise pvc"
	k patch pvc csi-fs --subresource=status --type merge -p '{"status":{"allocatedResources":{"storage":"128Mi"},"allocatedResourceStatuses":{"storage":"NodeResizePending"}}}' || die "mark pvc NodeResizePending"
	k patch pv "$pv" --type merge -p '{"spec":{"capacity":{"storage":"128Mi"}}}' || die "raise pv capacity"
	for ((i = 0; i < 180; i++)); do
		after=$(k exec pod-csi-fs -- df -k /data 2>/dev/null | awk 'NR==2{print $2}')
		[ -n "$after" ] && [ "$after" -gt $((before + 32768)) ] && break
		sleep 1
	done
	fact size_after_kib "${after:-?}"
	k get pvc csi-fs -o jsonpath='{.status}'; echo
	if [ -n "$after" ] && [ "$after" -gt $((before + 32768)) ]; then
		fact grown yes
	else
		fact grown no
		debug_pod pod-csi-fs
	fi
	fact pvc_capacity "$(k get pvc csi-fs -o jsonpath='{.status.capacity.storage}')"
`}),
	},
	Check: func(t *testing.T, r *run) {
		b2, ok := r.step(t, "s3-expand")
		if ok && vmrun.Expect(t, b2, "s3-expand", "grown", "yes") {
			f := b2.Step("s3-expand").Facts
			r.fig("scenario 3b (NodeExpandVolume, the test as resizer): ext4 %s KiB -> %s KiB, PVC capacity %s",
				f["size_before_kib"], f["size_after_kib"], f["pvc_capacity"])
		}
	},
})
