//go:build e2e

package vm

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 1: the failure sparsevol ends, reproduced. A volume made by hand
// the old way (sparse file, mkfs.ext4 -U, losetup --find, no unit) has its
// /dev/disk/by-uuid link before a reboot and not after it.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "1-original-failure-reproduced",
	Steps: []vmrun.Placed{
		vmrun.At("b1-first", vmrun.Step{Name: "s1-setup", Timeout: short, Script: `
			local uuid f loop
			uuid=$(cat /proc/sys/kernel/random/uuid)
			f=/var/lib/by-hand/$uuid
			mkdir -p /var/lib/by-hand
			run truncate -s 64M "$f" || die "truncate"
			run mkfs.ext4 -q -U "$uuid" "$f" || die "mkfs.ext4"
			loop=$(run losetup --find --show "$f") || die "losetup"
			run udevadm settle
			fact s1.uuid "$uuid"
			fact s1.file "$f"
			fact s1.loop "$loop"
			fact s1.linkAtCreate "$(yesno test -e "/dev/disk/by-uuid/$uuid")"
			printf 'uuid=%s\nfile=%s\n' "$uuid" "$f" >"$STATE/s1"
			sync
		`}),
		vmrun.At("b2-baseline", vmrun.Step{Name: "s1-check", Timeout: short, Script: `
			local uuid f
			uuid=$(sed -n 's/^uuid=//p' "$STATE/s1")
			f=$(sed -n 's/^file=//p' "$STATE/s1")
			run udevadm settle
			fact s1.uuid "$uuid"
			fact s1.fileExists "$(yesno test -e "$f")"
			fact s1.linkNow "$(yesno test -e "/dev/disk/by-uuid/$uuid")"
			fact s1.loops "$(losetup --noheadings --output NAME -j "$f" | oneline)"
		`}),
	},
	Check: func(t *testing.T, r *run) {
		setup := r.ran(t, "s1-setup")
		after := r.ran(t, "s1-check")
		uuid := setup.Facts["s1.uuid"]
		if uuid == "" {
			t.Fatal("no by-hand volume was made")
		}
		if setup.Facts["s1.linkAtCreate"] != "yes" {
			t.Errorf("/dev/disk/by-uuid/%s did not appear even before the reboot: the VM does not run udev as a node would", uuid)
		}
		if !after.kubelet.ran {
			t.Fatalf("kubelet.service did not run in boot %s", after.Spec.Name)
		}
		if target, ok := after.kubelet.links["/dev/disk/by-uuid/"+uuid]; ok {
			t.Errorf("/dev/disk/by-uuid/%s exists at kubelet start (-> %s): the VM did not reproduce the failure", uuid, target)
		}
		if after.Facts["s1.linkNow"] != "no" || after.Facts["s1.loops"] != "" {
			t.Errorf("after the reboot: link exists=%s, loop devices %q; want no link and no device",
				after.Facts["s1.linkNow"], after.Facts["s1.loops"])
		}
		if after.Facts["s1.fileExists"] != "yes" {
			t.Errorf("the backing file vanished")
		}
		t.Logf("reproduced: by-hand volume %s (%s) was attached as %s with its link before the reboot; after it, /dev/disk/by-uuid/%s does not exist",
			uuid, setup.Facts["s1.file"], setup.Facts["s1.loop"], uuid)
	},
})
