//go:build e2e

package k8s

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 7: a pod's raw block volume takes no link with what it writes.
// pod-csi-block (scenario 3) writes an ext4 superblock carrying csi-fs's
// UUID to its device, as a hostile pod would; a probe of the device finds
// it, yet after a change event, and after the reboot, csi-fs's
// /dev/disk/by-uuid link still leads to csi-fs's device and udev's record
// of the raw device is the store's identity, left by the plugin through
// the node's /run/sparsevol/udev, with the rule the plugin installs.
var (
	s7Lib = `
	s7_facts() {
		local blk=$1 fsu=$2 dev fsdev seq
		dev=$(sparsevol status "$blk" -o json | jq -r .device)
		fsdev=$(sparsevol status "$fsu" -o json | jq -r .device)
		fact device "$dev"
		fact fs_device "$fsdev"
		seq=$(cat "/sys/class/block/${dev#/dev/}/diskseq")
		fact identity_file "$(yesno test -f "/run/sparsevol/udev/$seq")"
		fact link "$(readlink -f "/dev/disk/by-uuid/$fsu")"
		fact record "$(udevadm info -q property -n "$dev" | grep -E '^(SPARSEVOL_IDENTITY|ID_FS_UUID)=' | sort | oneline)"
	}
	s7_handles() {
		blk=$(k get pv "$(k get pvc csi-block -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.volumeHandle}')
		fsu=$(k get pv "$(k get pvc csi-fs -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.volumeHandle}')
	}
`
	s7Setup = vmrun.Step{Name: "s7-raw-content", Timeout: short, Script: s7Lib + `
	local blk fsu dev img
	s7_handles
	[ -n "$blk" ] && [ -n "$fsu" ] || die "scenario 3's volumes are missing"
	fact runtime_rule "$(yesno cmp -s /run/udev/rules.d/59-sparsevol.rules /usr/lib/udev/rules.d/59-sparsevol.rules)"
	img=$(mktemp)
	truncate -s 8M "$img"
	mkfs.ext4 -q -F -U "$fsu" "$img" || die "forge csi-fs's UUID"
	# The superblock only (bytes 1024-2047): the pod's token stays.
	dd if="$img" bs=1024 skip=1 count=1 status=none | k exec -i pod-csi-block -- dd of=/dev/xvda bs=1024 seek=1 count=1 conv=fsync || fail "write the forgery"
	rm -f "$img"
	dev=$(sparsevol status "$blk" -o json | jq -r .device)
	fact probe "$(blkid -p -o value -s UUID "$dev")"
	fact forged "$fsu"
	udevadm trigger --action=change --settle "$dev"
	s7_facts "$blk" "$fsu"
`}
	s7Check = vmrun.Step{Name: "s7-check", Timeout: short, Script: s7Lib + `
	local blk fsu
	s7_handles
	udevadm settle
	s7_facts "$blk" "$fsu"
`}
)

var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID:    "7-raw-content",
	Steps: []vmrun.Placed{vmrun.At("b1-setup", s7Setup), vmrun.At("b2-after-reboot", s7Check)},
	Check: func(t *testing.T, r *run) {
		for _, step := range []string{"s7-raw-content", "s7-check"} {
			b, ok := r.step(t, step)
			if !ok {
				continue
			}
			f := b.Step(step).Facts
			if f["fs_device"] == "" || f["link"] != f["fs_device"] {
				t.Errorf("%s: csi-fs's /dev/disk/by-uuid link leads to %q, its device is %q: the raw volume's content took it", step, f["link"], f["fs_device"])
			}
			vmrun.Expect(t, b, step, "identity_file", "yes", "record", "SPARSEVOL_IDENTITY=store")
		}
		if b, ok := r.step(t, "s7-raw-content"); ok {
			f := b.Step("s7-raw-content").Facts
			// A probe finds the forgery: the checks above can fail.
			vmrun.Expect(t, b, "s7-raw-content", "runtime_rule", "yes", "probe", f["forged"])
		}
	},
})
