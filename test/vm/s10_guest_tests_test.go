//go:build e2e

package vm

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Scenario 10: the package tests whose subject the CI host cannot give
// them run in the guest, which can: I/O limits need cgroup v2's io
// controller (the host's cgroups are hybrid, io bound to v1 blkio), online
// ext4 growth needs CAP_SYS_RESOURCE (withheld on the host). Before the
// boot the host compiles the packages' tests (go test -c, static) onto the
// share; the guest runs the tests named here with SPARSEVOL_TEST_HOST_HAS
// naming both features, so that a test finding one missing fails instead
// of passing by its branch for hosts without it. Each named test must
// pass, none skip.
var s10Tests = []struct {
	pkg   string   // package, relative to the repository
	tests []string // its tests that need the guest's features
}{
	{"./internal/iolimit", []string{"TestSetRemove", "TestRefusedSetChangesNothing", "TestRefusedSetKeepsAConcurrentSet"}},
	{"./internal/volume", []string{"TestChangeLive", "TestLimitsFollowTheDevice",
		"TestDetachLeavesTheNextBindersLimits", "TestLimitsStayOnADeviceLeftBound",
		"TestLimitsOnlyOnAHeldDevice", "TestExpandFrozenRefused"}},
	{"./internal/csi", []string{"TestModifyLive", "TestOnlineExpansion"}},
	{"./cmd/sparsevol", []string{"TestLimitCommand", "TestLimitKeepsAConcurrentChange"}},
}

// s10Boot is where the tests run: the boot that clears the store
// afterwards, so nothing they might leave reaches the scale boots.
const s10Boot = "b4-after-hard-reset"

var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "10-guest-tests",
	Steps: []vmrun.Placed{
		vmrun.At(s10Boot, vmrun.Step{Name: "s10-guest-tests", Timeout: 900 * time.Second, Script: `
			local bin pattern code
			[ -f /e2e/s10/plan ] || die "the host shared no test plan"
			export ` + testutil.HostFeaturesEnv + `=` + testutil.FeatureIOLimits + `,` + testutil.FeatureSysResource + `
			fact s10.controllers "$(cat /sys/fs/cgroup/cgroup.controllers)"
			while read -r bin pattern; do
				(cd /tmp && /e2e/s10/"$bin" -test.run "$pattern" -test.count=1 -test.v -test.timeout 600s) >"$OUT/s10-$bin.log" 2>&1
				code=$?
				fact "s10.$bin.exit" "$code"
			done </e2e/s10/plan
		`}),
	},
	Before: map[string]func(t *testing.T, r *run){
		s10Boot: shareGuestTests,
	},
	Check: checkGuestTests,
})

// shareGuestTests compiles the tests of s10Tests onto the share
// (/e2e/s10/<package>.test) with the plan the guest step reads: one line
// per binary, its name and a -test.run pattern.
func shareGuestTests(t *testing.T, r *run) {
	t0 := time.Now()
	dir := filepath.Join(r.Share, "s10")
	var pkgs []string
	for _, p := range s10Tests {
		pkgs = append(pkgs, p.pkg)
	}
	names, err := vmrun.BuildTests(r.Cfg.Repo, dir, pkgs...)
	if err != nil {
		t.Errorf("scenario 10: %v", err)
		return
	}
	var plan strings.Builder
	for i, p := range s10Tests {
		fmt.Fprintf(&plan, "%s ^(%s)$\n", names[i], strings.Join(p.tests, "|"))
	}
	if err := vmrun.WriteFile(filepath.Join(dir, "plan"), []byte(plan.String()), 0o644); err != nil {
		t.Errorf("scenario 10: %v", err)
		return
	}
	vmrun.Logf(t, "scenario 10: compiled the tests of %d packages in %s", len(pkgs), time.Since(t0).Round(100*time.Millisecond))
}

var testVerdict = regexp.MustCompile(`(?m)^\s*--- (PASS|FAIL|SKIP): (\S+)`)

func checkGuestTests(t *testing.T, r *run) {
	b := r.ran(t, "s10-guest-tests")
	t.Logf("guest cgroup v2 controllers: %s", b.Facts["s10.controllers"])
	for _, p := range s10Tests {
		bin := filepath.Base(p.pkg) + ".test"
		log, err := os.ReadFile(filepath.Join(b.OutDir, "s10-"+bin+".log"))
		if err != nil {
			t.Errorf("%s: no log: %v", p.pkg, err)
			continue
		}
		verdicts, counts := map[string]string{}, map[string]int{}
		for _, m := range testVerdict.FindAllStringSubmatch(string(log), -1) {
			verdicts[m[2]] = m[1]
			counts[m[1]]++
		}
		t.Logf("%s in the guest: %d passed, %d failed, %d skipped (subtests included)", p.pkg, counts["PASS"], counts["FAIL"], counts["SKIP"])
		for name, v := range verdicts {
			if v != "PASS" {
				t.Errorf("%s: %s %s in the guest:\n%s", p.pkg, name, v, vmrun.Tail(string(log), 40))
			}
		}
		for _, name := range p.tests {
			if verdicts[name] != "PASS" {
				t.Errorf("%s: %s did not pass in the guest (%q)", p.pkg, name, verdicts[name])
			}
		}
		if code := b.Facts["s10."+bin+".exit"]; code != "0" {
			t.Errorf("%s: the test binary exited %q in the guest:\n%s", p.pkg, code, vmrun.Tail(string(log), 40))
		}
	}
}
