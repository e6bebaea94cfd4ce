package vmrun

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestParseFacts(t *testing.T) {
	for _, tc := range []struct {
		name     string
		in       string
		facts    map[string]string
		failures []string
	}{
		{"empty", "", map[string]string{}, nil},
		{"last value wins", "a=1\nb=x=y\na=2\n", map[string]string{"a": "2", "b": "x=y"}, nil},
		{"empty value kept", "a=\n", map[string]string{"a": ""}, nil},
		{"lines without = ignored", "junk\na=1\n", map[string]string{"a": "1"}, nil},
		{"failures in order, not facts", "fail=pod not ready\na=1\nfail=store changed: [a] -> [b]\n",
			map[string]string{"a": "1"}, []string{"pod not ready", "store changed: [a] -> [b]"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			facts, failures := ParseFacts(strings.NewReader(tc.in))
			if !reflect.DeepEqual(facts, tc.facts) {
				t.Errorf("facts = %v, want %v", facts, tc.facts)
			}
			if !reflect.DeepEqual(failures, tc.failures) {
				t.Errorf("failures = %q, want %q", failures, tc.failures)
			}
		})
	}
}

func TestParseShow(t *testing.T) {
	text := "Id=a.service\nActiveState=active\nAfter=x.mount y.service\n\n" +
		"ActiveState=inactive\n\n" + // no Id: dropped
		"Id=b.service\nActiveState=failed\n"
	want := map[string]map[string]string{
		"a.service": {"Id": "a.service", "ActiveState": "active", "After": "x.mount y.service"},
		"b.service": {"Id": "b.service", "ActiveState": "failed"},
	}
	if got := ParseShow(text); !reflect.DeepEqual(got, want) {
		t.Errorf("ParseShow = %v, want %v", got, want)
	}
}

func TestParseJournal(t *testing.T) {
	in := `{"UNIT":"sparsevol@u.service","SYSLOG_IDENTIFIER":"systemd","MESSAGE":"Starting","__MONOTONIC_TIMESTAMP":"1500000"}
{"_SYSTEMD_UNIT":"sparsevol@u.service","SYSLOG_IDENTIFIER":"sparsevol","MESSAGE":[104,105],"__MONOTONIC_TIMESTAMP":"2000001"}
not json
{"MESSAGE":"kernel line without a unit"}
{"_SYSTEMD_UNIT":"other.service","SYSLOG_IDENTIFIER":"x","MESSAGE":"m"}
`
	got := ParseJournal(strings.NewReader(in))
	want := map[string][]string{
		"sparsevol@u.service": {"[  1.500000] systemd: Starting", "[  2.000001] sparsevol: hi"},
		"other.service":       {"[  0.000000] x: m"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ParseJournal = %q, want %q", got, want)
	}
}

func TestMonotonic(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"1500000", 1500 * time.Millisecond, true},
		{" 42\n", 42 * time.Microsecond, true},
		{"0", 0, false},
		{"", 0, false},
		{"n/a", 0, false},
	} {
		got, ok := Monotonic(tc.in)
		if got != tc.want || ok != tc.ok {
			t.Errorf("Monotonic(%q) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

func TestParseCPU(t *testing.T) {
	text := "cpu  1095 0 1632 756 8 0 14 0 0 0\n" +
		"CPUUsageNSec=18024462000\nId=init.scope\n\n" +
		"CPUUsageNSec=8721897000\nId=systemd-udevd.service\n\n" +
		"CPUUsageNSec=[not set]\nId=systemd-journald.service\n\n" +
		"CPUUsageNSec=18446744073709551615\nId=sparsevol-boot.service\n"
	want := map[string]time.Duration{
		"busy":                  (1095 + 1632 + 14) * 10 * time.Millisecond,
		"idle":                  (756 + 8) * 10 * time.Millisecond,
		"init.scope":            18024462000,
		"systemd-udevd.service": 8721897000,
	}
	if got := ParseCPU(text); !reflect.DeepEqual(got, want) {
		t.Errorf("ParseCPU = %v, want %v", got, want)
	}
}

func TestKeysFollowInputs(t *testing.T) {
	k := BaseKey()
	if len(k) != 16 || k != BaseKey() {
		t.Fatalf("BaseKey = %q, not stable", k)
	}
	saved := base.Packages
	base.Packages = append(append([]string{}, saved...), "extra")
	changed := BaseKey()
	base.Packages = saved
	if changed == k {
		t.Errorf("BaseKey ignores the package list")
	}
	l := Layer{Name: "node", Recipe: "v1", Packages: []string{"x"}}
	a := layerKey(k, l)
	for _, other := range []string{
		layerKey("0123456789abcdef", l),
		layerKey(k, Layer{Name: "node", Recipe: "v2", Packages: []string{"x"}}),
		layerKey(k, Layer{Name: "node", Recipe: "v1", Packages: []string{"x", "y"}}),
	} {
		if other == a {
			t.Errorf("layer key ignores its parent, recipe or packages")
		}
	}
}
