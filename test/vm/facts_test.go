//go:build e2e

package vm

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"
)

// kubeletView is what the kubelet stand-in recorded the moment it started.
type kubeletView struct {
	ran    bool
	uptime string
	links  map[string]string // "/dev/disk/by-uuid/<uuid>" (and /dev/sparsevol/*) -> link target
	units  map[string]string // "sparsevol@<uuid>.service" -> active state
	loops  map[string]string // backing file -> /dev/loopN
	// cpu is the CPU time used by the boot until kubelet started: "busy"
	// and "idle" over all CPUs (from /proc/stat), and per unit id.
	cpu    map[string]time.Duration
	rawErr string
}

// load reads everything the guest wrote for this boot.
func (b *bootResult) load() {
	b.facts = map[string]string{}
	b.steps = map[string]int{}
	for _, s := range b.spec.steps {
		readFacts(filepath.Join(b.outDir, s.name+".facts"), b.facts)
		b.steps[s.name] = -1
		if rc, err := os.ReadFile(filepath.Join(b.outDir, s.name+".rc")); err == nil {
			if n, err := strconv.Atoi(strings.TrimSpace(string(rc))); err == nil {
				b.steps[s.name] = n
			}
		}
	}
	b.units = readShow(filepath.Join(b.outDir, "units.show"))
	b.mounts = readShow(filepath.Join(b.outDir, "mounts.show"))
	b.journals = readJournal(filepath.Join(b.outDir, "journal-units.json"))
	b.kubelet = readKubelet(filepath.Join(b.outDir, "kubelet"))
}

func (b *bootResult) stepExit(name string) int {
	if rc, ok := b.steps[name]; ok {
		return rc
	}
	return -1
}

func (b *bootResult) stepLog(name string, n int) string {
	return tailFile(filepath.Join(b.outDir, name+".log"), n)
}

// monotonic returns a systemd monotonic timestamp (µs since kernel start) as
// a duration; ok is false when it is missing or zero.
func monotonic(v string) (time.Duration, bool) {
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	if err != nil || n == 0 {
		return 0, false
	}
	return time.Duration(n) * time.Microsecond, true
}

func (b *bootResult) kubeletStart() (time.Duration, bool) {
	return monotonic(b.facts["kubelet.ExecMainStartTimestampMonotonic"])
}

// journal returns the journal lines of the unit of volume uuid in this boot.
func (b *bootResult) journal(uuid string) string {
	lines := b.journals["sparsevol@"+uuid+".service"]
	if len(lines) == 0 {
		return "    (no journal lines)"
	}
	return "    " + strings.Join(lines, "\n    ")
}

func readFacts(path string, into map[string]string) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), "=")
		if ok {
			into[k] = v
		}
	}
}

// readShow parses `systemctl show` output for several units: blocks of
// Key=Value lines separated by blank lines, each with an Id.
func readShow(path string) map[string]map[string]string {
	out := map[string]map[string]string{}
	b, err := os.ReadFile(path)
	if err != nil {
		return out
	}
	for _, block := range strings.Split(string(b), "\n\n") {
		props := map[string]string{}
		for _, line := range strings.Split(block, "\n") {
			if k, v, ok := strings.Cut(line, "="); ok {
				props[k] = v
			}
		}
		if id := props["Id"]; id != "" {
			out[id] = props
		}
	}
	return out
}

// readJournal groups `journalctl -o json` lines by the unit they belong to:
// lines of the unit's processes (_SYSTEMD_UNIT) and systemd's lines about it
// (UNIT).
func readJournal(path string) map[string][]string {
	out := map[string][]string{}
	f, err := os.Open(path)
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 4<<20)
	for sc.Scan() {
		var e map[string]any
		if json.Unmarshal(sc.Bytes(), &e) != nil {
			continue
		}
		unit, _ := e["UNIT"].(string)
		if unit == "" {
			unit, _ = e["_SYSTEMD_UNIT"].(string)
		}
		if unit == "" {
			continue
		}
		var ts float64
		if s, ok := e["__MONOTONIC_TIMESTAMP"].(string); ok {
			n, _ := strconv.ParseInt(s, 10, 64)
			ts = float64(n) / 1e6
		}
		ident, _ := e["SYSLOG_IDENTIFIER"].(string)
		out[unit] = append(out[unit], fmt.Sprintf("[%10.6f] %s: %s", ts, ident, journalMessage(e["MESSAGE"])))
	}
	return out
}

// journalMessage decodes MESSAGE, which journalctl gives as a string or, for
// non-UTF-8 text, as an array of bytes.
func journalMessage(v any) string {
	switch m := v.(type) {
	case string:
		return m
	case []any:
		b := make([]byte, 0, len(m))
		for _, x := range m {
			if f, ok := x.(float64); ok {
				b = append(b, byte(f))
			}
		}
		return string(b)
	}
	return fmt.Sprint(v)
}

func readKubelet(dir string) kubeletView {
	k := kubeletView{links: map[string]string{}, units: map[string]string{}, loops: map[string]string{}}
	up, err := os.ReadFile(filepath.Join(dir, "uptime"))
	if err != nil {
		return k
	}
	k.ran = true
	k.uptime = strings.Fields(string(up) + " ?")[0]
	if b, err := os.ReadFile(filepath.Join(dir, "disk-links")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if name, target, ok := strings.Cut(line, " "); ok {
				k.links[name] = target
			}
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "units")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) >= 3 && strings.HasPrefix(f[0], "sparsevol@") {
				k.units[f[0]] = f[2]
			} else if strings.TrimSpace(line) != "" {
				k.rawErr += line + "\n"
			}
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "cpu")); err == nil {
		k.cpu = parseCPU(string(b))
	}
	if b, err := os.ReadFile(filepath.Join(dir, "loops")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if dev, file, ok := strings.Cut(line, " "); ok {
				k.loops[file] = dev
			}
		}
	}
	return k
}

func (k kubeletView) unitNames() []string {
	var names []string
	for n := range k.units {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// parseCPU reads kubelet.sh's cpu file: the "cpu" line of /proc/stat (in
// clock ticks of 10 ms: user nice system idle iowait irq softirq ...), then
// `systemctl show -p Id -p CPUUsageNSec` of some units: one block of
// properties per unit, in systemctl's order, blocks split by blank lines.
func parseCPU(text string) map[string]time.Duration {
	out := map[string]time.Duration{}
	const tick = 10 * time.Millisecond
	head, units, _ := strings.Cut(text, "\n")
	if f := strings.Fields(head); len(f) >= 8 && f[0] == "cpu" {
		var v [7]int64
		for i := range v {
			v[i], _ = strconv.ParseInt(f[i+1], 10, 64)
		}
		out["busy"] = time.Duration(v[0]+v[1]+v[2]+v[5]+v[6]) * tick
		out["idle"] = time.Duration(v[3]+v[4]) * tick
	}
	for _, block := range strings.Split(units, "\n\n") {
		props := map[string]string{}
		for _, line := range strings.Split(block, "\n") {
			if k, v, ok := strings.Cut(line, "="); ok {
				props[k] = v
			}
		}
		// "[not set]" or 2^64-1 where systemd has no figure: left out.
		if ns, err := strconv.ParseInt(props["CPUUsageNSec"], 10, 64); err == nil && props["Id"] != "" {
			out[props["Id"]] = time.Duration(ns)
		}
	}
	return out
}
