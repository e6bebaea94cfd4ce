//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 5: snapshots and clones through the cluster's own machinery
// (snapshot CRDs from external-snapshotter's client module,
// snapshot-controller with --enable-distributed-snapshotting, this node's
// csi-snapshotter --node-deployment; units/). A claim is written, a
// VolumeSnapshot of it becomes ready, then the claim changes: a claim
// restored from the snapshot holds what was there before, a claim cloned
// from the claim what is there now. After the reboot the snapshot is still
// ready and restores again; deleting it removes its file from the store.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "5-snapshots",
	Steps: []vmrun.Placed{
		vmrun.At("b1-setup", vmrun.Step{Name: "s5-setup", Timeout: short, Script: `
	local t1 t2 t0 v
	k apply --server-side -f "$CRDS/" || die "apply the snapshot CRDs"
	k wait --for condition=established --timeout=120s crd/volumesnapshots.snapshot.storage.k8s.io \
		crd/volumesnapshotcontents.snapshot.storage.k8s.io crd/volumesnapshotclasses.snapshot.storage.k8s.io || die "snapshot CRDs not established"
	k apply -f "$DEPLOY/snapshotclass.yaml" || die "apply deploy/kubernetes/snapshotclass.yaml"

	pvc_manifest snap-src sparsevol-ext4 64Mi fs | k apply -f - || die "apply pvc snap-src"
	t1=$(new_token)
	echo "$t1" >"$STATE/token-snap-1"
	pod_manifest pod-snap-src snap-src fs "$t1" | k apply -f - || die "apply pod-snap-src"
	wait_pod_ready pod-snap-src 300 || die "pod-snap-src not ready"

	t0=$(date +%s)
	snapshot_manifest snap-1 snap-src | k apply -f - || die "apply volumesnapshot snap-1"
	if snapshot_ready snap-1 300; then
		fact snapshot_ready yes
		fact snapshot_ready_seconds $(($(date +%s) - t0))
	else
		fact snapshot_ready no
		debug_snapshot snap-1
		return
	fi
	fact snapshot_handle "$(k get volumesnapshotcontent "$(k get volumesnapshot snap-1 -o jsonpath='{.status.boundVolumeSnapshotContentName}')" -o jsonpath='{.status.snapshotHandle}')"

	# The claim changes after the snapshot: the clone sees this, the
	# restore must not.
	t2=$(new_token)
	echo "$t2" >"$STATE/token-snap-2"
	k exec pod-snap-src -- sh -c "echo $t2 >/data/token && sync" || die "rewrite the source's token"

	restore_manifest snap-restored 64Mi VolumeSnapshot snap-1 | k apply -f - || die "apply pvc snap-restored"
	restore_manifest snap-clone 64Mi PersistentVolumeClaim snap-src | k apply -f - || die "apply pvc snap-clone"
	pod_manifest pod-snap-restored snap-restored fs "$t1" | k apply -f - || die "apply pod-snap-restored"
	pod_manifest pod-snap-clone snap-clone fs "$t2" | k apply -f - || die "apply pod-snap-clone"
	if wait_pod_ready pod-snap-restored 300; then
		fact restored_data "$(found_same_token pod-snap-restored fs "$t1")"
	else
		fact restored_data "pod not ready"
	fi
	if wait_pod_ready pod-snap-clone 300; then
		fact clone_data "$(found_same_token pod-snap-clone fs "$t2")"
	else
		fact clone_data "pod not ready"
	fi
	for v in snap-src snap-restored snap-clone; do
		echo "$v: $(k get pv "$(k get pvc "$v" -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.volumeHandle}')"
	done
	sparsevol list
	ls -la /var/lib/sparsevol/.snapshots
`}),
		vmrun.At("b2-after-reboot", vmrun.Step{Name: "s5-check", Timeout: short, Script: `
	local t1 i left
	t1=$(cat "$STATE/token-snap-1")
	# The restored claim's pod is back with the snapshot's data.
	if wait_pod_ready pod-snap-restored 600; then
		fact restored_back "$(found_same_token pod-snap-restored fs "$t1")"
	else
		fact restored_back "pod not ready"
	fi
	# The snapshot survived the reboot and still restores.
	if snapshot_ready snap-1 120; then fact snapshot_ready yes; else fact snapshot_ready no; debug_snapshot snap-1; fi
	restore_manifest snap-restored-2 64Mi VolumeSnapshot snap-1 | k apply -f - || die "apply pvc snap-restored-2"
	pod_manifest pod-snap-restored-2 snap-restored-2 fs "$t1" | k apply -f - || die "apply pod-snap-restored-2"
	if wait_pod_ready pod-snap-restored-2 300; then
		fact restored_again "$(found_same_token pod-snap-restored-2 fs "$t1")"
	else
		fact restored_again "pod not ready"
	fi
	# Deleting the snapshot removes its content object and its file.
	k delete volumesnapshot snap-1 --wait=true --timeout=120s || fail "delete volumesnapshot snap-1"
	for ((i = 0; i < 120; i++)); do
		left=$(k get volumesnapshotcontent -o name 2>/dev/null)
		[ -z "$left" ] && break
		sleep 1
	done
	fact contents_left "${left:-none}"
	ls -la /var/lib/sparsevol/.snapshots
	fact store_snapshots_left "$(ls -A /var/lib/sparsevol/.snapshots 2>/dev/null | oneline | grep . || echo none)"
`}),
	},
	Check: func(t *testing.T, r *run) {
		b1, ok1 := r.step(t, "s5-setup")
		b2, ok2 := r.step(t, "s5-check")
		if !ok1 || !ok2 {
			return
		}
		if vmrun.Expect(t, b1, "s5-setup", "snapshot_ready", "yes", "restored_data", "same", "clone_data", "same") {
			r.fig("scenario 5 (snapshots): VolumeSnapshot ready in %ss; restored claim holds the snapshot's data, cloned claim the source's later data",
				b1.Step("s5-setup").Facts["snapshot_ready_seconds"])
		}
		if vmrun.Expect(t, b2, "s5-check", "restored_back", "same", "snapshot_ready", "yes", "restored_again", "same",
			"contents_left", "none", "store_snapshots_left", "none") {
			r.fig("scenario 5 (snapshots): after the reboot the snapshot is ready and restores again; deleted, it leaves no content object and no file")
		}
	},
})
