package volume

import (
	"errors"
	"fmt"
	"strings"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// deleteBroken removes a broken volume (metadata that cannot be read), under
// its lock: the backing file <root>/<uuid>, then the metadata, so a crash in
// between leaves it broken, not a file no metadata names. The backing file
// is removed only where the backing file rules allow (see backing.go) and
// no loop device holds it: a device on it refuses the delete, changing
// nothing (ErrBusy); a file the rules refuse is left in place, and the log
// says so. A record of a newer format is no broken one: it is refused.
func (s *Store) deleteBroken(uuid string) error {
	unlock, err := s.lock(uuid)
	if err != nil {
		return err
	}
	defer unlock()
	switch _, err := s.readMeta(uuid); {
	case err == nil:
		return fmt.Errorf("delete %s: its metadata was repaired meanwhile; rerun delete: %w", uuid, ErrNotReady)
	case !errors.Is(err, ErrBroken):
		return fmt.Errorf("delete %s: %w", uuid, err)
	}
	st, err := s.statBacking(uuid)
	switch {
	case isNotExist(err):
	case errors.Is(err, ErrUnsafe):
		s.log.Warn("broken volume's backing file left in place", "uuid", uuid, "reason", err)
	case err != nil:
		return fmt.Errorf("delete %s: %w", uuid, err)
	default:
		id := loop.FileID{Dev: st.Dev, Inode: st.Ino}
		bound, err := loop.Bound(id)
		if err != nil {
			return fmt.Errorf("delete %s: %w", uuid, err)
		}
		if devs := bound[id]; len(devs) > 0 {
			paths := make([]string, len(devs))
			for i, d := range devs {
				paths[i] = d.Path
			}
			return fmt.Errorf("delete %s: %s holds %s (detach it with losetup -d once nothing uses it): %w",
				uuid, strings.Join(paths, ", "), s.backingPath(uuid), ErrBusy)
		}
		if err := s.removeBacking(uuid); err != nil {
			return fmt.Errorf("delete %s: %w", uuid, err)
		}
	}
	if err := s.removeMeta(uuid); err != nil {
		return err
	}
	s.log.Info("broken volume deleted", "uuid", uuid)
	return nil
}
