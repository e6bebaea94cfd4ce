package iolimit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestParseIOPS(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"1", 1, true},
		{"500", 500, true},
		{"4294967294", MaxIOPS, true},
		{"max", 0, true},
		{"0", 0, false},
		{"4294967295", 0, false},
		{"99999999999999999999999", 0, false},
		{"-1", 0, false},
		{"+5", 0, false},
		{"1e3", 0, false},
		{" 5", 0, false},
		{"", 0, false},
		{"MAX", 0, false},
		{"5\n", 0, false},
		{"00000000001", 0, false},
	} {
		got, err := ParseIOPS(tc.in)
		if tc.ok != (err == nil) || got != tc.want {
			t.Errorf("ParseIOPS(%q) = %d, %v; want %d, ok=%t", tc.in, got, err, tc.want, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseIOPS(%q): %v does not wrap ErrInvalid", tc.in, err)
		}
	}
}

// TestParseIOPSLongValue: an overlong value is refused without being
// echoed.
func TestParseIOPSLongValue(t *testing.T) {
	for _, in := range []string{strings.Repeat("9", 1<<20), strings.Repeat("x", 1<<20)} {
		_, err := ParseIOPS(in)
		if !errors.Is(err, ErrInvalid) {
			t.Fatalf("ParseIOPS(%d bytes) = %v, want ErrInvalid", len(in), err)
		}
		if len(err.Error()) > 200 {
			t.Errorf("error of %d bytes echoes the input: %.120s...", len(err.Error()), err)
		}
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		l  Limits
		ok bool
	}{
		{Limits{}, true},
		{Limits{ReadBPS: 1, WriteBPS: MaxBPS, ReadIOPS: 1, WriteIOPS: MaxIOPS}, true},
		{Limits{ReadBPS: MaxBPS + 1}, false},
		{Limits{WriteBPS: ^uint64(0)}, false},
		{Limits{ReadIOPS: MaxIOPS + 1}, false},
		{Limits{WriteIOPS: 1 << 40}, false},
	} {
		err := tc.l.Validate()
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalid)) {
			t.Errorf("%+v.Validate() = %v, want ok=%t", tc.l, err, tc.ok)
		}
	}
}

// TestLine checks the io.max line, for minors past 255 too (dev_t is not
// major*256+minor), and that the reader reads back what the writer wrote.
func TestLine(t *testing.T) {
	for _, tc := range []struct {
		dev  uint64
		l    Limits
		want string
	}{
		{unix.Mkdev(7, 3), Limits{WriteBPS: 10 << 20}, "7:3 rbps=max wbps=10485760 riops=max wiops=max"},
		{unix.Mkdev(7, 300), Limits{ReadIOPS: 100, WriteIOPS: 50}, "7:300 rbps=max wbps=max riops=100 wiops=50"},
		{unix.Mkdev(259, 1048575), Limits{ReadBPS: 1}, "259:1048575 rbps=1 wbps=max riops=max wiops=max"},
		{unix.Mkdev(7, 0), Limits{}, "7:0 rbps=max wbps=max riops=max wiops=max"},
	} {
		got := tc.l.line(unix.Major(tc.dev), unix.Minor(tc.dev))
		if got != tc.want {
			t.Errorf("line = %q, want %q", got, tc.want)
		}
		maj, min, back, err := parseLine(got)
		if err != nil || maj != unix.Major(tc.dev) || min != unix.Minor(tc.dev) || back != tc.l {
			t.Errorf("parseLine(%q) = %d:%d %+v, %v", got, maj, min, back, err)
		}
	}
}

// TestConfigValidate: a configuration is refused with ErrInvalid where a
// path has the wrong shape or a byte a cgroup path does not need, and the
// error never shows the value.
func TestConfigValidate(t *testing.T) {
	const hostile = "x\n\x1b[31m"
	for _, tc := range []struct {
		c  Config
		ok bool
	}{
		{Config{}, true},
		{Config{Mount: "/host/sys/fs/cgroup", Cgroup: "kubepods.slice"}, true},
		{Config{Cgroup: "kubepods/burstable"}, true},
		{Config{Cgroup: "user.slice/user-0.slice/user@0.service"}, true},
		{Config{Mount: "sys/fs/cgroup"}, false},
		{Config{Mount: "/sys/fs/cgroup/"}, false},
		{Config{Mount: "/sys/fs/" + hostile}, false},
		{Config{Mount: "/sys/fs/c group"}, false},
		{Config{Mount: strings.Repeat("a", 5000)}, false},
		{Config{Cgroup: "/kubepods"}, false},
		{Config{Cgroup: "."}, false},
		{Config{Cgroup: "../x"}, false},
		{Config{Cgroup: "a/../../x"}, false},
		{Config{Cgroup: "kubepods/"}, false},
		{Config{Cgroup: "a\nb"}, false},
		{Config{Cgroup: "kubepods" + hostile}, false},
		{Config{Cgroup: "kube\u202epods"}, false},
		{Config{Cgroup: "../" + strings.Repeat("a", 5000)}, false},
	} {
		err := tc.c.Validate()
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalid)) {
			t.Errorf("%.100q.Validate() = %v, want ok=%t", fmt.Sprintf("%+v", tc.c), err, tc.ok)
		}
		if err != nil && (strings.ContainsAny(err.Error(), "\n\x1b\u202e") || len(err.Error()) > 512) {
			t.Errorf("%.100q.Validate() shows the value: %.300q", fmt.Sprintf("%+v", tc.c), err)
		}
	}
}

// TestFind checks which cgroup is chosen on hierarchies of both kubelet
// cgroup drivers, before and after kubelet made its cgroup.
func TestFind(t *testing.T) {
	for _, tc := range []struct {
		name   string
		dirs   []string
		cgroup string
		want   string
		exists bool
	}{
		{"systemd driver", []string{"init.scope", "kubepods.slice", "system.slice"}, "", "kubepods.slice", true},
		{"cgroupfs driver", []string{"init.scope", "kubepods"}, "", "kubepods", true},
		{"systemd before kubelet", []string{"init.scope", "system.slice"}, "", "kubepods.slice", false},
		{"no systemd before kubelet, or a container's namespace", nil, "", "", false},
		{"configured", []string{"kubepods.slice", "pods"}, "pods", "pods", true},
		{"configured, missing", []string{"kubepods.slice"}, "pods/all", "pods/all", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := t.TempDir()
			for _, d := range tc.dirs {
				if err := os.MkdirAll(filepath.Join(m, d), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			want := ""
			if tc.want != "" {
				want = filepath.Join(m, tc.want)
			}
			got, ok := Config{Mount: m, Cgroup: tc.cgroup}.find()
			if got != want || ok != tc.exists {
				t.Errorf("find = %q, %t; want %q, %t", got, ok, want, tc.exists)
			}
		})
	}
}

// TestEnableIO checks that the io controller is enabled from the root
// down to the cgroup's parent where it is missing, and nowhere else.
func TestEnableIO(t *testing.T) {
	m := t.TempDir()
	files := map[string]string{
		"cgroup.subtree_control":            "cpu memory",
		"a/cgroup.subtree_control":          "cpu io",
		"a/b/cgroup.subtree_control":        "",
		"a/b/pods/cgroup.subtree_control":   "",
		"other/cgroup.subtree_control":      "",
		"a/b/pods/x/cgroup.subtree_control": "",
	}
	for p, s := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(m, p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(m, p), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	enabled, err := enableIO(m, filepath.Join(m, "a/b/pods"))
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{filepath.Join(m, "cgroup.subtree_control"), filepath.Join(m, "a/b/cgroup.subtree_control")}; !slices.Equal(enabled, want) {
		t.Errorf("enableIO enabled io in %q, want %q", enabled, want)
	}
	for p, want := range map[string]string{
		"cgroup.subtree_control":            "+io", // written at offset 0
		"a/cgroup.subtree_control":          "cpu io",
		"a/b/cgroup.subtree_control":        "+io",
		"a/b/pods/cgroup.subtree_control":   "",
		"other/cgroup.subtree_control":      "",
		"a/b/pods/x/cgroup.subtree_control": "",
	} {
		got, err := os.ReadFile(filepath.Join(m, p))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(string(got), want) || (want == "" && len(got) > 0) {
			t.Errorf("%s = %q, want %q written", p, got, want)
		}
	}
}

// TestParseLine reads io.max lines as the kernel may write them: a key
// it does not know is ignored whatever its value; a known key with a
// value that is not a number, or a line without a device number, is
// refused.
func TestParseLine(t *testing.T) {
	for _, tc := range []struct {
		in   string
		dev  uint64
		want Limits
		ok   bool
	}{
		{"7:3 rbps=max wbps=max riops=max wiops=max", unix.Mkdev(7, 3), Limits{}, true},
		{"259:1048575 rbps=1 wiops=2", unix.Mkdev(259, 1048575), Limits{ReadBPS: 1, WriteIOPS: 2}, true},
		{"7:3 rbps=5 latency=off", unix.Mkdev(7, 3), Limits{ReadBPS: 5}, true},
		{"7:3 future=1.5 wbps=6", unix.Mkdev(7, 3), Limits{WriteBPS: 6}, true},
		{"7:3 rbps=abc", 0, Limits{}, false},
		{"7:3 wiops=-1", 0, Limits{}, false},
		{"7 rbps=1", 0, Limits{}, false},
		{"", 0, Limits{}, false},
	} {
		maj, min, got, err := parseLine(tc.in)
		if tc.ok != (err == nil) || (tc.ok && (unix.Mkdev(maj, min) != tc.dev || got != tc.want)) {
			t.Errorf("parseLine(%q) = %d:%d %+v, %v; want %d:%d %+v, ok=%t",
				tc.in, maj, min, got, err, unix.Major(tc.dev), unix.Minor(tc.dev), tc.want, tc.ok)
		}
	}
}
