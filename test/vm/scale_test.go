//go:build e2e

package vm

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// scaleSet is the scenario 7 volume set: names in order and their UUIDs.
type scaleSet struct {
	names   []string
	uuids   map[string]string
	created time.Duration
	where   string
}

// provisionScale creates the scale set offline, between two boots: the
// image's own sparsevol binary runs in a chroot of the root disk while the
// VM is down: `sparsevol create NAME --size SIZE --no-start`.
// The engine writes everything it writes on a node (backing file, metadata,
// the unit's drop-in) and enables the unit through systemctl, which
// SYSTEMD_OFFLINE=1 turns into the symlink-only mode image builders use. The
// result on disk is what 100 creates on the node leave; it takes seconds
// instead of the ~10 s each create costs in the emulated guest (two systemd
// reloads per create). The loop device create formats through is one of
// the host's, so /dev and /sys are the host's inside the chroot.
func (r *run) provisionScale(t *testing.T) (set *scaleSet, err error) {
	err = r.WithRoot(true, func(mnt string) error {
		// systemd.Running() in the engine looks for /run/systemd/system; the
		// image's /run is an empty directory under the guest's tmpfs.
		runSystemd := filepath.Join(mnt, "run/systemd")
		if _, err := os.Stat(runSystemd); os.IsNotExist(err) {
			defer os.RemoveAll(runSystemd)
		}
		if err := os.MkdirAll(filepath.Join(runSystemd, "system"), 0o755); err != nil {
			return err
		}
		set = &scaleSet{uuids: map[string]string{}, where: "host, offline in a chroot of the image"}
		start := time.Now()
		for i := 1; i <= r.cfg.scaleCount; i++ {
			name := fmt.Sprintf("s7-%03d", i)
			var out, errOut bytes.Buffer
			cmd := exec.Command("chroot", mnt, "/usr/local/bin/sparsevol", "-v", "create", name,
				"--size", r.cfg.scaleSize, "--no-start")
			cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "SYSTEMD_OFFLINE=1", "LC_ALL=C"}
			cmd.Stdout = &out
			cmd.Stderr = &errOut
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("chroot sparsevol create %s: %v: %s", name, err, strings.TrimSpace(errOut.String()))
			}
			uuid := strings.TrimSpace(out.String())
			if _, err := os.Lstat(filepath.Join(mnt, "etc/systemd/system/multi-user.target.wants/sparsevol@"+uuid+".service")); err != nil {
				return fmt.Errorf("create %s (%s) did not enable its unit: %v\n%s", name, uuid, err, strings.TrimSpace(errOut.String()))
			}
			set.names = append(set.names, name)
			set.uuids[name] = uuid
		}
		set.created = time.Since(start)
		return nil
	})
	return set, err
}

// scaleFromGuest reads the set created in the guest (SPARSEVOL_E2E_SCALE_IN_GUEST).
func scaleFromGuest(b *bootView) *scaleSet {
	set := &scaleSet{uuids: map[string]string{}, where: "guest, sparsevol create"}
	for _, n := range strings.Fields(b.Facts["s7.volumes"]) {
		set.names = append(set.names, n)
		set.uuids[n] = b.Facts[n+".uuid"]
	}
	if ms, err := strconv.Atoi(b.Facts["s7.createMs"]); err == nil {
		set.created = time.Duration(ms) * time.Millisecond
	}
	return set
}
