package volume

import (
	"context"
	"errors"
	"fmt"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// Delete removes a volume: its loop devices, its backing file and its
// metadata, in that order, after marking it deleting. It refuses, changing
// nothing, while the volume is mounted or open (naming who holds it), while
// a device someone else bound holds its file, while its file has other
// links (the data would live on), and without opts.Force while it is
// orphaned. A crash midway leaves a volume in state deleting that the next
// Delete finishes.
// A broken volume (unreadable metadata) is deleted by deleteBroken; one
// whose record a newer sparsevol wrote is refused (ErrNewer). With a
// Lifecycle, the volume's unit is stopped and disabled first (see
// withUnitDisabled).
func (s *Store) Delete(ctx context.Context, ref string, opts DetachOptions) error {
	v, err := s.Get(ref)
	if err != nil {
		return err
	}
	if v.State == StateBroken {
		if err := s.deleteBroken(v.UUID); err != nil {
			return err
		}
		return s.disableBroken(ctx, v.UUID)
	}
	return s.withUnitDisabled(ctx, v, func() error { return s.delete(v.UUID, opts) })
}

func (s *Store) delete(ref string, opts DetachOptions) error {
	return s.withVolume(ref, func(v *Volume) error {
		s.cleanupTempMount(v) // left by an expansion that crashed
		ids, present := s.backingIDs(v)
		bound, err := s.boundTo(v, ids)
		if err != nil {
			return fmt.Errorf("delete %s: %w", v.Name, err)
		}
		ours, foreign := s.devicesOf(v, ids, present, bound)
		if len(foreign) > 0 {
			return s.foreignError("delete", v, present, foreign)
		}
		if err := busy(ours); err != nil {
			return fmt.Errorf("delete %s: %w", v.Name, err)
		}
		// A symlink, a second link or anything else that is not provably
		// the volume's file: its data may live on elsewhere, and what to
		// do with it is the operator's call.
		if _, err := s.statBacking(v.UUID); errors.Is(err, ErrUnsafe) {
			return fmt.Errorf("delete %s: %w (remove it yourself once you know what it is, then delete again)", v.Name, err)
		}
		if !opts.Force {
			if err := s.orphaned(v, ours); err != nil {
				return fmt.Errorf("delete %s: %w", v.Name, err)
			}
		}
		if v.State != StateDeleting {
			v.State = StateDeleting
			if err := s.writeMeta(v); err != nil {
				return err
			}
		}
		crashPoint("delete:marked")
		if err := s.detachDevices(v, bound, DetachOptions{Force: true}); err != nil {
			return fmt.Errorf("delete %s: %w", v.Name, err)
		}
		crashPoint("delete:detached")
		if err := s.removeBacking(v.UUID); err != nil {
			return fmt.Errorf("delete %s: %w", v.Name, err)
		}
		if err := s.removeRecoverTemp(v.UUID); err != nil {
			return fmt.Errorf("delete %s: %w", v.Name, err)
		}
		crashPoint("delete:file")
		if err := s.removeMeta(v.UUID); err != nil {
			return err
		}
		s.forgetName(v.Name, v.UUID)
		s.log.Info("volume deleted", "volume", v.Name, "uuid", v.UUID)
		return nil
	})
}

// InUse returns an ErrBusy error naming who holds the volume's devices
// (mounts, holders, open file descriptors), or nil. It changes nothing but
// a temporary mount a crashed expansion of ours left behind.
func (s *Store) InUse(ref string) error {
	return s.withVolume(ref, func(v *Volume) error {
		s.cleanupTempMount(v) // ours, left by an expansion that crashed
		ids, present := s.backingIDs(v)
		bound, err := s.boundTo(v, ids)
		if err != nil {
			return fmt.Errorf("volume %s: %w", v.Name, err)
		}
		ours, _ := s.devicesOf(v, ids, present, bound)
		if err := busy(ours); err != nil {
			return fmt.Errorf("volume %s: %w", v.Name, err)
		}
		return nil
	})
}

// busy returns an ErrBusy error if any of devs is in use.
func busy(devs []*loop.Device) error {
	for _, d := range devs {
		if err := loop.Busy(d.Path); err != nil {
			return fmt.Errorf("%w: %w", ErrBusy, err)
		}
	}
	return nil
}
