# The Kubernetes helpers of test/k8s's steps (sourced after the shared
# library, test/e2e/vmrun/guest/lib.sh, whose fact, fail, die, log and retry
# they use).
export KUBECONFIG=/etc/kubernetes/admin.kubeconfig
NODE=$(hostname)
DRIVER=sparsevol.csi.io
LIB=/usr/local/lib/sparsevol-k8s
OVERLAY=$LIB/deploy/overlay # test/k8s's overlay of deploy/kubernetes (../base)
DEPLOY=$LIB/deploy/base     # deploy/kubernetes of this checkout, as shipped
PLUGIN_NS=sparsevol
PLUGIN_SELECTOR=app.kubernetes.io/component=csi-plugin

k() { kubectl "$@"; }
boot_epoch() { date -d "$(uptime -s)" +%s; }

# uptime (seconds) at which an RFC 3339 timestamp of this boot happened.
uptime_at() {
	local t
	t=$(date -d "$1" +%s) || return 1
	echo $((t - $(boot_epoch)))
}

node_ready() {
	[ "$(k get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

# pod_ready_this_boot POD [NAMESPACE]: Ready, and its container started during this boot.
pod_ready_this_boot() {
	local ready started
	ready=$(k ${2:+-n "$2"} get pod "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)
	started=$(k ${2:+-n "$2"} get pod "$1" -o jsonpath='{.status.containerStatuses[0].state.running.startedAt}' 2>/dev/null)
	[ "$ready" = True ] && [ -n "$started" ] && [ "$(date -d "$started" +%s)" -ge "$(boot_epoch)" ]
}

# debug_pod POD: what a human needs when a pod is not where it should be.
debug_pod() {
	echo "---- pod $1"
	k get pod "$1" -o wide 2>&1
	echo "---- events of pod $1"
	k get events --field-selector involvedObject.name="$1" -o custom-columns=LAST:.lastTimestamp,TYPE:.type,REASON:.reason,FROM:.source.component,MESSAGE:.message 2>&1 | tail -n 20
	local claim
	for claim in $(k get pod "$1" -o jsonpath='{.spec.volumes[*].persistentVolumeClaim.claimName}' 2>/dev/null); do
		echo "---- events of pvc $claim"
		k get events --field-selector involvedObject.name="$claim" -o custom-columns=TYPE:.type,REASON:.reason,FROM:.source.component,MESSAGE:.message 2>&1 | tail -n 10
	done
	echo "---- plugin log (sparsevol-csi, last 40 lines)"
	plugin_log sparsevol 40
	echo "---- kubelet log about volumes (last 20 lines)"
	journalctl -b --no-pager -u kubelet 2>&1 | grep -iE 'volume|mount|csi' | tail -n 20
}

# pod_manifest NAME CLAIM MODE TOKEN: a busybox pod that writes TOKEN to its
# volume on first start and only reads it back later (file /data/token in
# filesystem mode, the first 32 bytes of /dev/xvda in block mode). Its log
# says "found TOKEN" when the volume held the token at container start, so a
# restarted container proves the data survived. (No readiness probe: exec
# probes are expensive under software emulation.)
pod_manifest() {
	local name=$1 claim=$2 mode=$3 token=$4 script mount
	if [ "$mode" = block ]; then
		script='got=$(dd if=/dev/xvda bs=32 count=1 2>/dev/null); if [ "$got" = "$TOKEN" ]; then echo "found $got"; else echo "device held [$got]; writing"; printf %s "$TOKEN" | dd of=/dev/xvda bs=32 count=1 conv=fsync 2>/dev/null; fi; got=$(dd if=/dev/xvda bs=32 count=1 2>/dev/null); [ "$got" = "$TOKEN" ] && echo ok > /tmp/ok; trap "exit 0" TERM; while :; do sleep 3600 & wait $!; done'
		mount="    volumeDevices:
    - name: vol
      devicePath: /dev/xvda"
	else
		script='if [ -f /data/token ]; then echo "found $(cat /data/token)"; else echo "$TOKEN" > /data/token; sync; echo wrote; fi; [ "$(cat /data/token)" = "$TOKEN" ] && echo ok > /tmp/ok; trap "exit 0" TERM; while :; do sleep 3600 & wait $!; done'
		mount="    volumeMounts:
    - name: vol
      mountPath: /data"
	fi
	cat <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: $name
spec:
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: localhost/busybox:1
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", $(printf '%s' "$script" | jq -Rs .)]
    env:
    - name: TOKEN
      value: "$token"
$mount
  volumes:
  - name: vol
    persistentVolumeClaim:
      claimName: $claim
YAML
}

# pvc_manifest NAME SC SIZE MODE [VOLUMENAME]
pvc_manifest() {
	cat <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: $1
spec:
  storageClassName: $2
  accessModes: [ReadWriteOnce]
  volumeMode: $([ "$4" = block ] && echo Block || echo Filesystem)
  resources:
    requests:
      storage: $3
${5:+  volumeName: $5}
YAML
}

new_token() { head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n'; }

# wait_pod_ready POD SECONDS: waits, prints the pod's story on timeout.
wait_pod_ready() {
	local i
	for ((i = 0; i < $2; i++)); do
		pod_ready_this_boot "$1" && return 0
		sleep 1
	done
	debug_pod "$1"
	return 1
}

# found_token POD TOKEN: the current container found TOKEN on its volume at
# start (it did not write it).
found_token() {
	k logs "$1" 2>/dev/null | grep -qx "found $2"
}

# read_token POD MODE: the token as the running pod sees it on its volume.
read_token() {
	if [ "$2" = block ]; then
		k exec "$1" -- dd if=/dev/xvda bs=32 count=1 2>/dev/null
	else
		k exec "$1" -- cat /data/token
	fi
}

# same_token POD MODE TOKEN: "same" when the running pod reads TOKEN from
# its volume, else what it reads.
same_token() {
	local got
	got=$(read_token "$1" "$2")
	if [ "$got" = "$3" ]; then echo same; else echo "different: [$got]"; fi
}

# found_same_token POD MODE TOKEN: same_token, once the pod's container
# found TOKEN on its volume at start (so it did not write it anew).
found_same_token() {
	if found_token "$1" "$3"; then
		same_token "$1" "$2" "$3"
	else
		k logs "$1" >&2
		echo "not found at container start"
	fi
}

# Node mode: a volume made by `sparsevol create`, a local PV from
# `sparsevol pv`, a PVC and a pod that writes a token. s1's unit is disabled
# (the seed's setup: nothing re-attaches it at boot); s2's stays enabled.
node_mode_setup() {
	local name=$1 enable=$2 uuid token
	uuid=$(sparsevol create "$name" --size 64M) || die "sparsevol create $name"
	fact uuid "$uuid"
	if [ "$enable" = no ]; then
		systemctl disable "sparsevol@$uuid.service" || die "disable unit"
	fi
	fact unit_enabled "$(systemctl is-enabled "sparsevol@$uuid.service" 2>&1)"
	sparsevol pv "$name" --storage-class local-static --name "pv-$name" >"$STATE/pv-$name.json" || die "sparsevol pv"
	cat "$STATE/pv-$name.json"
	k apply -f "$STATE/pv-$name.json" || die "apply pv"
	pvc_manifest "pvc-$name" local-static 64Mi fs "pv-$name" | k apply -f - || die "apply pvc"
	token=$(new_token)
	echo "$token" >"$STATE/token-$name"
	pod_manifest "pod-$name" "pvc-$name" fs "$token" | k apply -f - || die "apply pod"
	fact token "$token"
	if ! wait_pod_ready "pod-$name" 300; then
		fact pod_ready no
		return 0
	fi
	fact pod_ready yes
	fact pod_ready_uptime "$(up)"
	fact data "$(same_token "pod-$name" fs "$token")"
	findmnt -n -o SOURCE,TARGET | grep -F "pv-$name" || true
}

CRDS=/usr/local/lib/sparsevol-k8s/crd # snapshot CRDs from external-snapshotter's client module

# snapshot_manifest NAME CLAIM: a VolumeSnapshot of CLAIM, class sparsevol.
snapshot_manifest() {
	cat <<YAML
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata:
  name: $1
spec:
  volumeSnapshotClassName: sparsevol
  source:
    persistentVolumeClaimName: $2
YAML
}

# restore_manifest NAME SIZE KIND SOURCE: a filesystem claim of class
# sparsevol-ext4 made from a VolumeSnapshot or PersistentVolumeClaim.
restore_manifest() {
	local group=""
	[ "$3" = VolumeSnapshot ] && group="    apiGroup: snapshot.storage.k8s.io"
	cat <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: $1
spec:
  storageClassName: sparsevol-ext4
  accessModes: [ReadWriteOnce]
  resources:
    requests:
      storage: $2
  dataSource:
$group
    kind: $3
    name: $4
YAML
}

# snapshot_ready NAME SECONDS: the VolumeSnapshot is readyToUse.
snapshot_ready() {
	local i
	for ((i = 0; i < $2; i++)); do
		[ "$(k get volumesnapshot "$1" -o jsonpath='{.status.readyToUse}' 2>/dev/null)" = true ] && return 0
		sleep 1
	done
	return 1
}

# debug_snapshot NAME: what a human needs when a snapshot is not ready.
debug_snapshot() {
	echo "---- volumesnapshot $1"
	k get volumesnapshot "$1" -o yaml 2>&1 | tail -n 30
	echo "---- volumesnapshotcontents"
	k get volumesnapshotcontent -o yaml 2>&1 | tail -n 40
	echo "---- node labels"
	k get node "$NODE" -o jsonpath='{.metadata.labels}'; echo
	echo "---- snapshot-controller (last 30 lines)"
	journalctl -b --no-pager -u snapshot-controller -n 30 2>&1
	plugin_log csi-snapshotter 30
	echo "---- plugin (last 20 lines)"
	plugin_log sparsevol 20
}
# plugin_pod: the name of the plugin's pod (the DaemonSet's, one node).
plugin_pod() {
	k -n "$PLUGIN_NS" get pod -l "$PLUGIN_SELECTOR" -o jsonpath='{.items[0].metadata.name}' 2>/dev/null
}

# plugin_log CONTAINER LINES: the last lines of a container of the plugin's
# pod (the plugin is "sparsevol"; the sidecars by their names).
plugin_log() {
	echo "---- $1 log ($(plugin_pod), last $2 lines)"
	k -n "$PLUGIN_NS" logs "$(plugin_pod)" -c "$1" --tail "$2" 2>&1
}

# plugin_ready_this_boot [OLD]: the plugin's pod (another than OLD) is
# Ready and started during this boot.
plugin_ready_this_boot() {
	local pod
	pod=$(plugin_pod)
	[ -n "$pod" ] && [ "$pod" != "${1:-}" ] && pod_ready_this_boot "$pod" "$PLUGIN_NS"
}

# wait_plugin SECONDS [OLD]: the DaemonSet rolled out, its pod (another
# than OLD) Ready and started this boot, and kubelet lists the driver in
# CSINode.
wait_plugin() {
	k -n "$PLUGIN_NS" rollout status ds/sparsevol-csi --timeout="$1s" >/dev/null &&
		retry "$1" plugin_ready_this_boot "${2:-}" &&
		retry "$1" sh -c "kubectl get csinode $NODE -o jsonpath='{.spec.drivers[*].name}' | grep -qw $DRIVER"
}

# plugin_metrics: the plugin pod's /metrics (its own HTTP server).
plugin_metrics() {
	curl -fsS --max-time 10 "http://$(k -n "$PLUGIN_NS" get pod "$(plugin_pod)" -o jsonpath='{.status.podIP}'):9809/metrics"
}

# The CSI volumes of the scenarios by mode: fs (ext4), xfs, block. sc_of
# is deploy/kubernetes' StorageClass, kind_of the pod's use (fs or block),
# size_of the claim (XFS needs 300 MiB at least).
sc_of() { case $1 in block) echo sparsevol-block ;; xfs) echo sparsevol-xfs ;; *) echo sparsevol-ext4 ;; esac; }
kind_of() { [ "$1" = block ] && echo block || echo fs; }
size_of() { [ "$1" = xfs ] && echo 320Mi || echo 64Mi; }
