package volume

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// Delete removes a volume: its loop devices, its backing file and its
// metadata, in that order, after marking it deleting. It refuses, changing
// nothing, while the volume is mounted or open, naming who holds it. A crash
// midway leaves a volume in state deleting that the next Delete finishes.
// A broken volume (unreadable metadata) is deleted by deleteBroken. With a
// Lifecycle, the volume's unit is stopped and disabled first (see
// withUnitDisabled).
func (s *Store) Delete(ctx context.Context, ref string) error {
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
	return s.withUnitDisabled(ctx, v, func() error { return s.delete(ctx, v.UUID) })
}

func (s *Store) delete(ctx context.Context, ref string) error {
	return s.withVolume(ref, func(v *Volume) error {
		s.cleanupTempMount(v) // left by an expansion that crashed
		if err := inUse(v); err != nil {
			return fmt.Errorf("delete %s: %w", v.Name, err)
		}
		if v.State != StateDeleting {
			v.State = StateDeleting
			if err := s.writeMeta(v); err != nil {
				return err
			}
		}
		crashPoint("delete:marked")
		if err := s.detachDevices(v, nil); err != nil {
			return fmt.Errorf("delete %s: %w", v.Name, err)
		}
		crashPoint("delete:detached")
		if err := os.Remove(v.BackingFile); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("delete %s: %w", v.Name, err)
		}
		crashPoint("delete:file")
		if err := s.removeMeta(v.UUID); err != nil {
			return err
		}
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
		if err := inUse(v); err != nil {
			return fmt.Errorf("volume %s: %w", v.Name, err)
		}
		return nil
	})
}

func inUse(v *Volume) error {
	id, err := loop.FileIDOf(v.BackingFile)
	if isNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	devs, err := loop.FindAll(id)
	if err != nil {
		return err
	}
	for _, d := range devs {
		if err := loop.Busy(d.Path); err != nil {
			return fmt.Errorf("%w: %w", ErrBusy, err)
		}
	}
	return nil
}
