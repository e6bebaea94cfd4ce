//go:build e2e

package vm

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 12: one store whose mount fails at boot costs only its own
// volumes. A store on a loop-mounted image (an fstab line with nofail)
// gets a volume; a volume of the default store is made beside it. Before
// the reboot the image is removed, so its mount fails at boot: the boot
// unit still runs (it wants the stores' mounts, it does not require
// them), the default store's volume is back at kubelet's start, and only
// the lost store's unit fails. Below the mount point lies an older copy
// of the lost store (a store used before its disk was mounted there):
// nothing of it comes up in the lost volume's place.
const s12Mount = "/srv/s12-lost"

var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "12-failed-mount",
	Steps: []vmrun.Placed{
		vmrun.At("b2-baseline", vmrun.Step{Name: "s12-setup", Timeout: short, Script: `
			local img=/var/lib/e2e-s12.img lost
			run truncate -s 64M "$img" || die "image"
			run mkfs.ext4 -q -F "$img" || die "mkfs image"
			echo "$img ` + s12Mount + ` ext4 loop,nofail 0 0" >>/etc/fstab
			mkdir -p ` + s12Mount + `
			run systemctl daemon-reload
			run mount ` + s12Mount + ` || die "mount image"
			mkdir -m 0700 ` + s12Mount + `/store
			create_vol s12-good raw 16M && write_data s12-good
			create_vol s12-lost raw 16M ` + s12Mount + `/store || die "create on the lost store"
			lost=$(vget s12-lost uuid)
			# Stopped, still enabled: its unit is what the next boot runs.
			run systemctl stop "sparsevol@$lost.service" || die "stop the lost volume"
			run cp -a --sparse=always ` + s12Mount + `/store /root/s12-stale || die "copy the store"
			run umount ` + s12Mount + ` || die "umount image"
			run rm -f "$img"
			# The older copy, below the mount point.
			run cp -a --sparse=always /root/s12-stale ` + s12Mount + `/store || die "stale store"
			sync
		`}),
		vmrun.At("b3-after-clean-reboot", vmrun.Step{Name: "s12-check", Timeout: short, Script: `
			fact s12.mount "$(systemctl show -P ActiveState -P Result "$(systemd-escape --path --suffix=mount ` + s12Mount + `)" | oneline)"
			fact s12.lostUnit "$(systemctl is-active "sparsevol@$(vget s12-lost uuid).service")"
			fact s12.staleBound "$(losetup -j ` + s12Mount + `/store/"$(vget s12-lost uuid)" | wc -l)"
			fact s12.staleLink "$(test -e "/dev/sparsevol/$(vget s12-lost uuid)" && echo present || echo absent)"
			check_vol s12-good
			# Nothing of it for the later boots: the good volume, the lost
			# one's unit and the fstab line.
			local lost
			lost=$(vget s12-lost uuid)
			sv s12-good delete "$(vget s12-good uuid)" || fail "delete s12-good"
			run systemctl disable "sparsevol@$lost.service"
			run rm -rf "/etc/systemd/system/sparsevol@$lost.service.d"
			sed -i '\|^/var/lib/e2e-s12.img |d' /etc/fstab
			run systemctl daemon-reload
			rm -rf ` + s12Mount + `/store /root/s12-stale
			rmdir ` + s12Mount + ` || true
		`}),
	},
	Check: func(t *testing.T, r *run) {
		setup := r.ran(t, "s12-setup")
		after := r.ran(t, "s12-check")
		if m := after.Facts["s12.mount"]; m == "" || m == "active success" {
			t.Fatalf("the lost store's mount is %q after the reboot, want it failed: the scenario proves nothing", m)
		}
		if st := after.Facts["bootunit.ActiveState"]; st != "active" {
			t.Errorf("sparsevol-boot.service is %q, want active: one failed mount fails only its own volumes", st)
		}
		checkBack(t, setup, after, "s12-good")
		if u := after.Facts["s12.lostUnit"]; u == "active" {
			t.Errorf("the lost store's volume's unit is %s, want it failed", u)
		}
		if n, l := after.Facts["s12.staleBound"], after.Facts["s12.staleLink"]; n != "0" || l != "absent" {
			t.Errorf("the older store below the failed mount point: %s device(s) bound to the lost volume's file there, its link %s; want none", n, l)
		}
	},
})
