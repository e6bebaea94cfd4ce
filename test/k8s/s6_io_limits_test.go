//go:build e2e

package k8s

import (
	"math"
	"strconv"
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 6: per-volume I/O limits. Two block claims on the node's one
// disk, one of a StorageClass with writeBytesPerSecond 10M (10 MiB/s); one
// pod writes each with dd oflag=direct, four at once. The limited volume
// measures within 15% of its limit, the unlimited one well above it (one
// dd alone is recorded as a figure); the limit is an io.max
// entry for the volume's loop device on kubepods.slice (kubelet's systemd
// cgroup driver), changed live by `sparsevol limit` (measured again at 20
// MiB/s), and gone once the pod is deleted and the volume unstaged.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "6-io-limits",
	Steps: []vmrun.Placed{
		vmrun.At("b1-setup", vmrun.Step{Name: "s6-io-limits", Timeout: short, Script: `
	local uuid dev majmin line i out v
	local cg=/sys/fs/cgroup/kubepods.slice
	k apply -f - <<'YAML' || die "apply storage class"
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: sparsevol-limited
provisioner: sparsevol.csi.io
volumeBindingMode: WaitForFirstConsumer
parameters:
  writeBytesPerSecond: 10M
YAML
	pvc_manifest io-limited sparsevol-limited 160Mi block | k apply -f - || die "apply pvc io-limited"
	pvc_manifest io-free sparsevol-block 160Mi block | k apply -f - || die "apply pvc io-free"
	k apply -f - <<'YAML' || die "apply pod-io"
apiVersion: v1
kind: Pod
metadata:
  name: pod-io
spec:
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: localhost/busybox:1
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", "echo ok > /tmp/ok; trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]
    volumeDevices:
    - {name: limited, devicePath: /dev/limited}
    - {name: free, devicePath: /dev/free}
  volumes:
  - {name: limited, persistentVolumeClaim: {claimName: io-limited}}
  - {name: free, persistentVolumeClaim: {claimName: io-free}}
YAML
	if ! wait_pod_ready pod-io 300; then
		fact pod_ready no
		return 0
	fi
	fact pod_ready yes
	uuid=$(k get pv "$(k get pvc io-limited -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.volumeHandle}')
	dev=$(sparsevol status "$uuid" -o json | jq -r .device)
	majmin=$(lsblk -dno MAJ:MIN "$dev" | tr -d ' ')
	sparsevol status "$uuid"
	echo "---- $cg/io.max"; cat "$cg/io.max"
	echo "---- subtree_control: root $(cat /sys/fs/cgroup/cgroup.subtree_control); kubepods.slice $(cat "$cg/cgroup.subtree_control")"
	line=$(grep "^$majmin " "$cg/io.max")
	fact device "$dev $majmin"
	fact io_max "$line"
	fact io_max_entry "$(case "$line" in *" wbps=10485760 "*) echo yes;; *) echo no;; esac)"
	# measure NAME DEVICE MIB STREAMS: direct writes of MIB MiB in the pod,
	# split over STREAMS dd processes at once, timed there (busybox dd
	# prints no rate; /proc/uptime has 10 ms steps). Several streams keep
	# the throttle's queue busy; one alone is measured too, for the figure.
	measure() {
		out=$(k exec pod-io -- sh -c "n=\$(($3 / $4)); read a _ </proc/uptime; i=0; while [ \$i -lt $4 ]; do { dd if=/dev/zero of=/dev/$2 bs=1M count=\$n seek=\$((i * n)) oflag=direct 2>/dev/null || echo ddfail; } & i=\$((i + 1)); done; wait; read b _ </proc/uptime; echo elapsed \$a \$b") || die "dd $2: $out"
		echo "$1: $out"
		case "$out" in *ddfail*) die "dd $2 failed: $out" ;; esac
		fact "$1_bytes" $(($3 * 1048576))
		fact "$1_seconds" "$(echo "$out" | awk '/^elapsed/ { printf "%.2f", $3 - $2 }')"
	}
	measure single limited 32 1
	measure limited limited 64 4
	measure free free 128 4
	sparsevol limit "$uuid" --write-bps 20M || die "sparsevol limit"
	fact io_max_changed "$(grep "^$majmin " "$cg/io.max")"
	measure changed limited 128 4
	k delete pod pod-io --wait=true --timeout=120s || die "delete pod-io"
	for ((i = 0; i < 120; i++)); do
		[ "$(sparsevol status "$uuid" -o json | jq -r .attached)" = false ] && break
		sleep 1
	done
	fact unstaged "$(sparsevol status "$uuid" -o json | jq -r .attached | sed 's/false/yes/;s/true/no/')"
	line=$(grep "^$majmin " "$cg/io.max")
	fact entry_removed "$([ -z "$line" ] && echo yes || echo "no: $line")"
	k delete pvc io-limited io-free --wait=true --timeout=120s || fail "delete pvcs"
`}),
	},
	Check: func(t *testing.T, r *run) {
		b, ok := r.step(t, "s6-io-limits")
		if !ok || !vmrun.Expect(t, b, "s6-io-limits", "pod_ready", "yes", "io_max_entry", "yes", "unstaged", "yes", "entry_removed", "yes") {
			return
		}
		f := b.Step("s6-io-limits").Facts
		rate := func(name string) float64 {
			bytes, err1 := strconv.ParseFloat(f[name+"_bytes"], 64)
			secs, err2 := strconv.ParseFloat(f[name+"_seconds"], 64)
			if err1 != nil || err2 != nil || secs <= 0 {
				t.Errorf("dd on the %s volume: bytes %q, seconds %q", name, f[name+"_bytes"], f[name+"_seconds"])
				return 0
			}
			return bytes / secs
		}
		const limit, changedLimit = 10 << 20, 20 << 20
		limited, free, changed := rate("limited"), rate("free"), rate("changed")
		if dev := limited/limit - 1; math.Abs(dev) > 0.15 {
			t.Errorf("limited volume (io.max %q): %.2f MiB/s, %+.1f%% off its limit of 10 MiB/s (allowed 15%%)", f["io_max"], limited/(1<<20), 100*dev)
		}
		if free/limit < 1.15 {
			t.Errorf("unlimited volume on the same disk: %.2f MiB/s, not above the 10 MiB/s limit by more than 15%%: the limit would be indistinguishable", free/(1<<20))
		}
		if dev := changed/changedLimit - 1; math.Abs(dev) > 0.15 {
			t.Errorf("after sparsevol limit --write-bps 20M (io.max %q): %.2f MiB/s, %+.1f%% off 20 MiB/s", f["io_max_changed"], changed/(1<<20), 100*dev)
		}
		single := rate("single")
		r.fig("scenario 6 (I/O limits, 4 dd oflag=direct at once): limited to 10 MiB/s: %.2f MiB/s (%+.1f%%); unlimited on the same disk: %.2f MiB/s; changed live to 20 MiB/s: %.2f MiB/s (%+.1f%%); one dd alone on the limited volume: %.2f MiB/s (%+.1f%%); %s",
			limited/(1<<20), 100*(limited/limit-1), free/(1<<20), changed/(1<<20), 100*(changed/changedLimit-1), single/(1<<20), 100*(single/limit-1), f["io_max"])
	},
})
