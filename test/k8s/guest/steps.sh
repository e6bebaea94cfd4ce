# Step bodies: step_<name> (dashes become underscores). Each prints what it
# does and records what it observed as facts; the Go checks decide (see
# k8s_test.go). fail/die only say that a step could not do what it was
# asked (a command of its setup failed).

# The cluster comes up (every boot): apiserver, node Ready, the plugin
# registered with kubelet (CSINode lists the driver), objects of the test.
step_cluster() {
	retry 600 k get --raw /readyz || die "apiserver not ready"
	fact apiserver_ready_uptime "$(up)"
	retry 600 node_ready || { k describe node "$NODE"; die "node not Ready"; }
	fact node_ready_uptime "$(up)"
	# Native registration: kubelet lists the driver in CSINode.
	if retry 180 sh -c "kubectl get csinode $NODE -o jsonpath='{.spec.drivers[*].name}' | grep -qw $DRIVER"; then
		fact csinode_registered_uptime "$(up)"
		fact plugin_registered yes
		k get csinode "$NODE" -o jsonpath='{.spec.drivers}'; echo
	else
		journalctl -b --no-pager -u sparsevol-csi | tail -n 30
		journalctl -b --no-pager -u kubelet | grep -i plugin | tail -n 20
		fact plugin_registered no
	fi
	fact node_labels "$(k get node "$NODE" -o jsonpath='{.metadata.labels}')"
	# The project's own CSIDriver and StorageClasses (deploy/kubernetes).
	k apply -f "$DEPLOY/csidriver.yaml" -f "$DEPLOY/storageclasses.yaml" || die "apply deploy/kubernetes manifests"
	k apply -f - <<'YAML' || die "apply test objects"
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: local-static
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
YAML
	retry 120 k get serviceaccount default || die "no default service account"
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
	sparsevol pv "$name" --storage-class local-static --name "pv-$name" >"$STATE/pv-$name.yaml" || die "sparsevol pv"
	cat "$STATE/pv-$name.yaml"
	k apply -f "$STATE/pv-$name.yaml" || die "apply pv"
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

step_s1_setup() { node_mode_setup s1 no; }
step_s2_setup() { node_mode_setup s2 yes; }

# After the reboot, s1 (unit disabled) is stuck, and kubelet says why.
step_s1_check() {
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
}

# After the reboot, s2 (unit enabled) is back with its data.
step_s2_check() {
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
}

# CSI mode: dynamically provisioned volumes (WaitForFirstConsumer), one
# filesystem and one block, through deploy/kubernetes' StorageClasses.
sc_of() { [ "$1" = block ] && echo sparsevol-block || echo sparsevol-ext4; }
step_s3_setup() {
	local mode token
	for mode in fs block; do
		pvc_manifest "csi-$mode" "$(sc_of "$mode")" 64Mi "$mode" | k apply -f - || die "apply pvc csi-$mode"
		token=$(new_token)
		echo "$token" >"$STATE/token-csi-$mode"
		pod_manifest "pod-csi-$mode" "csi-$mode" "$mode" "$token" | k apply -f - || die "apply pod-csi-$mode"
	done
	for mode in fs block; do
		if ! wait_pod_ready "pod-csi-$mode" 300; then
			fact "${mode}_ready" no
			continue
		fi
		fact "${mode}_ready" yes
		fact "${mode}_ready_uptime" "$(up)"
		fact "${mode}_data" "$(same_token "pod-csi-$mode" "$mode" "$(cat "$STATE/token-csi-$mode")")"
		fact "${mode}_volume" "$(k get pv "$(k get pvc "csi-$mode" -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.volumeHandle}')"
	done
	sparsevol list
}

step_s3_check() {
	local mode
	for mode in fs block; do
		if ! wait_pod_ready "pod-csi-$mode" 600; then
			fact "${mode}_ready" no
			continue
		fi
		fact "${mode}_ready" yes
		fact "${mode}_ready_uptime" "$(uptime_at "$(k get pod "pod-csi-$mode" -o jsonpath='{.status.conditions[?(@.type=="Ready")].lastTransitionTime}')")"
		fact "${mode}_data" "$(found_same_token "pod-csi-$mode" "$mode" "$(cat "$STATE/token-csi-$mode")")"
	done
}

# Node expansion without external-resizer: the test plays the resizer's
# part for a volume whose plugin needs no controller-side work (it does the
# file, loop and filesystem growth at NodeExpandVolume): raise the PVC, set
# the PV's capacity and mark the claim as waiting for the node, then
# kubelet calls NodeExpandVolume and records the new size.
step_s3_expand() {
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
}

# Capacity: CSIStorageCapacity for the node and the class; a claim larger
# than the node can give stays Pending, with a clear event, and nothing is
# created on disk.
step_s4_capacity() {
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
}

# Cleanup: deleting pods, claims and volumes leaves no loop device, file or
# unit.
step_s5_cleanup() {
	local i left
	k delete pod --all --wait=true --timeout=120s || fail "delete pods"
	k delete pvc --all --wait=false || fail "delete pvcs"
	k delete pv pv-s1 pv-s2 --wait=true --timeout=60s || true
	# kubelet unmounts a little after the pod objects are gone.
	for v in s1 s2; do
		retry 120 sh -c "! sparsevol status $v >/dev/null 2>&1 || sparsevol delete $v" || fail "sparsevol delete $v"
	done
	for ((i = 0; i < 180; i++)); do
		left=$(k get pv -o name 2>/dev/null)
		[ -z "$left" ] && break
		sleep 1
	done
	fact pvs_left "${left:-none}"
	[ -z "$left" ] || { k get pv -o wide; journalctl -b --no-pager -u csi-provisioner | tail -n 20; }
	echo "---- losetup"; losetup -l -n
	echo "---- store"; ls -la /var/lib/sparsevol
	echo "---- units"; systemctl list-units --all --no-legend --plain 'sparsevol@*'; ls /etc/systemd/system/multi-user.target.wants/ | grep sparsevol || true
	echo "---- sparsevol list"; sparsevol list
	fact loops_left "$(losetup -l -n | oneline | grep . || echo none)"
	fact files_left "$(ls /var/lib/sparsevol | grep -v '^\.' | oneline | grep . || echo none)"
	fact units_loaded "$(systemctl list-units --all --no-legend --plain 'sparsevol@*' | oneline | grep . || echo none)"
	fact units_enabled "$(ls /etc/systemd/system/*.wants/ 2>/dev/null | grep 'sparsevol@' | oneline | grep . || echo none)"
}
