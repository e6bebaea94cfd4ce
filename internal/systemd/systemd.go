// Package systemd installs the sparsevol@.service template and manages its
// per-volume instances through systemctl. It never talks D-Bus: systemctl
// is the stable interface, run with an argument vector and no shell.
package systemd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	systemdunit "github.com/sparsevol/sparsevol/deploy/systemd"
	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// DefaultUnitDir is where the template and drop-ins are written.
const DefaultUnitDir = "/etc/systemd/system"

// VendorUnitDirs are where packages install units (the .deb and .rpm put
// the template and boot units in the first). systemd loads a unit from
// DefaultUnitDir before these, so `sparsevol units install` overrides a
// package's units.
var VendorUnitDirs = []string{"/usr/lib/systemd/system", "/lib/systemd/system"}

// TemplateName is the template unit's file name.
const TemplateName = "sparsevol@.service"

// defaultBinary and defaultRoot are the binary and store the shipped
// units name.
const (
	defaultBinary = "/usr/local/bin/sparsevol"
	defaultRoot   = volume.DefaultRoot
)

// Running reports whether systemd is the init system of this machine
// (the test sd_booted() makes).
func Running() bool {
	fi, err := os.Stat("/run/systemd/system")
	return err == nil && fi.IsDir()
}

// UnitName is the instance of the template for one volume.
func UnitName(uuid string) string { return "sparsevol@" + uuid + ".service" }

// Manager writes units under Dir and drives systemctl. It is the volume
// store's Lifecycle where systemd runs.
type Manager struct {
	Dir    string // unit directory; DefaultUnitDir if empty
	RunDir string // boot-mode markers; DefaultRunDir if empty
	// VendorDirs are searched for the template after Dir (Installed);
	// if nil, VendorUnitDirs when Dir is DefaultUnitDir, else none.
	VendorDirs []string
	// Offline never reloads systemd: Dir belongs to a root being staged
	// (a package, an image), not to this machine.
	Offline bool
	// Fstab is the file EnabledVolumes reads the node's mount points
	// from; DefaultFstab if empty.
	Fstab string
	// UnitPath is where EnabledVolumes looks for the node's mount units;
	// if nil, SystemUnitPath when Dir is DefaultUnitDir, else Dir only.
	UnitPath []string
}

var _ volume.Lifecycle = Manager{}

// dir is the unit directory, cleaned: every path the Manager derives
// from Dir (the generator directory beside it, the default's vendor
// directories) goes through it, so "/etc/systemd/system/" is
// DefaultUnitDir.
func (m Manager) dir() string {
	if m.Dir == "" {
		return DefaultUnitDir
	}
	return filepath.Clean(m.Dir)
}

// shipped are the unit files Install writes, by name.
var shipped = []struct{ name, text string }{
	{TemplateName, systemdunit.Template},
	{BootUnit, systemdunit.Boot},
	{BootDoneUnit, systemdunit.BootDone},
}

// render returns a shipped unit for binary and store root (each the
// shipped default if empty). It sets fields, one setting at a time: the
// executable of ExecStart= and ExecStop= where it is defaultBinary, each
// path of RequiresMountsFor= that is defaultRoot, and the value of
// Environment=SPARSEVOL_ROOT=. Comments and every other line are kept
// byte for byte, and what one field receives is never searched again, so
// a root that is a prefix of the binary (or the other way round) cannot
// rewrite it. binary and root go into the unit as they are: the caller
// has checked them (volume.CheckUnitPath).
func render(unit, binary, root string) string {
	if binary == "" {
		binary = defaultBinary
	}
	if root == "" {
		root = defaultRoot
	}
	lines := strings.SplitAfter(unit, "\n")
	for i, line := range lines {
		lines[i] = renderLine(line, binary, root)
	}
	return strings.Join(lines, "")
}

// renderLine is render for one line (with its newline, if any).
func renderLine(line, binary, root string) string {
	body, nl := strings.CutSuffix(line, "\n")
	key, value, ok := strings.Cut(body, "=")
	if !ok || strings.HasPrefix(body, "#") || strings.HasPrefix(body, ";") {
		return line
	}
	switch key {
	case "ExecStart", "ExecStop":
		if prefix, exe, args := execLine(value); exe == defaultBinary {
			value = prefix + binary + args
		}
	case "RequiresMountsFor":
		paths := strings.Split(value, " ")
		for i, p := range paths {
			if p == defaultRoot {
				paths[i] = root
			}
		}
		value = strings.Join(paths, " ")
	case "Environment":
		if value == volume.RootEnv+"="+defaultRoot {
			value = volume.RootEnv + "=" + root
		}
	}
	if nl {
		value += "\n"
	}
	return key + "=" + value
}

// execLine splits the value of an ExecStart= or ExecStop= setting into
// its prefixes ("-", "@", "+", "!", ":", which come before the path), its
// executable, and its arguments (with their leading space).
func execLine(value string) (prefix, exe, args string) {
	exe = strings.TrimLeft(value, "-@+!:")
	prefix = value[:len(value)-len(exe)]
	if i := strings.IndexByte(exe, ' '); i >= 0 {
		exe, args = exe[:i], exe[i:]
	}
	return prefix, exe, args
}

// generatorDir is the administrator's generator directory next to the
// unit directory (/etc/systemd/system-generators).
func (m Manager) generatorDir() string {
	return filepath.Join(filepath.Dir(m.dir()), "system-generators")
}

// Install writes the template and the boot units (atomically), links the
// generator to binary, and reloads systemd if it runs. It returns the
// paths it wrote. A binary or store root that fails volume.CheckUnitPath
// is refused (ErrInvalid) before anything is written.
func (m Manager) Install(ctx context.Context, binary, root string) ([]string, error) {
	if err := volume.CheckUnitPath(binary); err != nil {
		return nil, fmt.Errorf("install units: binary: %w", err)
	}
	if err := volume.CheckUnitPath(root); err != nil {
		return nil, fmt.Errorf("install units: store: %w", err)
	}
	if err := os.MkdirAll(m.dir(), 0o755); err != nil {
		return nil, fmt.Errorf("install units: %w", err)
	}
	if err := m.checkOurs(); err != nil {
		return nil, fmt.Errorf("install units: %w", err)
	}
	var paths []string
	for _, u := range shipped {
		path := filepath.Join(m.dir(), u.name)
		if err := fsutil.WriteFileAtomic(path, []byte(render(u.text, binary, root)), 0o644); err != nil {
			return paths, fmt.Errorf("install %s: %w", path, err)
		}
		paths = append(paths, path)
	}
	gen := filepath.Join(m.generatorDir(), GeneratorName)
	if err := fsutil.ReplaceSymlink(binary, gen); err != nil {
		return paths, fmt.Errorf("install %s: %w", gen, err)
	}
	return append(paths, gen), m.reload(ctx)
}

// Uninstall removes what Install wrote. Instances still enabled are the
// caller's to disable first. What is not Install's at those paths (see
// checkOurs) is left as it is and named in the error (ErrExists), once
// the rest is removed: a mask is the operator's.
func (m Manager) Uninstall(ctx context.Context) ([]string, error) {
	var removed []string
	var errs []error
	for _, path := range m.installPaths() {
		err := installedByUs(path)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err == nil {
			err = os.Remove(path)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("uninstall: %w", err)) // err names path
			continue
		}
		removed = append(removed, path)
	}
	if err := m.reload(ctx); err != nil {
		errs = append(errs, err)
	}
	return removed, errors.Join(errs...)
}

// installPaths are the paths Install writes: the shipped units, then the
// generator's link.
func (m Manager) installPaths() []string {
	var paths []string
	for _, u := range shipped {
		paths = append(paths, filepath.Join(m.dir(), u.name))
	}
	return append(paths, filepath.Join(m.generatorDir(), GeneratorName))
}

// checkOurs refuses (ErrExists) to let Install replace anything at its
// paths that it did not write there (installedByUs): a mask or a unit of
// the operator's own is theirs to remove.
func (m Manager) checkOurs() error {
	var errs []error
	for _, path := range m.installPaths() {
		if err := installedByUs(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// masked reports whether the unit file at path is the administrator's
// mask: `systemctl mask`'s link to /dev/null.
func masked(path string) bool {
	target, err := os.Readlink(path)
	return err == nil && target == "/dev/null"
}

// maxUnit bounds a unit file or drop-in sparsevol reads: the ones it
// writes hold a few settings.
const maxUnit = 64 << 10

// installedByUs returns nil if path holds what Install writes there: for
// a shipped unit a regular file (read without following a link,
// fsutil.ReadRegular) that begins with the shipped unit's first line, for
// the generator a symbolic link. Nothing there is os.ErrNotExist; anything
// else (a mask, a link, a unit or file of someone else's) is ErrExists,
// saying what to do.
func installedByUs(path string) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if filepath.Base(path) == GeneratorName {
		if fi.Mode()&fs.ModeSymlink != 0 {
			return nil
		}
		return fmt.Errorf("%s is not the link sparsevol installs; move it aside first: %w", path, volume.ErrExists)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		if masked(path) {
			return fmt.Errorf("%s is masked; `systemctl unmask %s` first if you mean it: %w", path, filepath.Base(path), volume.ErrExists)
		}
		return fmt.Errorf("%s is a link, not a unit sparsevol installs; remove it yourself first if you mean it: %w", path, volume.ErrExists)
	}
	data, err := fsutil.ReadRegular(path, maxUnit)
	if err != nil {
		return fmt.Errorf("%w; it is not a unit sparsevol installs: %w", err, volume.ErrExists)
	}
	for _, u := range shipped {
		if u.name == filepath.Base(path) {
			first, _, _ := strings.Cut(u.text, "\n")
			if strings.HasPrefix(string(data), first+"\n") {
				return nil
			}
		}
	}
	return fmt.Errorf("%s is not a unit sparsevol installs (its first line is not sparsevol's); move it aside first if you mean it: %w", path, volume.ErrExists)
}

// Installed reports whether the template is present: in Dir, or where a
// package installs it (VendorDirs).
func (m Manager) Installed() bool {
	vendor := m.VendorDirs
	if vendor == nil && m.dir() == DefaultUnitDir {
		vendor = VendorUnitDirs
	}
	for _, d := range append([]string{m.dir()}, vendor...) {
		if _, err := os.Stat(filepath.Join(d, TemplateName)); err == nil {
			return true
		}
	}
	return false
}

// CheckOverride checks the template in Dir, which systemd loads before a
// package's (VendorUnitDirs), against the packaged one, which runs
// binary. It returns nil if Dir has none, or if every ExecStart= and
// ExecStop= of Dir's runs binary; else an error that says what is there
// and what to do to use the packaged units: a mask is the administrator's
// and only named; what Uninstall removes (installedByUs) is left to it; a
// link is to be removed, anything else moved aside. Only a regular file
// of at most maxUnit bytes is read, a link followed to it as systemd
// follows `systemctl link`'s (fsutil.ReadRegularFollowing): a FIFO, a
// device or a directory there, or a link to one, is reported unread. The
// packages' postinst runs it (`sparsevol units check-override`).
func (m Manager) CheckOverride(binary string) error {
	path := filepath.Join(m.dir(), TemplateName)
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if masked(path) {
		return fmt.Errorf("%s is masked: no volume is attached at boot until `systemctl unmask %s`", path, TemplateName)
	}
	var what string
	data, err := fsutil.ReadRegularFollowing(path, maxUnit)
	if err != nil {
		what = fmt.Sprintf("cannot be read as a unit (%v)", err)
	} else {
		exes, others := unitExecutables(data), []string(nil)
		for _, exe := range exes {
			if exe != binary && !slices.Contains(others, volume.Quote(exe)) {
				others = append(others, volume.Quote(exe))
			}
		}
		switch {
		case len(others) > 0:
			what = fmt.Sprintf("runs %s, not %s", strings.Join(others, " and "), binary)
		case len(exes) == 0:
			what = "runs nothing (no ExecStart=)"
		default:
			return nil
		}
	}
	const keep = "to use the packaged units (enabled volumes stay enabled)"
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		return fmt.Errorf("%s overrides the packaged units and %s; it is a link: remove it (rm %s) %s", path, what, path, keep)
	case installedByUs(path) == nil:
		return fmt.Errorf("%s overrides the packaged units and %s; remove it with `sparsevol units uninstall` %s", path, what, keep)
	}
	return fmt.Errorf("%s overrides the packaged units and %s; it is not a unit sparsevol installs: move it out of %s %s", path, what, m.dir(), keep)
}

// unitExecutables lists the executables of the ExecStart= and ExecStop=
// settings of a unit's text (execLine), an empty setting left out.
func unitExecutables(unit []byte) []string {
	var exes []string
	for _, line := range strings.Split(string(unit), "\n") {
		key, value, ok := strings.Cut(strings.TrimSpace(line), "=")
		if !ok || (key != "ExecStart" && key != "ExecStop") || strings.TrimSpace(value) == "" {
			continue
		}
		_, exe, _ := execLine(strings.TrimSpace(value))
		exes = append(exes, exe)
	}
	return exes
}

// DropInPath is the per-volume drop-in that points an instance at a store
// (and backing file) other than the template's.
func (m Manager) DropInPath(uuid string) string {
	return filepath.Join(m.dir(), UnitName(uuid)+".d", "10-store.conf")
}

// Enable writes the instance's drop-in, enables it, and starts it if start.
// mountsFor lists the paths the instance needs mounted (store, backing
// file directory). A uuid that is not a volume UUID, or a root or
// mountsFor path that fails volume.CheckUnitPath, is refused (ErrInvalid)
// before anything is written.
func (m Manager) Enable(ctx context.Context, uuid, root string, mountsFor []string, start bool) error {
	if !volume.ValidUUID(uuid) {
		return fmt.Errorf("enable unit: %+q is not a volume UUID: %w", uuid, volume.ErrInvalid)
	}
	for _, p := range append([]string{root}, mountsFor...) {
		if err := volume.CheckUnitPath(p); err != nil {
			return fmt.Errorf("enable %s: %w", UnitName(uuid), err)
		}
	}
	dropIn := fmt.Sprintf("# Written by sparsevol for volume %s.\n[Unit]\nRequiresMountsFor=%s\n\n[Service]\nEnvironment=SPARSEVOL_ROOT=%s\n",
		uuid, strings.Join(mountsFor, " "), root)
	if err := os.MkdirAll(filepath.Dir(m.DropInPath(uuid)), 0o755); err != nil {
		return fmt.Errorf("enable %s: %w", UnitName(uuid), err)
	}
	if err := fsutil.WriteFileAtomic(m.DropInPath(uuid), []byte(dropIn), 0o644); err != nil {
		return fmt.Errorf("enable %s: %w", UnitName(uuid), err)
	}
	// systemctl enable reloads systemd itself, which also loads the
	// drop-in: one reload per volume, not two (each costs seconds on a
	// busy node).
	args := []string{"enable"}
	if start {
		args = append(args, "--now")
	}
	if err := systemctl(ctx, append(args, UnitName(uuid))...); err != nil {
		return fmt.Errorf("enable %s: %w", UnitName(uuid), err)
	}
	return nil
}

// Start starts an enabled instance (its ExecStart attaches the volume).
// While the instance still carries its boot-mode drop-in (the boot is done
// but systemd not reloaded yet), it reloads first, so the start attaches.
func (m Manager) Start(ctx context.Context, uuid string) error {
	if m.BootDone() && m.inBootMode(uuid) {
		if err := m.reload(ctx); err != nil {
			return fmt.Errorf("start %s: %w", UnitName(uuid), err)
		}
	}
	if err := systemctl(ctx, "start", UnitName(uuid)); err != nil {
		return fmt.Errorf("start %s: %w", UnitName(uuid), err)
	}
	return nil
}

// Disable stops and disables the instance and removes its drop-in. An
// instance that is not enabled is not an error.
func (m Manager) Disable(ctx context.Context, uuid string) error {
	// Without the template (uninstalled) the instance cannot be loaded and
	// systemctl refuses; there is then nothing to stop, only links to drop.
	if m.Installed() || m.Enabled(uuid) {
		if err := systemctl(ctx, "disable", "--now", UnitName(uuid)); err != nil && m.Installed() {
			return fmt.Errorf("disable %s: %w", UnitName(uuid), err)
		}
	}
	os.Remove(filepath.Join(m.dir(), "multi-user.target.wants", UnitName(uuid)))
	// A unit that failed once (say, udev was late at boot) stays loaded as
	// failed after its volume is gone unless told to forget it.
	if Running() {
		_ = systemctl(ctx, "reset-failed", UnitName(uuid))
	}
	os.RemoveAll(filepath.Dir(m.DropInPath(uuid)))
	return m.reload(ctx)
}

// Enabled reports whether the instance is enabled, by looking at the
// symlink systemctl enable makes (works without systemd running).
func (m Manager) Enabled(uuid string) bool {
	_, err := os.Lstat(filepath.Join(m.dir(), "multi-user.target.wants", UnitName(uuid)))
	return err == nil
}

// Reload makes systemd reread its units (and rerun its generators).
func (m Manager) Reload(ctx context.Context) error { return m.reload(ctx) }

func (m Manager) reload(ctx context.Context) error {
	if m.Offline || !Running() {
		return nil
	}
	if err := systemctl(ctx, "daemon-reload"); err != nil {
		return fmt.Errorf("reload systemd: %w", err)
	}
	return nil
}

func systemctl(ctx context.Context, args ...string) error {
	cmd := exec.CommandContext(ctx, "systemctl", args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("systemctl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return nil
}
