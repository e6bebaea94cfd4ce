//go:build e2e

// Package vm proves, in a real Debian VM with systemd and udev, that sparsevol
// volumes survive reboots: clean ones and hard resets. Run it with `make e2e`
// (go test -tags e2e ./test/vm/); see README.md in this directory.
//
// This file is the suite: its boots (declared once, in timeline), what
// every boot collects, the run and its views, and the checks scenarios
// share. Each scenario is one file (s<n>_*_test.go): its guest steps inline,
// placed in the boots, and its verdict.
package vm

import (
	"embed"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// The suite's guest side: the volume helpers its steps share (lib.sh) and
// the kubelet stand-in.
//
//go:embed guest
var guestFiles embed.FS

// The store on its own disk (scenario 4) and the old install's directory
// (scenario 6); the steps see them as $STORE and $OLD_DIR.
const (
	storeDir = "/srv/sparsevol-store"
	oldDir   = "/var/lib/metalk8s/storage/sparse"

	short = 300 * time.Second // a step's limit
	long  = 1800 * time.Second
)

// The boots, in order; a scenario places its steps in them by name (a boot
// no selected scenario uses is skipped). Each boot reboots into the next;
// a boot with a hard-reset step ends killed right after it; the last
// powers off.
var timeline = vmrun.Timeline{
	Boots: []string{
		"b1-first",              // before sparsevol: a volume made by hand
		"b2-baseline",           // the boot without volumes; most setups
		"b3-after-clean-reboot", // checks after a clean reboot; ends in a hard reset
		"b4-after-hard-reset",   // checks after it; clears the store for the scale set
		"b5-scale",              // the scale set, created offline before it
		"b6-seed-scale",         // the same files, brought up by the seed's own units
	},
	Every: []vmrun.Step{collect},
}

// scenarios: each scenario file adds itself (var _ = scenarios.Add(...)).
var scenarios vmrun.Scenarios[*run]

// collect runs first in every boot: what kubelet.service saw, unit states
// and timestamps, the journal (read back by newView).
var collect = vmrun.Step{Name: "collect", Timeout: 120 * time.Second, Script: `
	if [ -d /run/e2e-kubelet ]; then
		cp -r /run/e2e-kubelet "$OUT/kubelet"
		fact kubelet.ran yes
	else
		fact kubelet.ran no
	fi
	read -r up _ </proc/uptime
	fact driver.uptime "$up"
	systemctl show -p UserspaceTimestampMonotonic -p InitRDTimestampMonotonic | sed 's/^/manager./' >>"$FACTS"
	systemctl show -p ActiveState -p ExecMainStartTimestampMonotonic kubelet.service | sed 's/^/kubelet./' >>"$FACTS"
	systemctl show -p ActiveState -p Result -p InactiveExitTimestampMonotonic -p ActiveEnterTimestampMonotonic \
		sparsevol-boot.service | sed 's/^/bootunit./' >>"$FACTS"
	systemctl show -p Id -p ActiveState -p SubState -p Result \
		-p InactiveExitTimestampMonotonic -p ActiveEnterTimestampMonotonic \
		-p After -p RequiresMountsFor 'sparsevol@*' >"$OUT/units.show"
	systemctl show -p Id -p ActiveState -p ActiveEnterTimestampMonotonic '*.mount' >"$OUT/mounts.show"
	journalctl -b -o json --no-pager -u 'sparsevol@*' >"$OUT/journal-units.json"
	journalctl -b -o short-monotonic --no-pager >"$OUT/journal.txt"
	fact uname "$(uname -r)"
`}

// config holds this suite's own settings; vmrun.Config the shared ones.
type config struct {
	scaleCount int
	scaleSize  string
	scaleGuest bool // create the scale set in the guest instead of offline
}

func loadConfig(t *testing.T) config {
	t.Helper()
	return config{
		scaleCount: vmrun.EnvInt(t, "SCALE", 100),
		scaleSize:  vmrun.Env("SCALE_SIZE", "16M"),
		scaleGuest: vmrun.EnvSet("SCALE_IN_GUEST"),
	}
}

// suite is what test/vm adds to a run: the store disk of scenario 4, the
// kubelet stand-in, and sparsevol installed unless asked not to (scenario
// 1 alone needs none of it).
func suite(install bool) vmrun.Suite {
	return vmrun.Suite{
		Name:     "e2e",
		Guest:    guestFiles,
		Disks:    []vmrun.Disk{{Name: "store.img", Size: "2G"}},
		Install:  install,
		Journals: []string{"sparsevol-boot.service"},
		Prepare: func(t testing.TB, root string) error {
			if err := vmrun.InstallFiles(guestFiles, root,
				vmrun.File{Src: "guest/kubelet.sh", Dst: "usr/local/lib/sparsevol-e2e/kubelet.sh", Mode: 0o755},
				vmrun.File{Src: "guest/kubelet.service", Dst: "etc/systemd/system/kubelet.service", Mode: 0o644},
			); err != nil {
				return err
			}
			return vmrun.EnableUnits(root, "kubelet.service")
		},
	}
}

// run is one execution of the suite.
type run struct {
	*vmrun.Run
	cfg      config
	results  map[string]*bootView
	figures  []string
	scale    *scaleSet
	scaleErr error
}

func TestReboot(t *testing.T) {
	vmrun.RequireHost(t)
	total := time.Now()
	cfg := loadConfig(t)
	vcfg := vmrun.LoadConfig(t, 1024)
	selected := scenarios.Selected(t)
	tl := timeline
	tl.Env = map[string]string{"STORE": storeDir, "OLD_DIR": oldDir,
		"S7_COUNT": fmt.Sprint(cfg.scaleCount), "S7_SIZE": cfg.scaleSize}
	if cfg.scaleGuest {
		tl.Env["S7_IN_GUEST"] = "1"
	}
	plan, err := vmrun.Plan(tl, selected)
	if err != nil {
		t.Fatal(err)
	}
	install := false
	for _, s := range selected {
		install = install || !strings.HasPrefix(s.ID, "1-")
	}
	img := vmrun.BaseImage(t, vcfg)
	r := &run{Run: vmrun.NewRun(t, vcfg, img, suite(install)), cfg: cfg, results: map[string]*bootView{}}
	defer r.Close(t)
	vmrun.Play(t, r, plan, selected, func(spec vmrun.BootSpec) *vmrun.Result {
		b := newView(r.Boot(t, spec))
		r.results[spec.Name] = b
		return b.Result
	})
	r.printFigures(t, img, time.Since(total))
}

// ran returns the view of the boot that ran step, failing t unless that
// step ran to its end without recording a failure.
func (r *run) ran(t *testing.T, step string) *bootView {
	t.Helper()
	res := r.Ran(step)
	if !vmrun.NeedStep(t, res, step) {
		t.FailNow()
	}
	return r.results[res.Spec.Name]
}

// booted returns the view of a boot that must have completed.
func (r *run) booted(t *testing.T, name string) *bootView {
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

// checkSet checks the volumes of a set (prefix) made by step setup and
// checked by step check after a reboot: wantN of them, each back.
func checkSet(t *testing.T, r *run, setupStep, checkStep, prefix string, wantN int) {
	t.Helper()
	setup := r.ran(t, setupStep)
	after := r.ran(t, checkStep)
	names := volumesOf(setup, prefix)
	if len(names) != wantN {
		t.Errorf("boot %s made %d %s volumes (%v), want %d", setup.Spec.Name, len(names), prefix, names, wantN)
	}
	for _, n := range names {
		checkBack(t, setup, after, n)
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

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

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

// bootView is one boot's result with what the collect step and the kubelet
// stand-in saved, parsed.
type bootView struct {
	*vmrun.Result
	units    map[string]map[string]string // `systemctl show 'sparsevol@*'`, by unit id
	mounts   map[string]map[string]string
	journals map[string][]string // journal lines per sparsevol unit
	kubelet  kubeletView
}

// kubeletView is what the kubelet stand-in recorded the moment it started.
type kubeletView struct {
	ran    bool
	uptime string
	links  map[string]string // "/dev/disk/by-uuid/<uuid>" (and /dev/sparsevol/*) -> link target
	units  map[string]string // "sparsevol@<uuid>.service" -> active state
	loops  map[string]string // backing file -> /dev/loopN
	// cpu is the CPU time used by the boot until kubelet started: "busy"
	// and "idle" over all CPUs (from /proc/stat), and per unit id.
	cpu map[string]time.Duration
}

func newView(res *vmrun.Result) *bootView {
	b := &bootView{Result: res}
	read := func(name string) string {
		data, _ := os.ReadFile(filepath.Join(res.OutDir, name))
		return string(data)
	}
	b.units = vmrun.ParseShow(read("units.show"))
	b.mounts = vmrun.ParseShow(read("mounts.show"))
	b.journals = vmrun.ParseJournal(strings.NewReader(read("journal-units.json")))
	b.kubelet = readKubelet(filepath.Join(res.OutDir, "kubelet"))
	return b
}

func (b *bootView) kubeletStart() (time.Duration, bool) {
	return vmrun.Monotonic(b.Facts["kubelet.ExecMainStartTimestampMonotonic"])
}

// kubeletDelay is how long after systemd took over kubelet started. The
// kernel and initrd before it do not depend on volumes, but their time
// moves with the host's load; boot costs compare this.
func (b *bootView) kubeletDelay() (time.Duration, bool) {
	k, ok := b.kubeletStart()
	u, ok2 := vmrun.Monotonic(b.Facts["manager.UserspaceTimestampMonotonic"])
	return k - u, ok && ok2
}

// journal returns the journal lines of the unit of volume uuid in this boot.
func (b *bootView) journal(uuid string) string {
	lines := b.journals["sparsevol@"+uuid+".service"]
	if len(lines) == 0 {
		return "    (no journal lines)"
	}
	return "    " + strings.Join(lines, "\n    ")
}

func readKubelet(dir string) kubeletView {
	k := kubeletView{links: map[string]string{}, units: map[string]string{}, loops: map[string]string{}}
	up, err := os.ReadFile(filepath.Join(dir, "uptime"))
	if err != nil {
		return k
	}
	k.ran = true
	k.uptime = strings.Fields(string(up) + " ?")[0]
	lines := func(name string) []string {
		b, _ := os.ReadFile(filepath.Join(dir, name))
		return strings.Split(string(b), "\n")
	}
	for _, line := range lines("disk-links") {
		if name, target, ok := strings.Cut(line, " "); ok {
			k.links[name] = target
		}
	}
	for _, line := range lines("units") {
		if f := strings.Fields(line); len(f) >= 3 && strings.HasPrefix(f[0], "sparsevol@") {
			k.units[f[0]] = f[2]
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "cpu")); err == nil {
		k.cpu = vmrun.ParseCPU(string(b))
	}
	for _, line := range lines("loops") {
		if dev, file, ok := strings.Cut(line, " "); ok {
			k.loops[file] = dev
		}
	}
	return k
}
