package vmrun

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// Scenario is one thing a suite proves, written in one file: the guest
// steps it places in the suite's boots (their shell inline, Step.Script),
// the host work it needs between two boots, and its verdict, drawn in Go
// from the facts those steps recorded. R is the suite's run (what Check
// and After are handed).
type Scenario[R any] struct {
	// ID names the subtest, "<n>-<words>" ("2-clean-reboot"); n orders the
	// scenarios and SPARSEVOL_E2E_ONLY selects by it.
	ID string
	// Steps are placed in the boots of the suite's timeline in this order,
	// after the steps of earlier scenarios. A step another scenario already
	// placed in the same boot (same name) runs once: a scenario that builds
	// on another lists the steps it needs from it.
	Steps []Placed
	// Before is host work to do before the named boot starts (after the
	// boot before it ended, if any).
	Before map[string]func(t *testing.T, r R)
	// After is host work to do once the named boot ended, before the next.
	After map[string]func(t *testing.T, r R)
	// Check decides pass or fail, as the subtest ID.
	Check func(t *testing.T, r R)
}

// Placed is a step in a boot of the suite's timeline. A step whose boot
// must end in a hard reset (Then: Kill) runs last in that boot.
type Placed struct {
	Boot string
	Step Step
	Then string // "" or Kill
}

// At places step in boot.
func At(boot string, step Step) Placed { return Placed{Boot: boot, Step: step} }

// Scenarios is a suite's scenario list: each scenario file adds itself
// with Add, in a package-level declaration (var _ = all.Add(...)).
type Scenarios[R any] struct {
	list []Scenario[R]
}

// Add adds s; it returns nothing of use and exists so that a scenario
// file can add itself in a var declaration.
func (ss *Scenarios[R]) Add(s Scenario[R]) struct{} {
	ss.list = append(ss.list, s)
	return struct{}{}
}

// Selected returns the scenarios SPARSEVOL_E2E_ONLY selects (a comma-
// separated list of their numbers; all when unset), ordered by number.
func (ss *Scenarios[R]) Selected(t testing.TB) []Scenario[R] {
	t.Helper()
	only := Only(Env("ONLY", ""))
	var out []Scenario[R]
	for _, s := range ss.list {
		n, _, _ := strings.Cut(s.ID, "-")
		if only == nil || only[n] {
			out = append(out, s)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return scenarioLess(out[i].ID, out[j].ID) })
	return out
}

// Only parses a SPARSEVOL_E2E_ONLY value: the selected scenario numbers,
// nil for all.
func Only(v string) map[string]bool {
	if strings.TrimSpace(v) == "" {
		return nil
	}
	m := map[string]bool{}
	for _, s := range strings.Split(v, ",") {
		m[strings.TrimSpace(s)] = true
	}
	return m
}

// scenarioLess orders IDs by their leading number, then as strings
// ("3-x" < "3b-y" < "10-z").
func scenarioLess(a, b string) bool {
	na, nb := leadingInt(a), leadingInt(b)
	if na != nb {
		return na < nb
	}
	return a < b
}

func leadingInt(s string) int {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	n, err := strconv.Atoi(s[:i])
	if err != nil {
		return 1 << 30
	}
	return n
}

// Timeline is a suite's boots in order, declared once. Every lists the
// steps each boot runs first (what every check reads, like a collect step).
type Timeline struct {
	Boots []string
	Every []Step
	Env   map[string]string // variables of every step of every boot
}

// Plan places the scenarios' steps in the timeline's boots. A boot no
// selected scenario places a step in is left out; each boot reboots into
// the next, except a boot with a Kill step (hard reset) and the last one
// (power off). A step placed in a boot the timeline lacks is an error.
func Plan[R any](tl Timeline, scenarios []Scenario[R]) ([]BootSpec, error) {
	type boot struct {
		steps []Step
		last  *Step
		seen  map[string]bool
	}
	byName := map[string]*boot{}
	for _, b := range tl.Boots {
		byName[b] = &boot{seen: map[string]bool{}}
	}
	for _, s := range scenarios {
		for _, p := range s.Steps {
			b := byName[p.Boot]
			if b == nil {
				return nil, fmt.Errorf("scenario %s: step %s placed in boot %q, which is not in the timeline %v", s.ID, p.Step.Name, p.Boot, tl.Boots)
			}
			if b.seen[p.Step.Name] {
				continue
			}
			b.seen[p.Step.Name] = true
			if p.Then == Kill {
				if b.last != nil {
					return nil, fmt.Errorf("boot %s: two steps end it with a hard reset (%s, %s)", p.Boot, b.last.Name, p.Step.Name)
				}
				st := p.Step
				b.last = &st
				continue
			}
			b.steps = append(b.steps, p.Step)
		}
	}
	var out []BootSpec
	for _, name := range tl.Boots {
		b := byName[name]
		if len(b.steps) == 0 && b.last == nil {
			continue
		}
		spec := BootSpec{Name: name, Next: Reboot, Env: tl.Env}
		spec.Steps = append(append([]Step{}, tl.Every...), b.steps...)
		if b.last != nil {
			spec.Steps = append(spec.Steps, *b.last)
			spec.Next = Kill
		}
		out = append(out, spec)
	}
	if len(out) > 0 && out[len(out)-1].Next == Reboot {
		out[len(out)-1].Next = Poweroff
	}
	return out, nil
}

// Play boots each boot of the plan in order with boot (the suite's: Boot,
// or a wrapper that reads more of what the guest left) and runs the
// scenarios' Before and After work around it; it stops at the first boot
// that failed. Then each scenario's Check runs as a subtest.
func Play[R any](t *testing.T, r R, plan []BootSpec, scenarios []Scenario[R], boot func(BootSpec) *Result) {
	t.Helper()
	for _, spec := range plan {
		for _, s := range scenarios {
			if fn := s.Before[spec.Name]; fn != nil {
				fn(t, r)
			}
		}
		if res := boot(spec); res.Err != nil {
			break
		}
		for _, s := range scenarios {
			if fn := s.After[spec.Name]; fn != nil {
				fn(t, r)
			}
		}
	}
	for _, s := range scenarios {
		if s.Check != nil {
			t.Run(s.ID, func(t *testing.T) { s.Check(t, r) })
		}
	}
}

// Ran returns the result of the boot that ran step (the first such boot),
// or nil when none did; steps are found by name, so a check never repeats
// the plan's placement.
func (r *Run) Ran(step string) *Result {
	for _, name := range r.Order {
		res := r.Results[name]
		for _, s := range res.Spec.Steps {
			if s.Name == step {
				return res
			}
		}
	}
	return nil
}
