package systemd

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
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

// mountGuard answers, for the paths of an instance, whether a filesystem
// the fstab mounts at or above one of them is not mounted now. The boot
// unit only wants the stores' mounts (a failed one fails only its own
// instances), so its attach runs after a mount that failed, and the
// directory it finds there is what lies below the mount point: not the
// store the unit names, maybe an older one with the same volumes, whose
// data must not come up in their place.
type mountGuard struct {
	fstab   string
	points  []string        // fstab mount points but /, cleaned
	mounted map[string]bool // mount points of this mount namespace
}

// newMountGuard reads fstab and this mount namespace's mounts once. A
// missing fstab lists no mount point.
func newMountGuard(fstab string) (*mountGuard, error) {
	g := &mountGuard{fstab: fstab, mounted: map[string]bool{}}
	data, err := fsutil.ReadRegularFollowing(fstab, maxFstab)
	switch {
	case err == nil:
		g.points = fstabMountPoints(data)
	case !errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("read %s: %w", fstab, err)
	}
	if len(g.points) == 0 {
		return g, nil
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

// unmounted returns the first fstab mount point at or above one of paths
// that is not mounted, or "".
func (g *mountGuard) unmounted(paths ...string) string {
	for _, p := range paths {
		p = filepath.Clean(p)
		for _, mp := range g.points {
			if (p == mp || strings.HasPrefix(p, mp+"/")) && !g.mounted[mp] {
				return mp
			}
		}
	}
	return ""
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
