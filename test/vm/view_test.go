//go:build e2e

package vm

import (
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

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
