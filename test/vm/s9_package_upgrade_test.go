//go:build e2e

package vm

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 9: upgrade the package under load. The run's image has this
// checkout's .deb; after the first boot the host builds the same source as
// an older version (s9OldVersion) and puts both on the share. In the guest:
// dpkg -i the old one, make one volume of every kind with data (the
// filesystems left mounted, every instance enabled and active), dpkg -i
// the new one, and look: still enabled, active, attached, mounted, data
// readable, the new binary in place. Then a clean reboot: every volume back
// before kubelet with its data, every instance enabled.
const s9OldVersion = "0.0.0~e2e.old" // sorts before any version make stamps

var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "9-package-upgrade",
	Steps: []vmrun.Placed{
		vmrun.At("b1-first", vmrun.Step{Name: "s9-installed", Timeout: short, Script: `
			fact s9.installed "$(dpkg-query -W -f='${Version}' sparsevol)"
			fact s9.binary "$(sparsevol version)"
		`}),
		vmrun.At("b2-baseline", vmrun.Step{Name: "s9-upgrade", Timeout: 900 * time.Second, Script: `
			local n uuid dev
			[ -f /e2e/s9/old.deb ] && [ -f /e2e/s9/new.deb ] || die "the host did not share the packages"
			run dpkg -i /e2e/s9/old.deb >"$OUT/s9-dpkg-old.log" 2>&1
			fact s9.oldExit "$?"
			fact s9.oldBinary "$(sparsevol version)"
			make_set s9 "" keep
			for n in $(vols_of s9); do
				uuid=$(vget "$n" uuid)
				fact "$n.before.enabled" "$(systemctl is-enabled "sparsevol@$uuid.service" 2>&1)"
				fact "$n.before.active" "$(systemctl is-active "sparsevol@$uuid.service")"
			done
			run dpkg -i /e2e/s9/new.deb >"$OUT/s9-dpkg-new.log" 2>&1
			fact s9.newExit "$?"
			fact s9.newBinary "$(sparsevol version)"
			fact s9.newInstalled "$(dpkg-query -W -f='${Version}' sparsevol)"
			for n in $(vols_of s9); do
				uuid=$(vget "$n" uuid)
				fact "$n.upgraded.enabled" "$(systemctl is-enabled "sparsevol@$uuid.service" 2>&1)"
				fact "$n.upgraded.active" "$(systemctl is-active "sparsevol@$uuid.service")"
				fact "$n.upgraded.needReload" "$(systemctl show -p NeedDaemonReload --value "sparsevol@$uuid.service")"
				status_facts "$n" "$n.upgraded"
				case $(vget "$n" kind) in
				ext4 | xfs)
					fact "$n.upgraded.mounted" "$(yesno mountpoint -q "$MNT/$n")"
					fact "$n.upgraded.sha" "$(sha256sum <"$MNT/$n/data" | cut -d' ' -f1)"
					;;
				esac
			done
		`}),
		vmrun.At("b3-after-clean-reboot", vmrun.Step{Name: "s9-check", Timeout: short, Script: `
			check_set s9
			fact s9.rebootBinary "$(sparsevol version)"
			fact s9.doctorSystemd "$(sparsevol doctor | grep -F ' systemd: ')"
		`}),
	},
	After: map[string]func(t *testing.T, r *run){
		"b1-first": shareUpgradePackages,
	},
	Check: checkPackageUpgrade,
})

// shareUpgradePackages builds the old package and puts it and the run's
// (new) package on the share: /e2e/s9/old.deb and new.deb.
func shareUpgradePackages(t *testing.T, r *run) {
	t0 := time.Now()
	if r.Deb == "" {
		t.Errorf("scenario 9: the run installed no .deb")
		return
	}
	old, err := vmrun.BuildDeb(r.Cfg.Repo, filepath.Join(r.Dir, "packages-old"), s9OldVersion)
	if err != nil {
		t.Errorf("scenario 9: %v", err)
		return
	}
	dir := filepath.Join(r.Share, "s9")
	for src, name := range map[string]string{old: "old.deb", r.Deb: "new.deb"} {
		if err := vmrun.CopyFile(src, filepath.Join(dir, name), 0o644); err != nil {
			t.Errorf("scenario 9: share %s: %v", name, err)
		}
	}
	vmrun.Logf(t, "scenario 9: built %s and shared it with %s in %s", filepath.Base(old), filepath.Base(r.Deb), time.Since(t0).Round(100*time.Millisecond))
}

func checkPackageUpgrade(t *testing.T, r *run) {
	first := r.ran(t, "s9-installed")
	up := r.ran(t, "s9-upgrade")
	f := up.Facts
	newVersion := first.Facts["s9.installed"]
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	switch {
	case f["s9.oldExit"] != "0":
		add("dpkg -i of the old package (%s) exited %s; see s9-dpkg-old.log", s9OldVersion, f["s9.oldExit"])
	case !strings.HasPrefix(f["s9.oldBinary"], "sparsevol "+s9OldVersion+" "):
		add("after installing the old package, sparsevol version = %q, want %s", f["s9.oldBinary"], s9OldVersion)
	}
	if f["s9.newExit"] != "0" {
		add("dpkg -i of the new package over attached volumes exited %s; see s9-dpkg-new.log", f["s9.newExit"])
	}
	if got := f["s9.newInstalled"]; got != newVersion || newVersion == "" {
		add("after the upgrade dpkg has sparsevol %q, want %q (the run's package)", got, newVersion)
	}
	if v := strings.TrimSuffix(newVersion, "-1"); !strings.HasPrefix(f["s9.newBinary"], "sparsevol "+v+" ") {
		add("after the upgrade sparsevol version = %q, want %s", f["s9.newBinary"], v)
	}
	names := volumesOf(up, "s9")
	if len(names) != 4 {
		add("made %d volumes (%v), want 4", len(names), names)
	}
	for _, n := range names {
		kind := f[n+".kind"]
		p := n + ".upgraded"
		if f[n+".before.enabled"] != "enabled" || f[n+".before.active"] != "active" {
			add("%s before the upgrade: unit %s and %s, want enabled and active (the setup is wrong)", n, f[n+".before.enabled"], f[n+".before.active"])
		}
		if f[p+".enabled"] != "enabled" {
			add("%s after the upgrade: unit is-enabled %q, want enabled", n, f[p+".enabled"])
		}
		if f[p+".active"] != "active" {
			add("%s after the upgrade: unit %q, want active", n, f[p+".active"])
		}
		if f[p+".needReload"] != "no" {
			add("%s after the upgrade: systemd NeedDaemonReload=%q: the package did not reload it", n, f[p+".needReload"])
		}
		if f[p+".attached"] != "true" {
			add("%s after the upgrade: sparsevol status attached=%q", n, f[p+".attached"])
		}
		if kind == "ext4" || kind == "xfs" {
			if f[p+".mounted"] != "yes" {
				add("%s after the upgrade: no longer mounted", n)
			}
			if f[p+".sha"] != f[n+".sha"] {
				add("%s after the upgrade: data %q, want %q", n, f[p+".sha"], f[n+".sha"])
			}
		}
	}
	after := r.ran(t, "s9-check")
	for _, n := range names {
		if e := after.Facts[n+".enabled"]; e != "enabled" {
			add("%s after the reboot: unit is-enabled %q, want enabled", n, e)
		}
	}
	if v := strings.TrimSuffix(newVersion, "-1"); !strings.HasPrefix(after.Facts["s9.rebootBinary"], "sparsevol "+v+" ") {
		add("after the reboot sparsevol version = %q, want %s", after.Facts["s9.rebootBinary"], v)
	}
	if d := after.Facts["s9.doctorSystemd"]; !strings.Contains(d, "[OK  ] systemd:") {
		add("after the reboot sparsevol doctor says %q, want the packaged template found (OK)", d)
	}
	if len(problems) > 0 {
		t.Errorf("package upgrade %s -> %s (boot %s):\n  - %s", s9OldVersion, newVersion, up.Spec.Name, strings.Join(problems, "\n  - "))
	}
	// Back at kubelet's start after the reboot, with their data.
	checkSet(t, r, "s9-upgrade", "s9-check", "s9", 4)
}
