// Package udev is what sparsevol asks of udevd, without udevadm: whether
// it runs, its record of a block device (its database), a new look at a
// device (a "change" uevent), and a rule in its runtime rules directory.
// It knows nothing of volumes.
package udev

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/sparsevol/sparsevol/internal/fsutil"
)

// Dir is udevd's runtime directory as this process sees it: Host on the
// node, wherever a container mounts the node's. "" is no udev.
type Dir string

// Host is udevd's runtime directory on the node.
const Host Dir = "/run/udev"

// sysBlock is where the kernel lists block devices by name; a variable
// for tests.
var sysBlock = "/sys/class/block"

// Running reports whether udevd runs: its control socket exists.
func (d Dir) Running() bool {
	if d == "" {
		return false
	}
	_, err := os.Stat(filepath.Join(string(d), "control"))
	return err == nil
}

// Record is udev's record of one device: the properties (E: lines) of
// its database entry, DISKSEQ and the ID_* a probe or a rule set among
// them.
type Record map[string]string

// Record reads udev's record of the block device the kernel names name
// (loop3, loop3p1); ok is false where udev has none: it has not handled
// the device's first event yet, or the device is gone.
func (d Dir) Record(name string) (rec Record, ok bool, err error) {
	num, err := number(name)
	if err != nil {
		return nil, false, err
	}
	path := filepath.Join(string(d), "data", "b"+num)
	b, err := fsutil.ReadRegular(path, maxRecord)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("udev record of %s: %w", name, err)
	}
	return parseRecord(b), true, nil
}

// maxRecord bounds what Record reads of an entry.
const maxRecord = 1 << 20

// parseRecord reads the E:KEY=value lines of a udev database entry.
func parseRecord(b []byte) Record {
	rec := Record{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if kv, ok := strings.CutPrefix(sc.Text(), "E:"); ok {
			if k, v, ok := strings.Cut(kv, "="); ok {
				rec[k] = v
			}
		}
	}
	return rec
}

// Change asks the kernel to announce the block device name to udev again
// with action "change", what `udevadm trigger --action=change` does: udev
// runs its rules for the device anew and replaces its record and links.
func Change(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(sysBlock, name, "uevent"), []byte("change"), 0); err != nil {
		return fmt.Errorf("change event for %s: %w", name, err)
	}
	return nil
}

// number is the "major:minor" of the block device name, from sysfs.
func number(name string) (string, error) {
	if err := checkName(name); err != nil {
		return "", err
	}
	b, err := os.ReadFile(filepath.Join(sysBlock, name, "dev"))
	if err != nil {
		return "", fmt.Errorf("device number of %s: %w", name, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// checkName refuses what is not one name in sysfs' block directory.
func checkName(name string) error {
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return fmt.Errorf("udev: %q is not a block device name", name)
	}
	return nil
}

// InstallRule makes rule the content of name in d's runtime rules
// directory (rules.d), which udevd reads at its next event once it sees
// the directory changed (it looks every few seconds): for a node where no
// package installed the rule. It writes a new file renamed into place,
// never through a name already there. A rule of the same name in
// /etc/udev/rules.d, the administrator's, still wins over it.
func (d Dir) InstallRule(name string, rule []byte) error {
	if d == "" || name == "" || strings.ContainsAny(name, "/\x00") || strings.HasPrefix(name, ".") {
		return fmt.Errorf("install udev rule %q in %q: not a rule name or no udev", name, d)
	}
	dir := filepath.Join(string(d), "rules.d")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("install udev rule %s: %w", name, err)
	}
	if err := fsutil.ReplaceFile(filepath.Join(dir, name), rule, 0o644, fsutil.FlushNone); err != nil {
		return fmt.Errorf("install udev rule %s: %w", name, err)
	}
	return nil
}
