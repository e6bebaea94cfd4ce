package vmrun

import (
	"errors"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// summary renders a plan as "boot: step step -> next" lines.
func summary(plan []BootSpec) string {
	var lines []string
	for _, b := range plan {
		var names []string
		for _, s := range b.Steps {
			names = append(names, s.Name)
		}
		lines = append(lines, b.Name+": "+strings.Join(names, " ")+" -> "+b.Next)
	}
	return strings.Join(lines, "\n")
}

func TestPlan(t *testing.T) {
	tl := Timeline{Boots: []string{"b1", "b2", "b3", "b4"}, Every: []Step{{Name: "collect"}}}
	setup, check := Step{Name: "a-setup"}, Step{Name: "a-check"}
	for _, tc := range []struct {
		name      string
		scenarios []Scenario[int]
		want      string
		wantErr   string
	}{
		{
			name:      "boots without a step are left out; the last powers off",
			scenarios: []Scenario[int]{{ID: "1-a", Steps: []Placed{At("b1", setup), At("b3", check)}}},
			want:      "b1: collect a-setup -> reboot\nb3: collect a-check -> poweroff",
		},
		{
			name: "a scenario building on another lists its steps; they run once",
			scenarios: []Scenario[int]{
				{ID: "1-a", Steps: []Placed{At("b1", setup), At("b2", check)}},
				{ID: "2-b", Steps: []Placed{At("b1", setup), At("b2", check), At("b2", Step{Name: "b-more"})}},
			},
			want: "b1: collect a-setup -> reboot\nb2: collect a-check b-more -> poweroff",
		},
		{
			name: "a hard-reset step runs last in its boot, which ends killed",
			scenarios: []Scenario[int]{
				{ID: "1-a", Steps: []Placed{{Boot: "b2", Step: Step{Name: "kill-me"}, Then: Kill}}},
				{ID: "2-b", Steps: []Placed{At("b2", Step{Name: "later"}), At("b4", check)}},
			},
			want: "b2: collect later kill-me -> kill\nb4: collect a-check -> poweroff",
		},
		{
			name:      "a boot the timeline lacks",
			scenarios: []Scenario[int]{{ID: "1-a", Steps: []Placed{At("b9", setup)}}},
			wantErr:   `placed in boot "b9"`,
		},
		{
			name: "two hard resets in one boot",
			scenarios: []Scenario[int]{{ID: "1-a", Steps: []Placed{
				{Boot: "b1", Step: Step{Name: "x"}, Then: Kill}, {Boot: "b1", Step: Step{Name: "y"}, Then: Kill}}}},
			wantErr: "two steps end it",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plan, err := Plan(tl, tc.scenarios)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Plan: error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := summary(plan); got != tc.want {
				t.Errorf("plan:\n%s\nwant:\n%s", got, tc.want)
			}
		})
	}
}

func TestSelected(t *testing.T) {
	var ss Scenarios[int]
	for _, id := range []string{"10-late", "3b-more", "2-two", "3-three", "1-one"} {
		ss.Add(Scenario[int]{ID: id})
	}
	for _, tc := range []struct{ only, want string }{
		{"", "1-one 2-two 3-three 3b-more 10-late"},
		{"3, 10", "3-three 10-late"},
		{"3b", "3b-more"},
	} {
		t.Setenv(EnvPrefix+"ONLY", tc.only)
		var got []string
		for _, s := range ss.Selected(t) {
			got = append(got, s.ID)
		}
		if strings.Join(got, " ") != tc.want {
			t.Errorf("ONLY=%q: %v, want %s", tc.only, got, tc.want)
		}
	}
}

// A step's Script runs as a function: local and return work, and its
// status is the step's.
func TestWriteScripts(t *testing.T) {
	dir := t.TempDir()
	steps := []Step{
		{Name: "s-one", Script: "\n\tlocal x=41\n\techo $((x + 1))\n\treturn 3\n\techo not reached\n"},
	}
	if err := writeScripts(dir, steps); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("bash", "-c", `. "$1"; step_main`, "bash", filepath.Join(dir, "s-one.sh")).Output()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 3 {
		t.Fatalf("step exited %v, want 3", err)
	}
	if got := strings.TrimSpace(string(out)); got != "42" {
		t.Errorf("step printed %q, want 42", got)
	}
	if err := writeScripts(dir, []Step{{Name: "other", Script: ":"}}); err != nil {
		t.Fatal(err)
	}
	if m, _ := filepath.Glob(filepath.Join(dir, "*")); !reflect.DeepEqual(m, []string{filepath.Join(dir, "other.sh")}) {
		t.Errorf("files after the next boot's %v, want only other.sh", m)
	}
	for _, bad := range []Step{{Name: "a/b", Script: ":"}, {Name: "", Script: ":"}, {Name: "empty", Script: " \n"}} {
		if err := writeScripts(dir, []Step{bad}); err == nil {
			t.Errorf("step %+v was accepted", bad)
		}
	}
}
