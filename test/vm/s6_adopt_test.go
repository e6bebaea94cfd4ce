//go:build e2e

package vm

import (
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 6: an old install's sparse files, adopted in place: their
// directory becomes a store (--root), so nothing moves, and they are back
// after the reboot with the same bytes.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "6-adopt-old-install",
	Steps: []vmrun.Placed{
		vmrun.At("b2-baseline", vmrun.Step{Name: "s6-setup", Timeout: short, Script: `
			local u1 u2 f loop sha n
			mkdir -p "$OLD_DIR" "$MNT/old"
			u1=$(cat /proc/sys/kernel/random/uuid)
			u2=$(cat /proc/sys/kernel/random/uuid)
			head -c 4M /dev/urandom >/tmp/e2e-data
			sha=$(sha256sum </tmp/e2e-data | cut -d' ' -f1)

			# Formatted volume, written through a temporary loop mount.
			f=$OLD_DIR/$u1
			run truncate -s 64M "$f" && run mkfs.ext4 -q -U "$u1" "$f" || die "old ext4"
			run mount -o loop "$f" "$MNT/old" || die "mount old ext4"
			run dd if=/tmp/e2e-data of="$MNT/old/data" bs=1M conv=fsync status=none || die "write old ext4"
			run umount "$MNT/old"
			: >"$STATE/vols/s6-ext4"
			vset s6-ext4 kind ext4
			vset s6-ext4 uuid "$u1"
			vset s6-ext4 root "$OLD_DIR"
			fact s6-ext4.kind ext4
			fact s6-ext4.uuid "$u1"
			fact s6-ext4.sha "$sha"
			fact s6-ext4.fileBefore "$(sha256sum <"$f" | cut -d' ' -f1)"
			fs_facts s6-ext4 "$f"

			# Raw block volume: a GPT partition whose GUID is the volume UUID.
			f=$OLD_DIR/$u2
			run truncate -s 64M "$f" || die "truncate"
			run sgdisk --largest-new 1 --partition-guid "1:$u2" "$f" || die "sgdisk"
			loop=$(run losetup --find --show --partscan "$f") || die "losetup"
			run udevadm settle
			run dd if=/tmp/e2e-data of="${loop}p1" bs=1M seek=1 conv=fsync oflag=direct status=none || die "write old block"
			run losetup -d "$loop"
			run udevadm settle
			: >"$STATE/vols/s6-block"
			vset s6-block kind block
			vset s6-block uuid "$u2"
			vset s6-block root "$OLD_DIR"
			fact s6-block.kind block
			fact s6-block.uuid "$u2"
			fact s6-block.sha "$sha"
			fact s6-block.fileBefore "$(sha256sum <"$f" | cut -d' ' -f1)"

			run sparsevol --root "$OLD_DIR" adopt --dir "$OLD_DIR" || die "sparsevol adopt exited $?"
			fact s6.adoptExit 0
			run udevadm settle
			for n in s6-ext4 s6-block; do
				status_facts "$n" "$n.afterAdopt"
				fact "$n.afterAdopt.enabled" "$(systemctl is-enabled "sparsevol@$(vget "$n" uuid).service" 2>&1)"
			done
			sync
		`}),
		vmrun.At("b3-after-clean-reboot", vmrun.Step{Name: "s6-check", Timeout: short, Script: `
			local n
			for n in s6-ext4 s6-block; do
				fact "$n.fileAfterReboot" "$(sha256sum <"$OLD_DIR/$(vget "$n" uuid)" | cut -d' ' -f1)"
				check_vol "$n"
			done
		`}),
	},
	Check: func(t *testing.T, r *run) {
		checkSet(t, r, "s6-setup", "s6-check", "s6", 2)
		setup := r.ran(t, "s6-setup")
		after := r.ran(t, "s6-check")
		for _, n := range []string{"s6-ext4", "s6-block"} {
			uuid := setup.Facts[n+".uuid"]
			if got, want := setup.Facts[n+".afterAdopt.backingFile"], oldDir+"/"+uuid; got != want {
				t.Errorf("%s: adopted backing file %q, want it in place at %q", n, got, want)
			}
			if got, want := after.Facts[n+".fileAfterReboot"], setup.Facts[n+".fileBefore"]; got != want {
				t.Errorf("%s: the file's content changed between adopt and the first use after the reboot (sha256 %s, before adopt %s)", n, got, want)
			}
		}
	},
})
