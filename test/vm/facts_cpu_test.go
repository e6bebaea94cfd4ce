//go:build e2e

package vm

import (
	"testing"
	"time"
)

func TestParseCPU(t *testing.T) {
	text := "cpu  1095 0 1632 756 8 0 14 0 0 0\n" +
		"CPUUsageNSec=18024462000\nId=init.scope\n\n" +
		"CPUUsageNSec=8721897000\nId=systemd-udevd.service\n\n" +
		"CPUUsageNSec=18446744073709551615\nId=sparsevol-boot.service\n"
	got := parseCPU(text)
	want := map[string]time.Duration{
		"busy":                  (1095 + 1632 + 14) * 10 * time.Millisecond,
		"idle":                  (756 + 8) * 10 * time.Millisecond,
		"init.scope":            18024462000,
		"systemd-udevd.service": 8721897000,
	}
	if len(got) != len(want) {
		t.Fatalf("parseCPU = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
}
