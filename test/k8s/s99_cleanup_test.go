//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 99: cleanup, the last step of the last boot (keep new
// scenarios' numbers below it). Deleting pods, claims and volumes leaves no
// PV, loop device, file or unit.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "99-cleanup",
	Steps: []vmrun.Placed{
		vmrun.At("b2-after-reboot", vmrun.Step{Name: "s99-cleanup", Timeout: short, Script: `
	local i left
	# Fourteen pods stop at once: under TCG containerd has been seen
	# to take over two minutes to reap one of them (its task delete
	# timing out and retried), so the wait is generous.
	k delete pod --all --wait=true --timeout=300s || { k get pods -o wide; fail "delete pods"; }
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
	[ -z "$left" ] || { k get pv -o wide; plugin_log csi-provisioner 20; }
	echo "---- losetup"; losetup -l -n
	echo "---- store"; ls -la /var/lib/sparsevol
	echo "---- units"; systemctl list-units --all --no-legend --plain 'sparsevol@*'; ls /etc/systemd/system/multi-user.target.wants/ | grep sparsevol || true
	echo "---- sparsevol list"; sparsevol list
	fact loops_left "$(losetup -l -n | oneline | grep . || echo none)"
	fact files_left "$(ls /var/lib/sparsevol | grep -v '^\.' | oneline | grep . || echo none)"
	fact units_loaded "$(systemctl list-units --all --no-legend --plain 'sparsevol@*' | oneline | grep . || echo none)"
	fact units_enabled "$(ls /etc/systemd/system/*.wants/ 2>/dev/null | grep 'sparsevol@' | oneline | grep . || echo none)"
`}),
	},
	Check: func(t *testing.T, r *run) {
		if b2, ok := r.step(t, "s99-cleanup"); ok {
			vmrun.Expect(t, b2, "s99-cleanup", "pvs_left", "none", "loops_left", "none", "files_left", "none",
				"units_loaded", "none", "units_enabled", "none")
		}
	},
})
