package cli

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/systemd"
	"github.com/sparsevol/sparsevol/internal/udev"
	"github.com/sparsevol/sparsevol/internal/volume"
)

type finding struct {
	level  string // OK, WARN, FAIL
	check  string
	detail string
	fix    string
}

func newUnitsCommand(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use: "units install|uninstall",
		Example: `  sparsevol units install
  sparsevol units uninstall`,
		Short: "Install or remove the sparsevol@.service template, the boot units and the generator",
	}
	var binary string
	var offline bool
	install := &cobra.Command{
		Use: "install",
		Example: `  sparsevol units install
  # stage a package's root: units for /usr/bin/sparsevol, no reload
  sparsevol --unit-dir pkgroot/usr/lib/systemd/system units install --binary /usr/bin/sparsevol --offline`,
		Short: "Write the units and the generator link for this binary and store, and reload systemd",
		Long: `Write sparsevol@.service, the boot units and the generator link into the
unit directory (--unit-dir; the generator goes to the system-generators
directory beside it), for the binary --binary (default: this one) and the
store --root, then reload systemd where it runs. --offline writes into a
root being staged (a package or an image) and reloads nothing.`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, args []string) error {
			bin := binary
			if bin == "" {
				var err error
				if bin, err = os.Executable(); err != nil {
					return err
				}
			}
			if err := volume.CheckUnitPath(bin); err != nil {
				if binary == "" {
					return fmt.Errorf("units install: this binary's path, the default of --binary: %w", err)
				}
				return fmt.Errorf("units install: --binary: %w", err)
			}
			root, err := filepath.Abs(g.root)
			if err != nil {
				return err
			}
			u := g.units()
			u.Offline = offline
			paths, err := u.Install(cmd.Context(), bin, root)
			for _, p := range paths {
				fmt.Fprintln(g.stdout, p)
			}
			return err
		},
	}
	install.Flags().StringVar(&binary, "binary", "", "absolute path of the binary the units run (default: this binary)")
	install.Flags().BoolVar(&offline, "offline", false, "write files only: do not reload systemd (staging a package or image root)")
	uninstall := &cobra.Command{
		Use:     "uninstall",
		Example: "  sparsevol units uninstall",
		Short:   "Remove the units and the generator (enabled volumes keep their data; disable them first)",
		Args:    exactArgs(0),
		RunE: func(cmd *cobra.Command, args []string) error {
			u := g.units()
			u.Offline = offline
			paths, err := u.Uninstall(cmd.Context())
			for _, p := range paths {
				fmt.Fprintln(g.stdout, p)
			}
			return err
		},
	}
	uninstall.Flags().BoolVar(&offline, "offline", false, "remove files only: do not reload systemd (a staged root)")
	var packaged string
	checkOverride := &cobra.Command{
		Use:    "check-override",
		Short:  "Fail if a template in --unit-dir overrides the packaged one that runs --binary, saying what to do (the packages' postinst)",
		Hidden: true,
		Args:   exactArgs(0),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.units().CheckOverride(packaged)
		},
	}
	checkOverride.Flags().StringVar(&packaged, "binary", "/usr/bin/sparsevol", "the binary the packaged units run")
	cmd.AddCommand(install, uninstall, checkOverride, &cobra.Command{
		Use:    "generate NORMAL_DIR [EARLY_DIR LATE_DIR]",
		Short:  "Act as systemd generator (what " + systemd.GeneratorName + " runs)",
		Hidden: true,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 && len(args) != 3 {
				return usagef("generate takes 1 or 3 directories, got %d", len(args))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.units().Generate(args[0])
		},
	}, &cobra.Command{
		Use:    "boot-done",
		Short:  "End boot mode: mark the boot done and reload systemd (" + systemd.BootDoneUnit + ")",
		Hidden: true,
		Args:   exactArgs(0),
		RunE: func(cmd *cobra.Command, args []string) error {
			u := g.units()
			if err := u.MarkBootDone(); err != nil {
				return err
			}
			return u.Reload(cmd.Context())
		},
	})
	return cmd
}

func newDoctorCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use: "doctor",
		Example: `  sparsevol doctor
  sparsevol --root /srv/sparsevol doctor`,
		Short: "Check the node: loop and partition support, udev, systemd, store, space, orphans",
		Args:  exactArgs(0),
		RunE: func(cmd *cobra.Command, args []string) error {
			findings := g.diagnose()
			failed := 0
			for _, f := range findings {
				fmt.Fprintf(g.stdout, "[%-4s] %s: %s\n", f.level, f.check, f.detail)
				if f.fix != "" {
					fmt.Fprintf(g.stdout, "       -> %s\n", f.fix)
				}
				if f.level == "FAIL" {
					failed++
				}
			}
			if failed > 0 {
				return fmt.Errorf("%d check(s) failed", failed)
			}
			return nil
		},
	}
}

func (g *globals) diagnose() []finding {
	var out []finding
	add := func(level, check, detail, fix string) {
		out = append(out, finding{level, check, detail, fix})
	}

	// Loop support.
	if err := loop.Supported(); err != nil {
		add("FAIL", "loop", err.Error(), "load the loop module: modprobe loop")
	} else {
		devs, _ := loop.Scan()
		all, _ := filepath.Glob("/sys/block/loop*")
		add("OK", "loop", fmt.Sprintf("%d loop devices, %d bound, more are created on demand", len(all), len(devs)), "")
	}

	// Udev and systemd.
	if !udev.Host.Running() {
		add("WARN", "udev", "udevd is not running: /dev/disk/by-uuid and by-partuuid links will not appear",
			"use /dev/sparsevol/<uuid> links, or run on a host with udev")
	} else {
		add("OK", "udev", "udevd is running", "")
	}
	units := g.units()
	switch {
	case !systemd.Running():
		add("WARN", "systemd", "systemd is not PID 1: volumes are not re-attached at boot by units",
			"run `sparsevol attach --all` from the init system at boot")
	case !units.Installed():
		add("FAIL", "systemd", "the template "+systemd.TemplateName+" is not installed", "sparsevol units install")
	default:
		add("OK", "systemd", "systemd runs and "+systemd.TemplateName+" is installed", "")
	}

	// Store.
	// Open refuses a store it cannot trust and makes a lax one private.
	s, err := g.store()
	if err != nil {
		add("FAIL", "store", err.Error(), "")
		return out
	}
	add("OK", "store", s.Root()+" exists and is private", "")
	out = append(out, storeFilesystem(s.Root()))
	out = append(out, partitionSupport(s)...)

	sp, err := s.Space()
	if err == nil {
		detail := fmt.Sprintf("free %s, volumes hold %s, promise %s, ratio %g, can still promise %s",
			volume.FormatBytes(sp.FreeBytes), volume.FormatBytes(sp.AllocatedBytes), volume.FormatBytes(sp.CommittedBytes),
			sp.OvercommitRatio, volume.FormatBytes(sp.CapacityBytes))
		if sp.CommittedBytes-sp.AllocatedBytes > sp.FreeBytes {
			add("WARN", "space", "overcommitted: if every volume fills up, the store's filesystem runs out; "+detail,
				"free space on the store's filesystem, or shrink what the volumes promise")
		} else {
			add("OK", "space", detail, "")
		}
	}

	// Volumes (their files and devices as Status proves them), then
	// devices tagged for volumes this store does not have.
	sts, err := s.Statuses()
	if err != nil {
		add("FAIL", "volumes", err.Error(), "")
	}
	ours := map[string]bool{}
	for _, st := range sts {
		ours[st.UUID] = true
		check := "volume " + st.Name
		switch {
		case st.State == volume.StateBroken, st.State == volume.StateNewer:
			add("FAIL", check, stateNote(st), "")
		case st.Problem != "":
			// Symlinked or hard-linked backing file, a foreign device
			// on it, or an orphan: operations refuse the volume.
			add("FAIL", check, st.Problem, "")
		case st.State == volume.StateExpanding:
			add("WARN", check, stateNote(st), "")
		case st.State != volume.StateReady:
			add("WARN", check, fmt.Sprintf("unfinished (%s)", st.State),
				fmt.Sprintf("rerun the operation, or `sparsevol delete %s`", st.UUID))
		case st.FileMissing:
			add("FAIL", check, "backing file "+st.BackingFile+" is gone", "restore it from backup, or `sparsevol delete "+st.UUID+"`")
		case systemd.Running() && st.Labels[volume.LabelManagedBy] == "" && !units.Enabled(st.UUID):
			add("WARN", check, "no enabled unit: it will not come back after a reboot",
				"systemctl enable --now "+systemd.UnitName(st.UUID))
		}
	}
	out = append(out, g.ioLimitFindings(sts)...)
	// Snapshots: unreadable metadata, unfinished ones, stray files.
	sns, err := s.ListSnapshots(context.Background())
	if err != nil {
		add("FAIL", "snapshots", err.Error(), "")
	}
	for _, sn := range sns {
		check := "snapshot " + sn.Name
		switch {
		case sn.State == volume.StateBroken:
			add("FAIL", check, sn.Problem, "inspect the file, then `sparsevol snapshot delete "+sn.UUID+"`")
		case sn.State == volume.StateNewer:
			add("FAIL", check, sn.Problem, "")
		case sn.State != volume.StateReady:
			add("WARN", check, fmt.Sprintf("unfinished (%s)", sn.State),
				fmt.Sprintf("rerun `sparsevol snapshot create %s %s`, or `sparsevol snapshot delete %s`", sn.SourceName, sn.Name, sn.UUID))
		}
	}
	if len(sns) > 0 {
		var held, own int64
		for _, sn := range sns {
			held, own = held+sn.AllocatedBytes, own+sn.OwnBytes
		}
		add("OK", "snapshots", fmt.Sprintf("%d snapshot(s) hold %s, %s of it their own (not shared with volumes)",
			len(sns), volume.FormatBytes(held), volume.FormatBytes(own)), "")
	}
	stray, err := s.StrayFiles()
	if err != nil {
		add("WARN", "snapshots", err.Error(), "")
	}
	for _, p := range stray {
		shown, plain := shownFile(p)
		fix := "inspect it with `ls -l " + p + "` and remove it once you know what it is"
		if !plain {
			fix = "its name is no name the store gives: find it with `ls -lb " + filepath.Dir(p) + "` and remove it once you know what it is"
		}
		add("WARN", "snapshots", shown+" is no snapshot's file or metadata (left by a killed writer, or put there by hand)", fix)
	}
	out = append(out, recoverCopies(s, ours)...)
	return append(out, taggedDevices(s.Root(), ours)...)
}

// recoverCopies reports the copies killed recovers left in the store,
// with what removes them.
func recoverCopies(s *volume.Store, ours map[string]bool) []finding {
	const check = "leftovers"
	copies, err := s.RecoverCopies()
	if err != nil {
		return []finding{{"WARN", check, "cannot look for the copies of killed recovers: " + err.Error(), ""}}
	}
	var out []finding
	for _, c := range copies {
		fix := "rm " + c.Path
		if ours[c.UUID] {
			fix = fmt.Sprintf("rerun `sparsevol recover %s` (it starts over), or `rm %s`", c.UUID, c.Path)
		}
		out = append(out, finding{"WARN", check, fmt.Sprintf("%s is a partial copy a killed recover of volume %s left", c.Path, c.UUID), fix})
	}
	return out
}

// taggedDevices reports the loop devices tagged sparsevol:<uuid>. One
// whose backing file lies in this store's directory under a UUID the
// store does not have is this store's orphan: a finding each, with the
// command that frees it. Devices whose file lies elsewhere belong to
// other stores and are counted in one line, never advised to detach.
func taggedDevices(root string, ours map[string]bool) []finding {
	devs, err := loop.List()
	if err != nil {
		return []finding{{"WARN", "devices", "cannot list loop devices: " + err.Error(), ""}}
	}
	// sysfs names backing files by their real path.
	if real, err := filepath.EvalSymlinks(root); err == nil {
		root = real
	}
	var out []finding
	others := 0
	for _, d := range devs {
		uuid, ok := volume.TagUUID(d.Tag)
		if !ok {
			continue
		}
		file, ok := backingFileOf(d)
		switch {
		case !ok:
			continue // detached since it was listed
		case filepath.Dir(file) != root:
			others++
		case !ours[uuid]:
			shown, _ := shownFile(file)
			out = append(out, finding{"WARN", "device " + d.Path,
				fmt.Sprintf("bound to %s in this store and tagged for volume %s, which this store does not have", shown, uuid),
				"losetup -d " + d.Path})
		}
	}
	if others > 0 {
		out = append(out, finding{"OK", "devices",
			fmt.Sprintf("%d loop device(s) of volumes of other stores on this node (backing files outside %s): not this store's, left alone", others, root), ""})
	}
	return out
}

// shownFile is how doctor shows path, whose last element it read from a
// directory or from sysfs (a stray file, a device's backing file): as it
// is where that name is plain (volume.PlainName), else with the name
// through volume.Quote, so that no newline, escape sequence or shell
// syntax in it reaches the output. plain says which; only a plain path
// is put into a command to paste.
func shownFile(path string) (shown string, plain bool) {
	dir, name := filepath.Split(path)
	if volume.PlainName(name) {
		return path, true
	}
	return dir + volume.Quote(name), false
}

// backingFileOf is the path of d's backing file as sysfs gives it, without
// the suffix the kernel appends to a removed file.
func backingFileOf(d *loop.Device) (string, bool) {
	path, err := loop.BackingFile(d.Number)
	if err != nil {
		return "", false
	}
	return strings.TrimSuffix(path, loop.DeletedSuffix), true
}

// storeFullPercent is the share of the store's filesystem below which
// doctor fails: volumes take space as they are written, and a write that
// finds none fails inside the volume as an I/O error.
const storeFullPercent = 2

// storeFilesystem fails when the store's filesystem is full or nearly so
// (space or inodes).
func storeFilesystem(root string) finding {
	const check = "filesystem"
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return finding{"WARN", check, fmt.Sprintf("statfs %s: %v", root, err), ""}
	}
	total, avail := int64(st.Blocks)*st.Bsize, int64(st.Bavail)*st.Bsize
	detail := fmt.Sprintf("%s of %s available on the store's filesystem", volume.FormatBytes(avail), volume.FormatBytes(total))
	fix := "free space on the store's filesystem (volumes that find none get write errors)"
	switch {
	case avail == 0:
		return finding{"FAIL", check, "full: " + detail, fix}
	case avail*100 < total*storeFullPercent:
		return finding{"FAIL", check, fmt.Sprintf("nearly full: %s (doctor fails below %d%%)", detail, storeFullPercent), fix}
	case st.Files > 0 && st.Ffree == 0:
		return finding{"FAIL", check, fmt.Sprintf("no inodes left on the store's filesystem (%d in all)", st.Files), fix}
	}
	return finding{"OK", check, fmt.Sprintf("%s (doctor fails below %d%%)", detail, storeFullPercent), ""}
}

// partitionSupport tries what partitioned volumes need: a GPT on a loop
// device with partscan showing loopNp1. Its probe file (Store.ProbeFile)
// also clears what the probes of killed doctors left, which it reports.
func partitionSupport(s *volume.Store) []finding {
	const check = "partitions"
	if _, err := exec.LookPath("sgdisk"); err != nil {
		return []finding{{"FAIL", check, "sgdisk is not installed: partitioned block volumes cannot be made", "apt-get install gdisk"}}
	}
	p, err := s.ProbeFile()
	if err != nil {
		return []finding{{"WARN", check, "cannot test: " + err.Error(), ""}}
	}
	defer p.Close()
	out := probeLeftovers(p.Left)
	return append(out, probePartitions(p.File))
}

// probeLeftovers reports what the probes of killed doctors left: removed,
// or with what removes it.
func probeLeftovers(left []volume.ProbeLeftover) []finding {
	const check = "leftovers"
	var out []finding
	for _, l := range left {
		shown, plain := shownFile(l.Path)
		what := shown
		if len(l.Devices) > 0 {
			what += " and " + strings.Join(l.Devices, ", ") + " bound to it"
		}
		if l.Err == nil {
			out = append(out, finding{"OK", check, "removed " + what + ", left by a killed doctor", ""})
			continue
		}
		fix := "detach its devices (losetup -d), then remove it"
		if plain {
			fix = "rm " + l.Path
			if len(l.Devices) > 0 {
				fix = "losetup -d " + strings.Join(l.Devices, " ") + "; " + fix
			}
		}
		out = append(out, finding{"WARN", check, what + ", left by a killed doctor, is still there: " + l.Err.Error(), fix})
	}
	return out
}

// probePartitions binds a loop device with partscan to the probe file f
// holding a GPT and reports whether the kernel shows its partition.
func probePartitions(f *os.File) finding {
	const check = "partitions"
	f.Truncate(4 << 20)
	if err := exec.Command("sgdisk", "--new=1:0:0", f.Name()).Run(); err != nil {
		return finding{"WARN", check, "cannot test: sgdisk: " + err.Error(), ""}
	}
	opts := loop.AttachOptions{Partscan: true, Tag: volume.ProbeTag}
	dev, err := loop.Attach(int(f.Fd()), opts)
	if err != nil {
		return finding{"WARN", check, "cannot test: " + err.Error(), ""}
	}
	parts, _ := loop.Partitions(dev.Path)
	loop.Detach(dev.Path, loop.Owner{ID: dev.Backing, Tag: opts.Tag})
	if len(parts) == 0 {
		return finding{"WARN", check, "the kernel shows no partitions on loop devices: partitioned block volumes have no /dev/disk/by-partuuid link here",
			"use --mode block --no-partition, or a kernel with partition support (CONFIG_BLK_DEV_LOOP, partscan)"}
	}
	return finding{"OK", check, "loop partitions are scanned", ""}
}
