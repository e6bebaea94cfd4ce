package systemd

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/sparsevol/sparsevol/internal/fsutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// Boot in one process.
//
// systemd forks a process for every unit it starts, and in a slow machine
// that fork is most of a unit's cost: measured in the emulated test VM,
// 100 instances whose ExecStart is /bin/true delay kubelet by ~10 s, the
// same 100 without an ExecStart by ~2 s. So at boot the instances do not
// attach their volumes themselves. The generator (systemd runs it before
// it loads units, at boot and at every daemon-reload) gives every enabled
// instance a drop-in that
//
//   - clears its ExecStart (it becomes active without a process),
//   - orders it after BootUnit, which attaches all of them in one process
//     and waits for udev once,
//   - asserts the volume's attached marker, so an instance whose volume did
//     not come up does not become active.
//
// BootUnit writes BootDoneFile when it is done; from then on the generator
// writes no instance drop-ins, and BootDoneUnit reloads systemd once the
// boot is over, so that starting an instance later runs its own ExecStart
// again. ExecStop is never touched: stopping an instance always detaches.

// BootUnit attaches the volumes of every enabled instance at boot.
const BootUnit = "sparsevol-boot.service"

// BootDoneUnit ends boot mode after the boot (see above).
const BootDoneUnit = "sparsevol-boot-done.service"

// GeneratorName is the generator's file name in the generator directory;
// it is a link to the sparsevol binary, which acts as the generator when
// called by that name.
const GeneratorName = "sparsevol-generator"

// DefaultRunDir holds the boot-mode markers; it is on /run, so every boot
// starts in boot mode.
const DefaultRunDir = "/run/sparsevol"

const bootDropIn = "50-boot.conf"

// Instance is an enabled sparsevol@ instance and where its volume lives.
type Instance struct {
	UUID      string
	Root      string   // the store (SPARSEVOL_ROOT of its drop-in or the template)
	MountsFor []string // paths the instance needs mounted (RequiresMountsFor)
}

// AttachedDir is where attach marks the volumes it brought up
// (<run dir>/attached/<uuid>) and the boot drop-ins assert them; the volume
// store writes and removes the markers.
func (m Manager) AttachedDir() string { return filepath.Join(m.runDir(), "attached") }

// UdevIdentityDir is where attach leaves the filesystem identity of the
// devices it binds, for the udev rule of deploy/udev (which names the
// default: /run/sparsevol/udev); the volume store writes and removes the
// files.
func (m Manager) UdevIdentityDir() string { return filepath.Join(m.runDir(), "udev") }

func (m Manager) runDir() string {
	if m.RunDir == "" {
		return DefaultRunDir
	}
	return m.RunDir
}

func (m Manager) bootDoneFile() string { return filepath.Join(m.runDir(), "boot-done") }

// BootDone reports whether this boot's BootUnit has finished: its marker
// is a regular file (a link there is not MarkBootDone's).
func (m Manager) BootDone() bool {
	fi, err := os.Lstat(m.bootDoneFile())
	return err == nil && fi.Mode().IsRegular()
}

// MarkBootDone ends boot mode for the generator's next run. The marker
// is made by fsutil.CreateMarker: a link at its name is refused, never
// followed.
func (m Manager) MarkBootDone() error {
	if err := os.MkdirAll(m.runDir(), 0o755); err != nil {
		return fmt.Errorf("mark boot done: %w", err)
	}
	if err := fsutil.CreateMarker(m.bootDoneFile()); err != nil {
		return fmt.Errorf("mark boot done: %w; remove what is there, and run `sparsevol units boot-done`", err)
	}
	return nil
}

// EnabledInstances lists the enabled instances (links in
// multi-user.target.wants), sorted by UUID, each with the store its
// drop-in names. An instance whose name is not a volume UUID (Enable
// makes no other), or whose store or mounts (from its drop-in or the
// template) fail volume.CheckUnitPath (ErrInvalid), or whose drop-in is
// there but cannot be read as Enable writes it (readDropIn), is left out
// of the list and named in the error, which comes with the instances it
// could list: their callers (the generator, boot) go on with those.
func (m Manager) EnabledInstances() ([]Instance, error) {
	tmpl := filepath.Join(m.dir(), TemplateName)
	tmplRoot, _, err := readUnitSettings(tmpl)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("read %s: %w", TemplateName, err)
	}
	wants := filepath.Join(m.dir(), "multi-user.target.wants")
	entries, err := os.ReadDir(wants)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list enabled instances: %w", err)
	}
	var out []Instance
	var errs []error
	for _, e := range entries {
		uuid, ok := strings.CutPrefix(e.Name(), "sparsevol@")
		if !ok {
			continue
		}
		if uuid, ok = strings.CutSuffix(uuid, ".service"); !ok || uuid == "" {
			continue
		}
		if !volume.ValidUUID(uuid) {
			errs = append(errs, fmt.Errorf("enabled unit %s in %s: %s is not a volume UUID; remove the link: %w",
				volume.Quote(e.Name()), wants, volume.Quote(uuid), volume.ErrInvalid))
			continue
		}
		inst, rootFrom := Instance{UUID: uuid, Root: tmplRoot}, tmpl
		root, mounts, err := readDropIn(m.DropInPath(uuid))
		switch {
		case err == nil:
			if root != "" {
				inst.Root, rootFrom = root, m.DropInPath(uuid)
			}
			inst.MountsFor = mounts
		case !errors.Is(err, fs.ErrNotExist):
			errs = append(errs, fmt.Errorf("enabled unit %s: drop-in: %w; remove it, or disable and enable the volume again", UnitName(uuid), err))
			continue
		}
		if inst.Root == "" {
			inst.Root = defaultRoot
		}
		if err := inst.check(rootFrom, m.DropInPath(uuid)); err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, inst)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].UUID < out[j].UUID })
	return out, errors.Join(errs...)
}

// check applies volume.CheckUnitPath to the store and mounts of in, read
// from rootFrom and mountsFrom: they go into the generated drop-ins and
// name the store boot opens.
func (in Instance) check(rootFrom, mountsFrom string) error {
	if err := volume.CheckUnitPath(in.Root); err != nil {
		return fmt.Errorf("enabled unit %s: store in %s: %w", UnitName(in.UUID), rootFrom, err)
	}
	for _, p := range in.MountsFor {
		if err := volume.CheckUnitPath(p); err != nil {
			return fmt.Errorf("enabled unit %s: RequiresMountsFor= in %s: %w", UnitName(in.UUID), mountsFrom, err)
		}
	}
	return nil
}

// EnabledVolumes lists the volumes of the enabled instances and their
// stores (volume.Lifecycle, what boot attaches), with EnabledInstances'
// error for those it left out. It also leaves out, and names in the
// error (volume.ErrUnsafe), an instance whose store or RequiresMountsFor=
// paths lie at or below a mount point of the fstab, or of a mount unit's
// file in the unit path, that is not mounted:
// the boot unit only wants the stores' mounts, so it runs after one that
// failed, and what it would find there is the directory below the mount
// point, not the store (mountGuard). The instance's own unit requires
// the mount and fails with it.
func (m Manager) EnabledVolumes() ([]volume.EnabledVolume, error) {
	insts, err := m.EnabledInstances()
	errs := []error{err}
	var guard *mountGuard
	if len(insts) > 0 {
		var gerr error
		if guard, gerr = newMountGuard(m.fstab(), m.unitPath()); gerr != nil {
			return nil, errors.Join(err, fmt.Errorf("enabled volumes: %w", gerr))
		}
	}
	out := make([]volume.EnabledVolume, 0, len(insts))
	for _, in := range insts {
		if mp, where := guard.unmounted(append([]string{in.Root}, in.MountsFor...)...); mp != "" {
			errs = append(errs, fmt.Errorf("enabled unit %s: %s (in %s) is not mounted, and below it is not the store %s: left for its unit, which waits for the mount; mount it, or see `systemctl status %s`: %w",
				UnitName(in.UUID), mp, where, in.Root, mountUnit(mp), volume.ErrUnsafe))
			continue
		}
		out = append(out, volume.EnabledVolume{UUID: in.UUID, Root: in.Root})
	}
	return out, errors.Join(errs...)
}

// readDropIn is readUnitSettings for an instance's drop-in, which only
// Enable writes: a regular file of at most maxUnit bytes, read without
// following a link (fsutil.ReadRegular), so that a FIFO there cannot hold
// up the generator and boot, nor a link make them read another file.
func readDropIn(path string) (root string, mountsFor []string, err error) {
	data, err := fsutil.ReadRegular(path, maxUnit)
	if err != nil {
		return "", nil, err
	}
	return unitSettings(bytes.NewReader(data))
}

// readUnitSettings reads the two settings sparsevol writes into its unit
// files: Environment=SPARSEVOL_ROOT= and RequiresMountsFor=. The unit may
// be a link (`systemctl link`), followed, to a regular file of at most
// maxUnit bytes (fsutil.ReadRegularFollowing: a FIFO there cannot hold up
// the generator). A masked unit (a link to /dev/null) holds no settings.
func readUnitSettings(path string) (root string, mountsFor []string, err error) {
	if masked(path) {
		return "", nil, nil
	}
	data, err := fsutil.ReadRegularFollowing(path, maxUnit)
	if err != nil {
		return "", nil, err
	}
	return unitSettings(bytes.NewReader(data))
}

// unitSettings is readUnitSettings on the text r.
func unitSettings(r io.Reader) (root string, mountsFor []string, err error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if v, ok := strings.CutPrefix(line, "Environment=SPARSEVOL_ROOT="); ok {
			root = v
		}
		if v, ok := strings.CutPrefix(line, "RequiresMountsFor="); ok {
			mountsFor = append(mountsFor, strings.Fields(v)...)
		}
	}
	return root, mountsFor, sc.Err()
}

// Generate writes the generator's output into dir (the "normal" directory
// systemd passes): while the boot is not done, a drop-in per enabled
// instance (see above); always, a drop-in that makes BootUnit wait for the
// mounts of every enabled instance. Instances EnabledInstances leaves out,
// and ones whose drop-in cannot be written, get nothing; their errors are
// returned once the others' drop-ins are written. If BootUnit's cannot
// be, no instance gets one: each then attaches its own volume.
func (m Manager) Generate(dir string) error {
	insts, listErr := m.EnabledInstances()
	if err := m.generate(dir, insts); err != nil {
		return errors.Join(listErr, err)
	}
	return listErr
}

func (m Manager) generate(dir string, insts []Instance) error {
	if len(insts) == 0 {
		return nil
	}
	// Each path as written and with its links resolved where it can be
	// now: systemd names a mount unit by the directory it mounts, the
	// fstab's mount point resolved.
	mounts := map[string]bool{}
	for _, in := range insts {
		for _, p := range append([]string{in.Root}, in.MountsFor...) {
			mounts[p], mounts[resolved(p)] = true, true
		}
	}
	var paths []string
	for p := range mounts {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	// Wanted, not required (RequiresMountsFor=): one mount that fails
	// fails only the instances whose own drop-in requires it, not the
	// boot unit and with it every volume (systemd 252 has no
	// WantsMountsFor=).
	units := mountUnitsFor(paths)
	bootConf := fmt.Sprintf("# Generated by %s: the mounts of the stores and backing files of the enabled volumes.\n[Unit]\nWants=%s\nAfter=%s\n",
		GeneratorName, units, units)
	// Without its mounts the boot unit could run before them: then the
	// instances get no drop-in and each attaches its own volume.
	if err := writeDropIn(dir, BootUnit, bootConf); err != nil {
		return err
	}
	if m.BootDone() {
		return nil
	}
	var errs []error
	for _, in := range insts {
		conf := fmt.Sprintf(`# Generated by %s for this boot only: %s attaches this
# volume together with the others, so this unit needs no process of its own.
[Unit]
Wants=%s
After=%s
AssertPathExists=%s

[Service]
ExecStart=
`, GeneratorName, BootUnit, BootUnit, BootUnit, filepath.Join(m.AttachedDir(), in.UUID))
		// One instance's failure costs only its own boot mode (it runs
		// its own ExecStart): the others' drop-ins are still written.
		errs = append(errs, writeDropIn(dir, UnitName(in.UUID), conf))
	}
	return errors.Join(errs...)
}

// mountUnitsFor names the mount units of paths and of every directory
// above them, as RequiresMountsFor= would, space separated, each once.
// Units of directories that are no mount point are named too: systemd
// finds them not loaded and skips them.
func mountUnitsFor(paths []string) string {
	seen := map[string]bool{}
	var units []string
	for _, p := range paths {
		for p = filepath.Clean(p); ; p = filepath.Dir(p) {
			if u := mountUnit(p); !seen[u] {
				seen[u] = true
				units = append(units, u)
			}
			if p == "/" {
				break
			}
		}
	}
	sort.Strings(units)
	return strings.Join(units, " ")
}

// mountUnit is the name of the mount unit of the absolute, clean path
// (systemd-escape --path --suffix=mount): "/" is "-"; otherwise the
// leading slash goes, slashes become dashes, and every byte but ASCII
// letters, digits, ":", "_" and a "." that does not lead is written \xNN.
func mountUnit(path string) string {
	if path == "/" {
		return "-.mount"
	}
	var b strings.Builder
	for i, c := range []byte(strings.TrimPrefix(path, "/")) {
		switch {
		case c == '/':
			b.WriteByte('-')
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == ':', c == '_', c == '.' && i > 0:
			b.WriteByte(c)
		default:
			fmt.Fprintf(&b, `\x%02x`, c)
		}
	}
	return b.String() + ".mount"
}

// writeDropIn writes unit's generated drop-in under dir atomically
// (fsutil.ReplaceFile): a generator killed mid-write leaves no torn
// drop-in, and a link at its name is replaced, never written through.
// Nothing is flushed: systemd's generator output is in /run, which no
// power cut keeps.
func writeDropIn(dir, unit, content string) error {
	d := filepath.Join(dir, unit+".d")
	if err := os.MkdirAll(d, 0o755); err != nil {
		return fmt.Errorf("generate %s: %w", unit, err)
	}
	if err := fsutil.ReplaceFile(filepath.Join(d, bootDropIn), []byte(content), 0o644, fsutil.FlushNone); err != nil {
		return fmt.Errorf("generate %s: %w", unit, err)
	}
	return nil
}

// inBootMode reports whether systemd loaded uuid's instance with the
// generator's boot-mode drop-in.
func (m Manager) inBootMode(uuid string) bool {
	_, err := os.Stat(filepath.Join(generatorOutput, UnitName(uuid)+".d", bootDropIn))
	return err == nil
}

// generatorOutput is the "normal" directory systemd gives generators.
const generatorOutput = "/run/systemd/generator"
