//go:build e2e

package vm

import (
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 11: what a raw volume's user writes takes no link. Filesystems
// claiming a filesystem volume's UUID and the node root's are written to
// a whole-device raw volume and into a partitioned one's partition, as a
// pod with block access would; udev handles their devices again (the
// close of the writes, a change event, the next boot), and the
// /dev/disk/by-uuid links stay the volume's and the root's, while
// /dev/disk/by-partuuid keeps the partition. A probe udev made before the
// identity was there (simulated: its file removed, a change event) is
// undone by the next attach.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "11-raw-content-takes-no-link",
	Steps: []vmrun.Placed{
		vmrun.At("b2-baseline", vmrun.Step{Name: "s11-setup", Timeout: short, Script: s11Lib + `
			local img rawdev seq
			create_vol s11-fs ext4 64M || return
			create_vol s11-raw raw 16M || return
			create_vol s11-gpt block 16M || return
			s11_uuids
			run udevadm settle
			# What a pod with the raw volumes writes.
			img=$(mktemp /tmp/s11.XXXXXX)
			run truncate -s 8M "$img"
			run mkfs.ext4 -q -F -U "$fsu" "$img" || die "forge the volume's UUID"
			run dd if="$img" of="/dev/sparsevol/$rawu" bs=1M oflag=direct conv=fsync status=none || die "write raw"
			if [ -n "$rootu" ]; then
				run mkfs.ext4 -q -F -U "$rootu" "$img" || die "forge the root's UUID"
				run dd if="$img" of="/dev/sparsevol/$gptu" bs=1M oflag=direct conv=fsync status=none || die "write gpt"
			fi
			rm -f "$img"
			run udevadm settle
			s11_links s11.written
			run udevadm trigger --action=change --settle "$(readlink -f "/dev/sparsevol/$rawu")" "$(readlink -f "/dev/sparsevol/$gptu")"
			s11_links s11.changed

			# udev first: the identity file was not there when it handled
			# the binding's event, so it probed.
			rawdev=$(readlink -f "/dev/sparsevol/$rawu")
			seq=$(cat "/sys/class/block/${rawdev#/dev/}/diskseq")
			run rm -f "/run/sparsevol/udev/$seq"
			run udevadm trigger --action=change --settle "$rawdev"
			fact s11.probed.rawRecord "$(s11_record "$rawdev")"
			sv s11-raw attach s11-raw
			fact s11.reattachExit "$?"
			fact s11.reattachIdentity "$(yesno test -e "/run/sparsevol/udev/$seq")"
			run udevadm settle
			s11_links s11.reattached
		`}),
		vmrun.At("b3-after-clean-reboot", vmrun.Step{Name: "s11-check", Timeout: short, Script: s11Lib + `
			local n
			s11_uuids
			run udevadm settle
			s11_links s11.afterReboot
			for n in s11-fs s11-raw s11-gpt; do sv "$n" delete "$n"; done
		`}),
	},
	Check: checkRawContent,
})

// s11Lib: the scenario's UUIDs, and the facts of its links and records.
const s11Lib = `
	s11_uuids() {
		fsu=$(vget s11-fs uuid)
		rawu=$(vget s11-raw uuid)
		gptu=$(vget s11-gpt uuid)
		rootu=$(findmnt -no UUID /)
		fact s11.rootUUID "${rootu:-none}"
	}
	s11_record() {
		udevadm info --query=property --name="$1" | grep -E '^(SPARSEVOL_IDENTITY|ID_FS_UUID|ID_PART_ENTRY_UUID)=' | sort | oneline
	}
	s11_links() {
		local p=$1
		fact "$p.fsLink" "$(readlink -f "/dev/disk/by-uuid/$fsu")"
		fact "$p.fsDev" "$(readlink -f "/dev/sparsevol/$fsu")"
		[ -n "$rootu" ] && fact "$p.rootLink" "$(readlink -f "/dev/disk/by-uuid/$rootu")"
		fact "$p.gptPart" "$(readlink -f "/dev/sparsevol/$gptu")"
		fact "$p.partuuidLink" "$(readlink -f "/dev/disk/by-partuuid/$gptu")"
		fact "$p.rawRecord" "$(s11_record "$(readlink -f "/dev/sparsevol/$rawu")")"
		fact "$p.gptRecord" "$(s11_record "$(readlink -f "/dev/sparsevol/$gptu")")"
	}
`

func checkRawContent(t *testing.T, r *run) {
	setup := r.ran(t, "s11-setup").Result
	check := r.ran(t, "s11-check").Result
	gpt := setup.Facts["s11-gpt.uuid"]
	links := func(b *vmrun.Result, p string) {
		t.Helper()
		f := b.Facts
		if f[p+".fsDev"] == "" || f[p+".fsLink"] != f[p+".fsDev"] {
			t.Errorf("%s: the filesystem volume's /dev/disk/by-uuid link leads to %q, its device is %q", p, f[p+".fsLink"], f[p+".fsDev"])
		}
		if root := f[p+".rootLink"]; setup.Facts["s11.rootUUID"] != "none" && root == f[p+".gptPart"] {
			t.Errorf("%s: the node root's /dev/disk/by-uuid link leads to the raw volume's partition %s", p, root)
		}
		if f[p+".gptPart"] == "" || f[p+".partuuidLink"] != f[p+".gptPart"] {
			t.Errorf("%s: /dev/disk/by-partuuid/%s leads to %q, the partition is %q", p, gpt, f[p+".partuuidLink"], f[p+".gptPart"])
		}
		if raw := f[p+".rawRecord"]; raw != "SPARSEVOL_IDENTITY=store" {
			t.Errorf("%s: udev's record of the whole-device raw volume is %q; want only SPARSEVOL_IDENTITY=store (no probed UUID)", p, raw)
		}
		if want := "ID_PART_ENTRY_UUID=" + gpt + " SPARSEVOL_IDENTITY=store"; f[p+".gptRecord"] != want {
			t.Errorf("%s: udev's record of the partition is %q; want %q", p, f[p+".gptRecord"], want)
		}
	}
	for _, p := range []string{"s11.written", "s11.changed", "s11.reattached"} {
		links(setup, p)
	}
	links(check, "s11.afterReboot")
	// The forgery is what a probe finds: without the identity the test
	// above could fail.
	if got := setup.Facts["s11.probed.rawRecord"]; !strings.Contains(got, "ID_FS_UUID="+setup.Facts["s11-fs.uuid"]) {
		t.Errorf("udev's record of the raw volume probed without its identity is %q; want the forged ID_FS_UUID (the scenario proves nothing otherwise)", got)
	}
	vmrun.Expect(t, setup, "s11-setup", "s11.reattachExit", "0", "s11.reattachIdentity", "yes")
}
