package volume

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/sparsevol/sparsevol/internal/parallel"
)

// Lifecycle is the service manager that brings volumes back at boot: one
// unit per volume, named by its UUID, whose start attaches the volume and
// whose stop detaches it (systemd.Manager). A Store with one (Options)
// enables a volume's unit before create marks it ready, stops and disables
// it around delete, and enables adopted volumes; without one, volumes are
// attached directly and boot is the init system's business.
//
// The Store never starts or stops a unit (Start, Disable, Enable with
// start) while it holds the volume's lock: the unit's attach or detach
// takes that lock. Enable without start, which runs nothing of the
// volume's, is called under it (create enables before ready).
type Lifecycle interface {
	// Enable makes the volume's unit start at boot, for the store at root,
	// after mountsFor are mounted; with start, it is started now too.
	Enable(ctx context.Context, uuid, root string, mountsFor []string, start bool) error
	// Start starts the enabled unit of the volume.
	Start(ctx context.Context, uuid string) error
	// Disable stops the unit (detaching the volume) and disables it. A
	// unit that is not enabled is no error.
	Disable(ctx context.Context, uuid string) error
	// Enabled reports whether the volume's unit is enabled.
	Enabled(uuid string) bool
	// EnabledVolumes lists the volumes of the enabled units, of any store.
	// Units it cannot vouch for are left out and named in the error,
	// which comes with the volumes it could list.
	EnabledVolumes() ([]EnabledVolume, error)
}

// EnabledVolume is a volume whose unit is enabled, and its store.
type EnabledVolume struct {
	UUID string
	Root string
}

// mountsFor lists what v's unit needs mounted: the store, which holds the
// backing file (always <root>/<uuid>).
func (s *Store) mountsFor(*Volume) []string { return []string{s.root} }

// enableUnit enables v's unit, without starting it, where there is a
// service manager. Create calls it before it marks v ready, so that a
// crash after "ready" never leaves a volume that does not come back at
// boot (until ready, the unit's attach refuses the volume).
func (s *Store) enableUnit(ctx context.Context, v *Volume) error {
	if s.opts.Lifecycle == nil {
		return nil
	}
	if err := s.opts.Lifecycle.Enable(ctx, v.UUID, s.root, s.mountsFor(v), false); err != nil {
		return fmt.Errorf("volume %s: %w", v.Name, err)
	}
	return nil
}

// startUnit starts the enabled unit of v, which create attached already
// (the unit's attach finds the device and only publishes it), so that
// the unit is active and stops with the volume. v is ready: a failure
// says so. The caller must not hold v's lock: the unit's attach takes it.
func (s *Store) startUnit(ctx context.Context, v *Volume) error {
	if s.opts.Lifecycle == nil {
		return nil
	}
	if err := s.opts.Lifecycle.Start(ctx, v.UUID); err != nil {
		return fmt.Errorf("volume %s (%s) was created, but: %w", v.Name, v.UUID, err)
	}
	return nil
}

// Activate hands volumes that are ready (adopted ones, say) to the service
// manager: it enables each one's unit, and starts it if start (which
// attaches the volume). Without a service manager it attaches each
// directly if start. It goes on past failures and reports them all.
// The caller holds no volume lock.
func (s *Store) Activate(ctx context.Context, vols []*Volume, start bool) error {
	var errs []error
	for _, v := range vols {
		errs = append(errs, s.activate(ctx, v, start))
	}
	return errors.Join(errs...)
}

func (s *Store) activate(ctx context.Context, v *Volume, start bool) error {
	if lc := s.opts.Lifecycle; lc != nil {
		if err := lc.Enable(ctx, v.UUID, s.root, s.mountsFor(v), start); err != nil {
			return fmt.Errorf("volume %s: %w", v.Name, err)
		}
		return nil
	}
	if !start {
		return nil
	}
	_, _, err := s.AttachDevice(ctx, v.UUID)
	return err
}

// withUnitDisabled runs del (which deletes v) with v's unit stopped and
// disabled, where there is a service manager. It refuses first, changing
// nothing, while v is in use: a mounted volume keeps its unit. If del
// finds v in use after all (mounted between the check and the delete),
// the volume stays, and so must its unit: a unit that was enabled is
// enabled and started again.
func (s *Store) withUnitDisabled(ctx context.Context, v *Volume, del func() error) error {
	lc := s.opts.Lifecycle
	if lc == nil {
		return del()
	}
	if err := s.InUse(v.UUID); err != nil {
		return err
	}
	wasEnabled := lc.Enabled(v.UUID)
	if err := lc.Disable(ctx, v.UUID); err != nil {
		return fmt.Errorf("delete %s: %w", v.Name, err)
	}
	err := del()
	if errors.Is(err, ErrBusy) && wasEnabled {
		// An undo: it runs even where ctx was cancelled meanwhile.
		if uerr := lc.Enable(context.WithoutCancel(ctx), v.UUID, s.root, s.mountsFor(v), true); uerr != nil {
			err = errors.Join(err, fmt.Errorf("re-enable the unit of %s: %w", v.Name, uerr))
		}
	}
	return err
}

// disableBroken disables the unit of a broken volume that was deleted (its
// stop found nothing to detach: delete refuses a device on its file).
func (s *Store) disableBroken(ctx context.Context, uuid string) error {
	lc := s.opts.Lifecycle
	if lc == nil || !lc.Enabled(uuid) {
		return nil
	}
	if err := lc.Disable(ctx, uuid); err != nil {
		return fmt.Errorf("volume %s deleted, but: %w", uuid, err)
	}
	return nil
}

// AttachEnabled attaches the volumes of lc's enabled units, the stores
// side by side, each in one pass (AttachMany), with opts for every store.
// It goes on past units lc could not list, stores and volumes that fail,
// and reports them all; the volumes it attached are returned, store by
// store. Each store is swept of what killed writers left (see uuids)
// first: once per boot. ctx's deadline, or else opts.UdevTimeout from the
// start, bounds the whole of it, every store together, so that a boot
// unit's TimeoutSec above it is never reached.
func AttachEnabled(ctx context.Context, lc Lifecycle, opts Options) ([]*Status, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, opts.udevTimeout())
		defer cancel()
	}
	enabled, listErr := lc.EnabledVolumes()
	byRoot := map[string][]string{}
	var roots []string
	for _, e := range enabled {
		if byRoot[e.Root] == nil {
			roots = append(roots, e.Root)
		}
		byRoot[e.Root] = append(byRoot[e.Root], e.UUID)
	}
	if opts.Logger != nil {
		opts.Logger.Info("attaching the volumes of the enabled units", "units", len(enabled), "stores", len(roots))
	}
	// The stores side by side, each binding its volumes at the start, so
	// that every store's udev waits run within the one deadline: one
	// after the other, a store whose links never came spent all of it,
	// and a later store's raw volumes, bound after it, were refused
	// before udev could look at them (errProbed) and detached again.
	sts := make([][]*Status, len(roots))
	errs := make([]error, len(roots)+1) // listErr first, then each store's
	errs[0] = listErr
	parallel.For(len(roots), len(roots), func(i int) {
		s, err := Open(roots[i], opts)
		if err != nil {
			errs[i+1] = err
			return
		}
		if _, err := s.uuids(); err != nil {
			s.log.Warn("sweeping the store", "error", err)
		}
		sts[i], errs[i+1] = s.AttachMany(ctx, byRoot[roots[i]])
	})
	return slices.Concat(sts...), errors.Join(errs...)
}
