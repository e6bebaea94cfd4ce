//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 10: plugin upgrade under load. A pod writes and fsyncs its
// volume every 100 ms; the DaemonSet's plugin image changes to the second
// build (another version string) and rolls. The writer sees no error and
// its writes keep landing on the volume's mount, which stays mounted; the
// new plugin registers and answers kubelet's NodeGetVolumeStats.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "10-plugin-upgrade",
	Steps: []vmrun.Placed{
		vmrun.At("b2-after-reboot", vmrun.Step{Name: "s10-upgrade", Timeout: short, Script: `
	local uid pv mnt src old new c0 c1 i n started
	pvc_manifest csi-writer sparsevol-ext4 64Mi fs | k apply -f - || die "apply pvc csi-writer"
	k apply -f - <<'YAML' || die "apply pod writer"
apiVersion: v1
kind: Pod
metadata:
  name: writer
spec:
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: localhost/busybox:1
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", "trap 'exit 0' TERM; i=0; while :; do i=$((i+1)); if ! echo $i | dd of=/data/counter conv=fsync 2>/tmp/err; then echo \"write-error $i: $(cat /tmp/err)\"; fi; sleep 0.1; done"]
    volumeMounts:
    - name: vol
      mountPath: /data
  volumes:
  - name: vol
    persistentVolumeClaim:
      claimName: csi-writer
YAML
	if ! wait_pod_ready writer 300; then
		fact writer_ready no
		return 0
	fi
	fact writer_ready yes
	uid=$(k get pod writer -o jsonpath='{.metadata.uid}')
	pv=$(k get pvc csi-writer -o jsonpath='{.spec.volumeName}')
	mnt="/var/lib/kubelet/pods/$uid/volumes/kubernetes.io~csi/$pv/mount"
	src=$(findmnt -n -o SOURCE --mountpoint "$mnt")
	echo "writer's volume: $src on $mnt"
	old=$(plugin_pod)
	c0=$(cat "$mnt/counter")
	started=$(date +%s)
	k -n "$PLUGIN_NS" set image ds/sparsevol-csi sparsevol=localhost/sparsevol:2 || die "set the plugin image"
	if k -n "$PLUGIN_NS" rollout status ds/sparsevol-csi --timeout=300s; then fact rolled yes; else fact rolled no; fi
	fact rollout_seconds "$(($(date +%s) - started))"
	new=$(plugin_pod)
	fact pod_replaced "$([ -n "$new" ] && [ "$new" != "$old" ] && echo yes || echo "no: $old -> $new")"
	fact new_image "$(k -n "$PLUGIN_NS" get pod "$new" -o jsonpath='{.spec.containers[0].image}')"
	fact new_version "$(k -n "$PLUGIN_NS" logs "$new" -c sparsevol 2>/dev/null | grep -o 'version=[^ ]*' | head -n 1)"
	fact reregistered "$(yesno wait_plugin 180 "$old")"
	sleep 3
	c1=$(cat "$mnt/counter")
	fact writes_progressed "$([ "${c1:-0}" -gt "${c0:-0}" ] 2>/dev/null && echo yes || echo "no: $c0 -> $c1")"
	fact still_mounted "$([ -n "$src" ] && [ "$(findmnt -n -o SOURCE --mountpoint "$mnt")" = "$src" ] && echo yes || echo no)"
	fact writer_errors "$(k logs writer | grep -c write-error)"
	fact writer_restarts "$(k get pod writer -o jsonpath='{.status.containerStatuses[0].restartCount}')"
	# kubelet asks for volume stats about once a minute.
	for ((i = 0; i < 180; i++)); do
		n=$(plugin_metrics 2>/dev/null | awk '/^sparsevol_csi_operations_total\{code="OK",method="NodeGetVolumeStats"\}/ {print $2}')
		[ -n "$n" ] && break
		sleep 1
	done
	fact stats_answered "$([ -n "$n" ] && echo yes || echo no)"
	# kubelet's summary carries the figure from its next collection on.
	local used=""
	for ((i = 0; i < 90; i++)); do
		used=$(k get --raw "/api/v1/nodes/$NODE/proxy/stats/summary" | jq -r '.pods[] | select(.podRef.name=="writer") | .volume[]? | select(.name=="vol") | .usedBytes // empty')
		[ -n "$used" ] && break
		sleep 1
	done
	fact writer_used_bytes "${used:-none}"
	[ "$(k logs writer | grep -c write-error)" = 0 ] || k logs writer | grep write-error | head -n 5
	plugin_log sparsevol 20
	k delete pod writer --wait=true --timeout=120s || fail "delete writer"
`}),
	},
	Check: func(t *testing.T, r *run) {
		b, ok := r.step(t, "s10-upgrade")
		if !ok {
			return
		}
		if vmrun.Expect(t, b, "s10-upgrade", "writer_ready", "yes", "rolled", "yes", "pod_replaced", "yes",
			"new_image", "localhost/sparsevol:2", "new_version", "version="+pluginVersions[1], "reregistered", "yes",
			"writer_errors", "0", "writer_restarts", "0", "writes_progressed", "yes", "still_mounted", "yes",
			"stats_answered", "yes") {
			f := b.Step("s10-upgrade").Facts
			used := f["writer_used_bytes"] + " bytes used in kubelet's summary"
			if f["writer_used_bytes"] == "none" {
				used = "kubelet's summary had no figure for the volume within 90 s"
			}
			r.fig("scenario 10 (upgrade under load): rolled to %s in %ss; writer: %s errors, %s restarts; volume still mounted; new plugin answered NodeGetVolumeStats (%s)",
				f["new_version"], f["rollout_seconds"], f["writer_errors"], f["writer_restarts"], used)
		}
	},
})
