package udevrules_test

import (
	"bytes"
	"os"
	"strings"
	"testing"

	udevrules "github.com/sparsevol/sparsevol/deploy/udev"
	"github.com/sparsevol/sparsevol/internal/systemd"
)

const ruleFile = udevrules.RuleName

// The rule reads the files attach writes, keyed by the binding's disk
// sequence number, and runs before 60-persistent-storage.rules, which
// probes unless the flag says otherwise.
func TestIdentityRule(t *testing.T) {
	b, err := os.ReadFile(ruleFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, udevrules.Rule) {
		t.Errorf("the embedded rule differs from %s", ruleFile)
	}
	rule := string(udevrules.Rule)
	for _, want := range []string{
		`IMPORT{file}="` + systemd.Manager{}.UdevIdentityDir() + `/$attr{diskseq}"`,
		`ATTRS{diskseq}=="[1-9]*", IMPORT{file}="` + systemd.Manager{}.UdevIdentityDir() + `/$attr{diskseq}p$attr{partition}"`,
		"\n" + `ENV{SPARSEVOL_DISKSEQ}="$attr{diskseq}"` + "\n",
		"\n" + `ATTRS{diskseq}=="[1-9]*", ENV{SPARSEVOL_DISKSEQ}="$attr{diskseq}"` + "\n",
		`ENV{DEVTYPE}=="partition", GOTO="sparsevol_partition"`,
		`ENV{UDEV_DISABLE_PERSISTENT_STORAGE_BLKID_FLAG}="1"`,
		`KERNEL!="loop[0-9]*", GOTO="sparsevol_end"`,
		`TEST!="loop/backing_file", GOTO="sparsevol_end"`,
	} {
		if !strings.Contains(rule, want) {
			t.Errorf("%s lacks %s", ruleFile, want)
		}
	}
	if ruleFile >= "60-persistent-storage.rules" {
		t.Errorf("%s sorts after 60-persistent-storage.rules: udev would probe first", ruleFile)
	}
	// The import and the flag are one rule: no file, no flag.
	for _, line := range strings.Split(rule, "\n") {
		if strings.Contains(line, "BLKID_FLAG") && !strings.Contains(line, "IMPORT{file}=") {
			t.Errorf("the probe is turned off by a rule that does not import the identity: %s", line)
		}
	}
}
