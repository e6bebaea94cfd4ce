package vmrun

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Result is what one boot left: how it ended and, per step, what the guest
// recorded.
type Result struct {
	Spec     BootSpec
	Wall     time.Duration // qemu start to qemu exit
	HostLoad string        // the host's 1-minute load average when the boot started
	Killed   bool          // ended by a hard reset after the guest reported ready
	Err      error         // the boot itself failed (timeout, crash, driver never ran)
	Console  string        // serial console log
	OutDir   string        // what the guest wrote for this boot
	Journal0 string        // unit whose journal failure messages quote
	Facts    map[string]string
	Steps    map[string]*StepResult
}

// StepResult is one step as the guest driver recorded it.
type StepResult struct {
	Name     string
	Exit     int // -1: the step did not run
	Ms       int
	Facts    map[string]string
	Failures []string // what the step could not observe or do ("fail" lines)
}

// load reads what the guest wrote for this boot; Facts merges every
// step's, later steps winning.
func (b *Result) load() {
	b.Facts = map[string]string{}
	b.Steps = map[string]*StepResult{}
	for _, s := range b.Spec.Steps {
		st := &StepResult{Name: s.Name, Exit: -1, Facts: map[string]string{}}
		b.Steps[s.Name] = st
		if f, err := os.Open(filepath.Join(b.OutDir, s.Name+".facts")); err == nil {
			st.Facts, st.Failures = ParseFacts(f)
			f.Close()
		}
		for k, v := range st.Facts {
			b.Facts[k] = v
		}
		st.Exit = readInt(filepath.Join(b.OutDir, s.Name+".rc"), -1)
		st.Ms = readInt(filepath.Join(b.OutDir, s.Name+".ms"), 0)
	}
}

func readInt(path string, def int) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return def
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return def
	}
	return n
}

// Step returns the named step's record (Exit -1 when it did not run).
func (b *Result) Step(name string) *StepResult {
	if st, ok := b.Steps[name]; ok {
		return st
	}
	return &StepResult{Name: name, Exit: -1, Facts: map[string]string{}}
}

// StepLog returns the last n lines of a step's output.
func (b *Result) StepLog(name string, n int) string {
	return TailFile(filepath.Join(b.OutDir, name+".log"), n)
}

// Journal returns the last n lines of a unit's journal of this boot, as the
// driver saved it for the suite's Journals.
func (b *Result) Journal(unit string, n int) string {
	return TailFile(filepath.Join(b.OutDir, "journal", strings.ReplaceAll(unit, "*", "all")+".log"), n)
}

// Need fails t unless the boot completed (b nil: it did not run); it
// reports whether it did.
func Need(t testing.TB, b *Result, name string) bool {
	t.Helper()
	switch {
	case b == nil:
		t.Errorf("boot %s did not run (an earlier boot failed)", name)
	case b.Err != nil:
		t.Errorf("boot %s failed: %v\nlast console lines (%s):\n%s", name, b.Err, b.Console, TailFile(b.Console, 40))
	default:
		return true
	}
	return false
}

// NeedStep fails t unless the boot completed and the step ran to its end
// (exit 0) without recording a failure. The message names each failure,
// the end of the step's log and of the suite's first journal.
func NeedStep(t testing.TB, b *Result, step string) bool {
	t.Helper()
	if b == nil {
		t.Errorf("step %s: its boot did not run (an earlier boot failed)", step)
		return false
	}
	if !Need(t, b, b.Spec.Name) {
		return false
	}
	st := b.Step(step)
	if st.Exit == 0 && len(st.Failures) == 0 {
		return true
	}
	what := fmt.Sprintf("exited %d", st.Exit)
	if st.Exit == -1 {
		what = "did not run"
	}
	t.Errorf("boot %s: step %s %s; failures recorded:%s\n%s", b.Spec.Name, step, what, bullets(st.Failures), b.excerpt(step))
	return false
}

// Expect fails t unless the step recorded each fact of pairs (key, want,
// key, want, ...) with that value; the message names each fact that
// differs, the value found, the step's log and the suite's journal
// excerpt. It reports whether all matched.
func Expect(t testing.TB, b *Result, step string, pairs ...string) bool {
	t.Helper()
	if len(pairs)%2 != 0 {
		panic("vmrun.Expect: odd number of key/value arguments")
	}
	facts := b.Step(step).Facts
	var wrong []string
	for i := 0; i < len(pairs); i += 2 {
		key, want := pairs[i], pairs[i+1]
		got, ok := facts[key]
		switch {
		case !ok:
			wrong = append(wrong, fmt.Sprintf("fact %s not recorded, want %q", key, want))
		case got != want:
			wrong = append(wrong, fmt.Sprintf("fact %s = %q, want %q", key, got, want))
		}
	}
	if len(wrong) == 0 {
		return true
	}
	t.Errorf("boot %s: step %s:%s\n%s", b.Spec.Name, step, bullets(wrong), b.excerpt(step))
	return false
}

func (b *Result) excerpt(step string) string {
	s := fmt.Sprintf("---- log of step %s (%s, last 60 lines):\n%s", step, filepath.Join(b.OutDir, step+".log"), b.StepLog(step, 60))
	if b.Journal0 != "" {
		s += fmt.Sprintf("\n---- journal of %s (last 30 lines):\n%s", b.Journal0, b.Journal(b.Journal0, 30))
	}
	return s
}

func bullets(s []string) string {
	if len(s) == 0 {
		return " none"
	}
	return "\n  - " + strings.Join(s, "\n  - ")
}

// ParseFacts reads a step's facts file: "key=value" lines, the last value
// of a key winning; lines "fail=message" are the step's failures, in order.
func ParseFacts(r io.Reader) (facts map[string]string, failures []string) {
	facts = map[string]string{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), "=")
		switch {
		case !ok:
		case k == "fail":
			failures = append(failures, v)
		default:
			facts[k] = v
		}
	}
	return facts, failures
}

// ParseShow parses `systemctl show` output of several units: blocks of
// Key=Value lines split by blank lines, keyed by their Id.
func ParseShow(text string) map[string]map[string]string {
	out := map[string]map[string]string{}
	for _, block := range strings.Split(text, "\n\n") {
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

// ParseJournal groups `journalctl -o json` lines by the unit they belong
// to: lines of the unit's processes (_SYSTEMD_UNIT) and systemd's lines
// about it (UNIT), each as "[monotonic seconds] identifier: message".
func ParseJournal(r io.Reader) map[string][]string {
	out := map[string][]string{}
	sc := bufio.NewScanner(r)
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

// Monotonic returns a systemd monotonic timestamp (µs since kernel start)
// as a duration; ok is false when it is missing or zero.
func Monotonic(v string) (time.Duration, bool) {
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	if err != nil || n == 0 {
		return 0, false
	}
	return time.Duration(n) * time.Microsecond, true
}

// ParseCPU reads CPU accounting: the "cpu" line of /proc/stat (clock ticks
// of 10 ms: user nice system idle iowait irq softirq ...) as "busy" and
// "idle" over all CPUs, then `systemctl show -p Id -p CPUUsageNSec` blocks,
// one per unit, by unit id. Units without a figure ("[not set]", 2^64-1)
// are left out.
func ParseCPU(text string) map[string]time.Duration {
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
	for id, props := range ParseShow(units) {
		if ns, err := strconv.ParseInt(props["CPUUsageNSec"], 10, 64); err == nil {
			out[id] = time.Duration(ns)
		}
	}
	return out
}
