package systemd

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/moby/sys/mountinfo"

	"github.com/sparsevol/sparsevol/internal/fsutil"
)

// DefaultFstab is the file systemd makes the node's mount units from.
const DefaultFstab = "/etc/fstab"

// maxFstab bounds what is read of the fstab.
const maxFstab = 1 << 20

func (m Manager) fstab() string {
	if m.Fstab == "" {
		return DefaultFstab
	}
	return m.Fstab
}

// SystemUnitPath is systemd's search path for system units, first found
// first (systemd.unit(5)), with Debian's /lib/systemd/system beside
// /usr/lib's: where a mount unit that is not in the fstab is defined (a
// unit file an administrator or an installer such as Ignition wrote).
var SystemUnitPath = []string{
	"/etc/systemd/system.control", "/run/systemd/system.control", "/run/systemd/transient",
	"/run/systemd/generator.early", "/etc/systemd/system", "/etc/systemd/system.attached",
	"/run/systemd/system", "/run/systemd/system.attached", "/run/systemd/generator",
	"/usr/local/lib/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system",
	"/run/systemd/generator.late",
}

// unitPath is where EnabledVolumes looks for mount units: UnitPath, or
// SystemUnitPath for the node's own unit directory, or only Dir for
// another (a staged root, a test).
func (m Manager) unitPath() []string {
	switch {
	case m.UnitPath != nil:
		return m.UnitPath
	case m.dir() == DefaultUnitDir:
		return SystemUnitPath
	}
	return []string{m.dir()}
}

// mountGuard answers, for the paths of an instance, whether a filesystem
// that the node mounts at or above one of them (an fstab entry, or a
// mount unit's file) is not mounted now. The boot unit only wants the
// stores' mounts (a failed one fails only its own instances), so its
// attach runs after a mount that failed, and the directory it finds there
// is what lies below the mount point: not the store the unit names, maybe
// an older one with the same volumes, whose data must not come up in
// their place. Paths and fstab mount points are compared with their
// symbolic links resolved, as systemd resolves a mount point; each path
// and directory is resolved and looked up once (the instances of a store
// share them).
type mountGuard struct {
	fstab     string
	points    []string          // fstab mount points but /, resolved
	unitPath  []string          // directories searched for mount units
	unitFiles map[string]string // mountUnitFile's answers, by directory
	resolved  map[string]string // paths resolved, by path as written
	mounted   map[string]bool   // mount points of this mount namespace
}

// newMountGuard reads fstab and this mount namespace's mounts once. A
// missing fstab lists no mount point.
func newMountGuard(fstab string, unitPath []string) (*mountGuard, error) {
	g := &mountGuard{fstab: fstab, unitPath: unitPath, unitFiles: map[string]string{}, resolved: map[string]string{}, mounted: map[string]bool{}}
	data, err := fsutil.ReadRegularFollowing(fstab, maxFstab)
	switch {
	case err == nil:
		for _, mp := range fstabMountPoints(data) {
			g.points = append(g.points, resolved(mp))
		}
	case !errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("read %s: %w", fstab, err)
	}
	mounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, fmt.Errorf("read the mount table: %w", err)
	}
	for _, mnt := range mounts {
		g.mounted[filepath.Clean(mnt.Mountpoint)] = true
	}
	return g, nil
}

// unmounted returns the first mount point at or above one of paths that
// the fstab or a mount unit names and that is not mounted, with where it
// is defined; "" if there is none.
func (g *mountGuard) unmounted(paths ...string) (point, where string) {
	for _, p := range paths {
		r, ok := g.resolved[p]
		if !ok {
			r = resolved(p)
			g.resolved[p] = r
		}
		if p = r; !filepath.IsAbs(p) {
			continue
		}
		for _, mp := range g.points {
			if (p == mp || strings.HasPrefix(p, mp+"/")) && !g.mounted[mp] {
				return mp, g.fstab
			}
		}
		for dir := p; dir != "/"; dir = filepath.Dir(dir) {
			if g.mounted[dir] {
				continue
			}
			if file := g.mountUnitFile(dir); file != "" {
				return dir, file
			}
		}
	}
	return "", ""
}

// mountUnitFile returns the file that defines the mount unit of dir, the
// first in the unit path as systemd loads it; "" if there is none, or
// if the first is a mask (a link to /dev/null, or an empty file).
func (g *mountGuard) mountUnitFile(dir string) string {
	file, ok := g.unitFiles[dir]
	if !ok {
		file = g.findMountUnit(dir)
		g.unitFiles[dir] = file
	}
	return file
}

func (g *mountGuard) findMountUnit(dir string) string {
	name := mountUnit(dir)
	for _, d := range g.unitPath {
		file := filepath.Join(d, name)
		st, err := os.Lstat(file)
		if err != nil {
			continue
		}
		if st.Mode()&fs.ModeSymlink != 0 {
			if target, err := os.Readlink(file); err == nil && target == os.DevNull {
				return ""
			}
		} else if st.Mode().IsRegular() && st.Size() == 0 {
			return ""
		}
		return file
	}
	return ""
}

// resolved is path, cleaned, with its symbolic links resolved where it
// exists (filepath.EvalSymlinks); as it is otherwise.
func resolved(path string) string {
	path = filepath.Clean(path)
	if r, err := filepath.EvalSymlinks(path); err == nil {
		return r
	}
	return path
}

// fstabMountPoints lists the absolute mount points of an fstab's entries
// (octal escapes such as \040 decoded), / left out: it is always mounted.
// Lines are read as libmount reads them: fields split at spaces and tabs
// only, and a line without a filesystem type is no entry.
func fstabMountPoints(data []byte) []string {
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 4096), maxFstab)
	for sc.Scan() {
		line := strings.Trim(sc.Text(), " \t")
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.FieldsFunc(line, func(r rune) bool { return r == ' ' || r == '\t' })
		if len(f) < 3 {
			continue
		}
		mp := filepath.Clean(fsutil.UnescapeOctal(f[1]))
		if filepath.IsAbs(mp) && mp != "/" {
			out = append(out, mp)
		}
	}
	return out
}
