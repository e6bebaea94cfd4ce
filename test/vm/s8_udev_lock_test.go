//go:build e2e

package vm

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 8: how udev is kept to one probe per bound device, A/B in one
// boot. The scale set (scenario 7), once up, is detached and attached
// again with `attach --all`, alternately by the installed binary (binds
// through a private device node) and by one built with -tags udevflock
// (binds through /dev/loopN holding udev's LOCK_EX on it), two rounds
// each. Per attach: its time, the udev and kernel events seen, and
// whether every /dev/disk/by-uuid link names the volume's device.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "8-udev-lock-ab",
	Steps: []vmrun.Placed{
		vmrun.At("b5-scale", vmrun.Step{Name: "s8-udev-ab", Timeout: short, Script: `
			local round v bin t0 t1 mon kmon f bad uuid dev
			run udevadm settle
			for round in 1 2 3; do
				for v in private flock; do
					bin=sparsevol
					[ "$v" = flock ] && bin=/usr/local/bin/sparsevol-udevflock
					sparsevol detach --all >/dev/null || fail "detach --all"
					run udevadm settle
					f=$OUT/ab-$v-$round
					udevadm monitor --udev --subsystem-match=block >"$f.udev" 2>&1 &
					mon=$!
					udevadm monitor --kernel --subsystem-match=block >"$f.kernel" 2>&1 &
					kmon=$!
					sleep 1
					t0=$(date +%s%N)
					"$bin" attach --all >/dev/null || fail "$v: attach --all"
					t1=$(date +%s%N)
					run udevadm settle
					t2=$(date +%s%N)
					sleep 2
					kill "$mon" "$kmon"
					wait "$mon" "$kmon" 2>/dev/null
					fact "ab.$v.$round.ms" "$(((t1 - t0) / 1000000))"
					fact "ab.$v.$round.settledMs" "$(((t2 - t0) / 1000000))"
					fact "ab.$v.$round.udev" "$(grep -c '^UDEV' "$f.udev")"
					fact "ab.$v.$round.udevChange" "$(grep '^UDEV' "$f.udev" | grep -c ' change ')"
					fact "ab.$v.$round.udevAdd" "$(grep '^UDEV' "$f.udev" | grep -c ' add ')"
					fact "ab.$v.$round.kernel" "$(grep -c '^KERNEL' "$f.kernel")"
					bad=0
					while read -r uuid dev; do
						[ "$(readlink -f "/dev/disk/by-uuid/$uuid")" = "$dev" ] || bad=$((bad + 1))
					done < <(sparsevol list -o json | jq -r '.[] | select(.name | startswith("s7-")) | "\(.uuid) \(.device)"')
					fact "ab.$v.$round.badLinks" "$bad"
				done
			done
		`}),
	},
	After: map[string]func(t *testing.T, r *run){
		// The variant binary, built from this checkout into the image.
		"b4-after-hard-reset": func(t *testing.T, r *run) {
			err := r.WithRoot(false, func(mnt string) error {
				cmd := exec.Command("go", "build", "-tags", "udevflock", "-trimpath", "-o",
					filepath.Join(mnt, "usr/local/bin/sparsevol-udevflock"), "./cmd/sparsevol")
				cmd.Dir = r.Cfg.Repo
				if out, err := cmd.CombinedOutput(); err != nil {
					return fmt.Errorf("go build -tags udevflock: %v\n%s", err, out)
				}
				return nil
			})
			if err != nil {
				t.Error(err)
			}
		},
	},
	Check: func(t *testing.T, r *run) {
		res := r.Ran("s8-udev-ab")
		if !vmrun.NeedStep(t, res, "s8-udev-ab") {
			return
		}
		f := res.Step("s8-udev-ab").Facts
		for _, v := range []string{"private", "flock"} {
			for _, round := range []string{"1", "2", "3"} {
				p := "ab." + v + "." + round + "."
				r.figures = append(r.figures, fmt.Sprintf("udev A/B %-7s round %s: attach --all %s ms (settled %s ms); udev events %s (change %s, add %s), kernel events %s; wrong by-uuid links %s",
					v, round, f[p+"ms"], f[p+"settledMs"], f[p+"udev"], f[p+"udevChange"], f[p+"udevAdd"], f[p+"kernel"], f[p+"badLinks"]))
				if f[p+"badLinks"] != "0" {
					t.Errorf("%s round %s: %s by-uuid links do not name the volume's device", v, round, f[p+"badLinks"])
				}
			}
		}
	},
})
