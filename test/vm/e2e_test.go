//go:build e2e

// Package vm proves, in a real Debian VM with systemd and udev, that sparsevol
// volumes survive reboots: clean ones and hard resets. Run it with `make e2e`
// (go test -tags e2e ./test/vm/); see README.md in this directory.
package vm

import (
	"fmt"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

const (
	storeDir = "/srv/sparsevol-store"
	oldDir   = "/var/lib/metalk8s/storage/sparse"
)

// The boots, in order. Each scenario's setup and check steps are spread over
// them so that the whole test needs five boots:
//
//	b1  first boot: a volume made by hand (1)
//	b2  baseline boot (no sparsevol volume yet): check 1; set up 2 (whose
//	    volumes 5 reuses), 4, 6 -> systemctl reboot
//	b3  check 2, 4, 6; stop and delete the volumes of 2 (5); set up 3
//	    -> killed after fsync
//	b4  check 3 and that 5 left nothing; delete every volume (7)
//	    -> systemctl reboot; the host creates the 100 volumes offline
//	    (see provisionScale)
//	b5  check 7 -> poweroff
type planStep struct {
	vmrun.Step
	scenario string // space-separated scenarios the step serves; "" for all
}

type planBoot struct {
	spec vmrun.BootSpec
	// after runs on the host once the boot ended, before the next one.
	after func(t *testing.T, r *run)
}

func plan(cfg config) []planBoot {
	const (
		short = 300 * time.Second
		long  = 1800 * time.Second
	)
	collect := planStep{vmrun.Step{Name: "collect", Timeout: 120 * time.Second}, ""}
	step := func(name, scenario string, limit time.Duration) planStep {
		return planStep{vmrun.Step{Name: name, Timeout: limit}, scenario}
	}
	all := []struct {
		name  string
		steps []planStep
		after func(t *testing.T, r *run)
	}{
		{name: "b1-first", steps: []planStep{collect,
			step("s1-setup", "1", short),
		}},
		{name: "b2-baseline", steps: []planStep{collect,
			step("baseline", "7", short),
			step("s1-check", "1", short),
			step("s2-setup", "2 5", short),
			step("s4-setup", "4", short),
			step("s6-setup", "6", short),
		}},
		{name: "b3-after-clean-reboot", steps: []planStep{collect,
			step("s2-check", "2 5", short),
			step("s4-check", "4", short),
			step("s6-check", "6", short),
			step("s5-stop-delete", "5", short),
			step("s3-setup", "3", short),
		}},
		{name: "b4-after-hard-reset", steps: []planStep{collect,
			step("s3-check", "3", short),
			step("s5-check-gone", "5", short),
			step("s7-clear", "7", short),
			step("s7-create", "7", long), // only with SPARSEVOL_E2E_SCALE_IN_GUEST
		}, after: func(t *testing.T, r *run) {
			if r.cfg.scaleGuest || !r.cfg.wants("7") {
				return
			}
			r.scale, r.scaleErr = r.provisionScale(t)
			if r.scale != nil {
				vmrun.Logf(t, "scale: %d volumes created offline on the host in %s", len(r.scale.names), r.scale.created.Round(100*time.Millisecond))
			}
		}},
		{name: "b5-scale", steps: []planStep{collect,
			step("s7-check", "7", short),
		}},
	}
	env := map[string]string{"S7_COUNT": fmt.Sprint(cfg.scaleCount), "S7_SIZE": cfg.scaleSize}
	var boots []planBoot
	for _, b := range all {
		var steps []vmrun.Step
		selected := false
		next := vmrun.Reboot
		for _, s := range b.steps {
			if s.Name == "s7-create" && !cfg.scaleGuest {
				continue
			}
			if s.scenario == "" || cfg.wantsAny(s.scenario) {
				steps = append(steps, s.Step)
				selected = selected || s.scenario != ""
				if s.Name == "s3-setup" {
					next = vmrun.Kill
				}
			}
		}
		if selected {
			boots = append(boots, planBoot{vmrun.BootSpec{Name: b.name, Steps: steps, Next: next, Env: env}, b.after})
		}
	}
	if len(boots) > 0 {
		boots[len(boots)-1].spec.Next = vmrun.Poweroff
	}
	return boots
}

func (c config) wants(scenario string) bool { return c.only == nil || c.only[scenario] }

// wantsAny reports whether any of the space-separated scenarios is selected.
func (c config) wantsAny(scenarios string) bool {
	for _, s := range strings.Fields(scenarios) {
		if c.wants(s) {
			return true
		}
	}
	return false
}

func TestReboot(t *testing.T) {
	vmrun.RequireHost(t)
	total := time.Now()
	cfg := loadConfig(t)
	vcfg := vmrun.LoadConfig(t, 1024)
	img := vmrun.BaseImage(t, vcfg)

	// Scenario 1 alone needs nothing of sparsevol; everything else needs it
	// installed in the image.
	install := false
	for _, s := range []string{"2", "3", "4", "5", "6", "7"} {
		install = install || cfg.wants(s)
	}
	r := &run{Run: vmrun.NewRun(t, vcfg, img, suite(install)), cfg: cfg, results: map[string]*bootView{}}
	defer r.Close(t)

	for _, b := range plan(cfg) {
		if res := r.boot(t, b.spec); res.Err != nil {
			break
		}
		if b.after != nil {
			b.after(t, r)
		}
	}

	scenarios := []struct {
		id, name string
		check    func(t *testing.T, r *run)
	}{
		{"1", "1-original-failure-reproduced", checkOriginalFailure},
		{"2", "2-clean-reboot", checkCleanReboot},
		{"3", "3-hard-reset", checkHardReset},
		{"4", "4-store-on-own-disk", checkStoreDisk},
		{"5", "5-stop-and-delete", checkStopDelete},
		{"6", "6-adopt-old-install", checkAdopt},
		{"7", "7-scale", checkScale},
	}
	for _, s := range scenarios {
		if !cfg.wants(s.id) {
			continue
		}
		t.Run(s.name, func(t *testing.T) { s.check(t, r) })
	}
	r.printFigures(t, img, time.Since(total))
}

// need returns the named boot's result, failing t when that boot did not
// complete.
func (r *run) need(t *testing.T, name string) *bootView {
	t.Helper()
	b := r.results[name]
	if b == nil {
		vmrun.Need(t, nil, name)
		t.FailNow()
	}
	if !vmrun.Need(t, b.Result, name) {
		t.FailNow()
	}
	return b
}

// needStep fails t when a step did not run to its end or recorded a
// failure.
func needStep(t *testing.T, b *bootView, step string) {
	t.Helper()
	vmrun.NeedStep(t, b.Result, step)
}

// linkOf is the path Kubernetes is given for a volume of this kind, the one
// the design fixes; whole raw volumes have none under /dev/disk (their
// stable path is whatever `sparsevol status` reports).
func linkOf(kind, uuid string) string {
	switch kind {
	case "ext4", "xfs":
		return "/dev/disk/by-uuid/" + uuid
	case "block":
		return "/dev/disk/by-partuuid/" + uuid
	}
	return ""
}

var partitionTarget = regexp.MustCompile(`(^|/)loop[0-9]+p1$`)

// checkBack checks one volume set up in boot setup and expected back in boot
// after: at kubelet's start its stable path exists and its unit is active;
// afterwards its data, filesystem UUID and identity are unchanged.
func checkBack(t *testing.T, setup, after *bootView, name string) {
	t.Helper()
	uuid := setup.Facts[name+".uuid"]
	kind := setup.Facts[name+".kind"]
	if uuid == "" || setup.Facts[name+".create"] == "failed" {
		t.Errorf("volume %s: not created in boot %s", name, setup.Spec.Name)
		return
	}
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	unit := "sparsevol@" + uuid + ".service"
	if setup.Facts[name+".sha"] == "" {
		add("no data was written in boot %s", setup.Spec.Name)
	}
	link := linkOf(kind, uuid)
	if link != "" && setup.Facts[name+".linkAtCreate"] == "no" {
		add("%s did not exist when create/attach returned (boot %s)", link, setup.Spec.Name)
	}
	stable := setup.Facts[name+".stablePath"]
	if setup.Facts[name+".stableAtCreate"] == "no" {
		add("stable path %s did not exist when create/attach returned (boot %s)", stable, setup.Spec.Name)
	}
	if link != "" && stable != "" && stable != link {
		add("sparsevol status reports stablePath %s, want %s", stable, link)
	}

	k := after.kubelet
	if !k.ran {
		add("kubelet.service did not run in boot %s", after.Spec.Name)
	} else {
		if link != "" {
			target, ok := k.links[link]
			switch {
			case !ok:
				add("%s missing at kubelet start (uptime %ss)", link, k.uptime)
			case kind == "block" && !partitionTarget.MatchString(target):
				add("%s -> %s at kubelet start, want a loopNp1 partition", link, target)
			}
		} else if stable != "" {
			if _, ok := k.links[stable]; !ok {
				add("stable path %s (from sparsevol status) missing at kubelet start (uptime %ss)", stable, k.uptime)
			}
		}
		if kind == "raw" {
			backing := setup.Facts[name+".backingFile"]
			if _, ok := k.loops[backing]; !ok {
				add("no loop device backed by %s at kubelet start", backing)
			}
		}
		if st := k.units[unit]; st != "active" {
			add("unit %s is %q at kubelet start, want active", unit, st)
		}
	}

	f := after.Facts
	if f[name+".status"] != "ok" {
		add("sparsevol status failed after the reboot")
	} else if f[name+".attached"] != "true" {
		add("sparsevol status says attached=%s", f[name+".attached"])
	}
	if got, want := f[name+".sha"], setup.Facts[name+".sha"]; got != want {
		add("data checksum after reboot %q, want %q", got, want)
	}
	if kind == "ext4" || kind == "xfs" {
		if got := f[name+".fsUUID"]; got != uuid {
			add("filesystem UUID after reboot %q, want %q", got, uuid)
		}
		if got, want := f[name+".fsIdentity"], setup.Facts[name+".fsIdentity"]; got != want || want == "" {
			add("filesystem reformatted? identity (ext4 creation time / xfs superblock uuid) %q, want %q", got, want)
		}
	}
	if len(problems) > 0 {
		t.Errorf("volume %s (%s, uuid %s), boot %s:\n  - %s\n  journal of %s (journalctl -u %s -b):\n%s",
			name, kind, uuid, after.Spec.Name, strings.Join(problems, "\n  - "), unit, unit, after.journal(uuid))
	} else {
		t.Logf("volume %s (%s, %s): back at kubelet start, data intact", name, kind, uuid)
	}
}

func volumesOf(b *bootView, prefix string) []string {
	var names []string
	for k := range b.Facts {
		if strings.HasPrefix(k, prefix+"-") && strings.HasSuffix(k, ".kind") {
			names = append(names, strings.TrimSuffix(k, ".kind"))
		}
	}
	sort.Strings(names)
	return names
}

func checkOriginalFailure(t *testing.T, r *run) {
	setup := r.need(t, "b1-first")
	needStep(t, setup, "s1-setup")
	after := r.need(t, "b2-baseline")
	needStep(t, after, "s1-check")
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
}

func checkSet(t *testing.T, r *run, setupBoot, setupStep, afterBoot, checkStep, prefix string, wantN int) {
	t.Helper()
	setup := r.need(t, setupBoot)
	needStep(t, setup, setupStep)
	after := r.need(t, afterBoot)
	needStep(t, after, checkStep)
	names := volumesOf(setup, prefix)
	if len(names) != wantN {
		t.Errorf("boot %s made %d %s volumes (%v), want %d", setupBoot, len(names), prefix, names, wantN)
	}
	for _, n := range names {
		checkBack(t, setup, after, n)
	}
}

func checkCleanReboot(t *testing.T, r *run) {
	checkSet(t, r, "b2-baseline", "s2-setup", "b3-after-clean-reboot", "s2-check", "s2", 4)
}

func checkHardReset(t *testing.T, r *run) {
	setup := r.need(t, "b3-after-clean-reboot")
	if !setup.Killed {
		t.Errorf("boot %s was not ended by a hard reset", setup.Spec.Name)
	}
	checkSet(t, r, "b3-after-clean-reboot", "s3-setup", "b4-after-hard-reset", "s3-check", "s3", 4)
}

func checkStoreDisk(t *testing.T, r *run) {
	checkSet(t, r, "b2-baseline", "s4-setup", "b3-after-clean-reboot", "s4-check", "s4", 2)
	setup := r.results["b2-baseline"]
	after := r.results["b3-after-clean-reboot"]
	if after.Facts["s4.storeMounted"] == "" {
		t.Errorf("%s is not mounted after the reboot", storeDir)
	}
	mountUnit := `srv-sparsevol\x2dstore.mount`
	mount := after.mounts[mountUnit]
	mounted, _ := vmrun.Monotonic(mount["ActiveEnterTimestampMonotonic"])
	for _, n := range volumesOf(setup, "s4") {
		unit := "sparsevol@" + setup.Facts[n+".uuid"] + ".service"
		props, ok := after.units[unit]
		if !ok {
			t.Errorf("%s: unit %s not loaded", n, unit)
			continue
		}
		if !containsUnit(props["After"], mountUnit) {
			t.Errorf("%s: unit %s is not ordered after %s (RequiresMountsFor=%q)", n, unit, mountUnit, props["RequiresMountsFor"])
		}
		started, ok := vmrun.Monotonic(props["InactiveExitTimestampMonotonic"])
		if ok && mounted > 0 && started < mounted {
			t.Errorf("%s: unit %s started at %s, before the store was mounted at %s", n, unit, started, mounted)
		}
	}
}

// checkStopDelete: the volumes of scenario 2, once back after their reboot,
// are stopped and deleted; one more reboot must not bring anything back.
func checkStopDelete(t *testing.T, r *run) {
	setup := r.need(t, "b2-baseline")
	needStep(t, setup, "s2-setup")
	mid := r.need(t, "b3-after-clean-reboot")
	needStep(t, mid, "s5-stop-delete")
	after := r.need(t, "b4-after-hard-reset")
	needStep(t, after, "s5-check-gone")
	names := volumesOf(setup, "s2")
	if len(names) != 4 {
		t.Errorf("boot %s made %d volumes (%v), want 4", setup.Spec.Name, len(names), names)
	}
	for _, n := range names {
		uuid := setup.Facts[n+".uuid"]
		kind := setup.Facts[n+".kind"]
		checkBack(t, setup, mid, n)
		var problems []string
		add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
		f := mid.Facts
		if f["s5.bootDone"] != "yes" {
			add("the boot was not marked done after %s ran", "sparsevol-boot-done.service")
		}
		if f[n+".restartExit"] != "0" || f[n+".afterRestart.loops"] == "" {
			add("systemctl restart after the boot exited %s and left loop devices %q; want the volume attached again", f[n+".restartExit"], f[n+".afterRestart.loops"])
		}
		if f[n+".afterRestart.link"] == "no" {
			add("after restart %s is missing", linkOf(kind, uuid))
		}
		if f[n+".stopExit"] != "0" {
			add("systemctl stop exited %s", f[n+".stopExit"])
		}
		if st := f[n+".afterStop.unitActive"]; st != "inactive" {
			add("after stop the unit is %q, want inactive", st)
		}
		if l := f[n+".afterStop.loops"]; l != "" {
			add("after stop a loop device is still attached: %s", l)
		}
		if f[n+".afterStop.link"] == "yes" {
			add("after stop %s still exists", linkOf(kind, uuid))
		}
		if a := f[n+".afterStop.attached"]; a != "false" {
			add("after stop sparsevol status says attached=%s", a)
		}
		if f[n+".deleteExit"] != "0" {
			add("sparsevol delete exited %s", f[n+".deleteExit"])
		}
		problems = append(problems, goneProblems(f, n+".afterDelete", "after delete")...)
		problems = append(problems, goneProblems(after.Facts, n+".afterReboot", "after one more reboot")...)
		unit := "sparsevol@" + uuid + ".service"
		if after.kubelet.ran {
			if st, ok := after.kubelet.units[unit]; ok && st != "inactive" {
				add("after one more reboot, at kubelet start, unit %s is %s", unit, st)
			}
			for l := range after.kubelet.links {
				if strings.Contains(l, uuid) {
					add("after one more reboot, at kubelet start, %s exists", l)
				}
			}
		}
		if len(problems) > 0 {
			t.Errorf("volume %s (%s, uuid %s):\n  - %s\n  journal of %s in boot %s:\n%s", n, kind, uuid,
				strings.Join(problems, "\n  - "), unit, mid.Spec.Name, mid.journal(uuid))
		} else {
			t.Logf("volume %s (%s): stop detached it, delete removed it, nothing left after a reboot", n, kind)
		}
	}
}

// containsUnit reports whether a `systemctl show` unit list (space
// separated, names with backslashes quoted and escaped) holds unit.
func containsUnit(list, unit string) bool {
	for _, f := range strings.Fields(list) {
		f = strings.ReplaceAll(strings.Trim(f, `"`), `\\`, `\`)
		if f == unit {
			return true
		}
	}
	return false
}

func goneProblems(f map[string]string, p, when string) []string {
	var out []string
	add := func(format string, args ...any) { out = append(out, when+": "+fmt.Sprintf(format, args...)) }
	if st := f[p+".unitActive"]; st == "active" || st == "activating" || st == "" {
		add("unit is %q", st)
	}
	if st := f[p+".unitEnabled"]; st == "enabled" || st == "enabled-runtime" || st == "" {
		add("unit is-enabled says %q", st)
	}
	if l := f[p+".unitLinks"]; l != "" {
		add("unit links remain: %s", l)
	}
	if f[p+".fileExists"] != "no" {
		add("backing file exists=%s", f[p+".fileExists"])
	}
	if s := f[p+".storeFiles"]; s != "" {
		add("files of the volume remain in the store: %s", s)
	}
	if l := f[p+".loops"]; l != "" {
		add("loop devices remain: %s", l)
	}
	if l := f[p+".links"]; l != "" {
		add("stale /dev/disk links: %s", l)
	}
	if l := f[p+".listed"]; l != "0" {
		add("sparsevol list shows it (%s)", l)
	}
	return out
}

func checkAdopt(t *testing.T, r *run) {
	checkSet(t, r, "b2-baseline", "s6-setup", "b3-after-clean-reboot", "s6-check", "s6", 2)
	setup := r.results["b2-baseline"]
	after := r.results["b3-after-clean-reboot"]
	if setup.Facts["s6.adoptExit"] != "0" {
		t.Errorf("sparsevol adopt --dir %s exited %s; log:\n%s", oldDir, setup.Facts["s6.adoptExit"], setup.StepLog("s6-setup", 30))
	}
	for _, n := range []string{"s6-ext4", "s6-block"} {
		uuid := setup.Facts[n+".uuid"]
		if got, want := setup.Facts[n+".afterAdopt.backingFile"], oldDir+"/"+uuid; got != want {
			t.Errorf("%s: adopted backing file %q, want it in place at %q", n, got, want)
		}
		if got, want := after.Facts[n+".fileAfterReboot"], setup.Facts[n+".fileBefore"]; got != want {
			t.Errorf("%s: the file's content changed between adopt and the first use after the reboot (sha256 %s, before adopt %s)", n, got, want)
		}
	}
}

func checkScale(t *testing.T, r *run) {
	base := r.need(t, "b2-baseline")
	setup := r.need(t, "b4-after-hard-reset")
	needStep(t, setup, "s7-clear")
	if setup.Facts["s7.left"] != "0" {
		t.Errorf("%s volumes left in the default store after deleting all of them", setup.Facts["s7.left"])
	}
	set := r.scale
	if r.cfg.scaleGuest {
		needStep(t, setup, "s7-create")
		set = scaleFromGuest(setup)
	}
	if r.scaleErr != nil {
		t.Errorf("creating the scale set: %v", r.scaleErr)
	}
	if set == nil {
		t.Fatal("no scale set was created")
	}
	after := r.need(t, "b5-scale")
	names := set.names
	if len(names) != r.cfg.scaleCount {
		t.Errorf("made %d volumes, want %d", len(names), r.cfg.scaleCount)
	}
	vmrun.Logf(t, "scale: %d ext4 volumes of %s created on the %s in %s", len(names), r.cfg.scaleSize, set.where, set.created.Round(100*time.Millisecond))
	if !after.kubelet.ran {
		t.Fatalf("kubelet.service did not run in boot %s", after.Spec.Name)
	}
	var missing []string
	var last time.Duration
	lastName := ""
	shown := 0
	for _, n := range names {
		uuid := set.uuids[n]
		if uuid == "" {
			missing = append(missing, n+" (not created)")
			continue
		}
		unit := "sparsevol@" + uuid + ".service"
		var why []string
		if _, ok := after.kubelet.links["/dev/disk/by-uuid/"+uuid]; !ok {
			why = append(why, "/dev/disk/by-uuid/"+uuid+" missing at kubelet start")
		}
		if st := after.kubelet.units[unit]; st != "active" {
			why = append(why, fmt.Sprintf("unit %s is %q at kubelet start", unit, st))
		}
		if at, ok := vmrun.Monotonic(after.units[unit]["ActiveEnterTimestampMonotonic"]); ok && at > last {
			last, lastName = at, n
		}
		if len(why) > 0 {
			missing = append(missing, n)
			if shown < 5 {
				shown++
				t.Errorf("volume %s (uuid %s): %s\n  journal of %s:\n%s", n, uuid, strings.Join(why, "; "), unit, after.journal(uuid))
			}
		}
	}
	if len(missing) > 0 {
		t.Errorf("%d of %d volumes not back at kubelet start: %s", len(missing), len(names), strings.Join(missing, " "))
	}
	if got := after.Facts["s7.attached"]; got != fmt.Sprint(len(names)) {
		t.Errorf("sparsevol list shows %s of %d scale volumes attached after the boot", got, len(names))
	}

	k0, ok0 := base.kubeletStart()
	k1, ok1 := after.kubeletStart()
	u0, _ := vmrun.Monotonic(base.Facts["manager.UserspaceTimestampMonotonic"])
	u1, _ := vmrun.Monotonic(after.Facts["manager.UserspaceTimestampMonotonic"])
	if !ok0 || !ok1 {
		t.Errorf("kubelet start time missing (baseline %v, scale %v)", ok0, ok1)
		return
	}
	cost := k1 - k0
	r.figures = append(r.figures,
		fmt.Sprintf("scale: %d ext4 volumes; kernel start -> last volume attached (%s): %s", len(names), lastName, secs(last)),
		fmt.Sprintf("scale: kernel start -> kubelet start: %s with %d volumes, %s with none (baseline boot %s)", secs(k1), len(names), secs(k0), base.Spec.Name),
		fmt.Sprintf("scale: kernel start -> systemd (userspace): %s with volumes, %s baseline", secs(u1), secs(u0)),
		fmt.Sprintf("scale: boot cost of %d volumes (kubelet start with - without): %s (target < 5 s)", len(names), secs(cost)),
		fmt.Sprintf("scale: units started %s; became active %s", spread(after, set, "InactiveExitTimestampMonotonic"), spread(after, set, "ActiveEnterTimestampMonotonic")),
	)
	if c0, c1 := base.kubelet.cpu, after.kubelet.cpu; c0["busy"] > 0 && c1["busy"] > 0 {
		delta := func(k string) string { return fmt.Sprintf("%+.2f s", (c1[k] - c0[k]).Seconds()) }
		r.figures = append(r.figures, fmt.Sprintf(
			"scale: CPU time until kubelet start, with - without volumes: all CPUs busy %s, idle %s; systemd (PID 1) %s, udevd %s, journald %s; sparsevol-boot.service %s",
			delta("busy"), delta("idle"), delta("init.scope"), delta("systemd-udevd.service"), delta("systemd-journald.service"), secs(c1["sparsevol-boot.service"])))
	}
	b0, ok0 := vmrun.Monotonic(after.Facts["bootunit.InactiveExitTimestampMonotonic"])
	b1, ok1 := vmrun.Monotonic(after.Facts["bootunit.ActiveEnterTimestampMonotonic"])
	if ok0 && ok1 {
		r.figures = append(r.figures, fmt.Sprintf("scale: sparsevol-boot.service (attach --boot, one process) ran from %s to %s (%s)", secs(b0), secs(b1), secs(b1-b0)))
	} else {
		t.Errorf("sparsevol-boot.service did not run in boot %s (ActiveState %q, Result %q)", after.Spec.Name, after.Facts["bootunit.ActiveState"], after.Facts["bootunit.Result"])
	}
	for _, f := range r.figures {
		vmrun.Logf(t, "%s", f)
	}
	if cost > 5*time.Second {
		msg := fmt.Sprintf("boot cost of %d volumes is %s, over the 5 s target", len(names), secs(cost))
		if vmrun.EnvSet("STRICT_TIMING") {
			t.Error(msg)
		} else {
			vmrun.Logf(t, "WARNING: %s (SPARSEVOL_E2E_STRICT_TIMING=1 makes this a failure)", msg)
		}
	}
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

// spread summarises one timestamp of the scale set's units: first, median
// and last, and how many have it.
func spread(b *bootView, set *scaleSet, prop string) string {
	var ts []time.Duration
	for _, n := range set.names {
		if at, ok := vmrun.Monotonic(b.units["sparsevol@"+set.uuids[n]+".service"][prop]); ok {
			ts = append(ts, at)
		}
	}
	if len(ts) == 0 {
		return "(none)"
	}
	sort.Slice(ts, func(i, j int) bool { return ts[i] < ts[j] })
	return fmt.Sprintf("first %.1f s, median %.1f s, last %.1f s (%d units)",
		ts[0].Seconds(), ts[len(ts)/2].Seconds(), ts[len(ts)-1].Seconds(), len(ts))
}

// printFigures prints the measured boot figures of every boot.
func (r *run) printFigures(t *testing.T, img vmrun.Image, total time.Duration) {
	vmrun.Logf(t, "==== figures ====")
	if img.Built > 0 {
		vmrun.Logf(t, "image build (cold cache): %s", img.Built.Round(time.Second))
	} else {
		vmrun.Logf(t, "image build: cached")
	}
	vmrun.Logf(t, "times from kernel start; host load: the host's 1-minute load average when the boot started (2 cores)")
	vmrun.Logf(t, "%-24s %8s %10s %10s %8s %14s %10s", "boot", "wall", "userspace", "kubelet", "units", "last attached", "host load")
	for _, name := range r.Order {
		b := r.results[name]
		u, _ := vmrun.Monotonic(b.Facts["manager.UserspaceTimestampMonotonic"])
		k, _ := b.kubeletStart()
		var last time.Duration
		for _, props := range b.units {
			if at, ok := vmrun.Monotonic(props["ActiveEnterTimestampMonotonic"]); ok && at > last {
				last = at
			}
		}
		end := "exit"
		if b.Killed {
			end = "kill"
		}
		vmrun.Logf(t, "%-24s %7.1fs %9.2fs %9.2fs %8d %13.2fs %10s  (%s)", name, b.Wall.Seconds(), u.Seconds(), k.Seconds(), len(b.units), last.Seconds(), b.HostLoad, end)
	}
	for _, f := range r.figures {
		vmrun.Logf(t, "%s", f)
	}
	vmrun.Logf(t, "total: %s", total.Round(time.Second))
}
