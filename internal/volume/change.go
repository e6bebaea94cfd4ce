package volume

import (
	"errors"
	"fmt"
	"maps"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/iolimit"
	"github.com/sparsevol/sparsevol/internal/loop"
)

// IOLimits are a volume's I/O limits, enforced on its loop device (see
// package iolimit). Zero fields limit nothing.
type IOLimits = iolimit.Limits

// ErrNotSupported: the host cannot do what was asked (I/O limits without
// cgroup v2's io controller); nothing was changed.
var ErrNotSupported = iolimit.ErrNotSupported

// ParseIOPS parses an IOPS limit (a positive number, or max for none).
func ParseIOPS(s string) (uint64, error) {
	n, err := iolimit.ParseIOPS(s)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	return n, nil
}

// ParseBPS parses a bytes-per-second limit in ParseSize's units, or max
// for none (0). Zero is refused: it would stop all I/O. Errors wrap
// ErrInvalid and say how to ask for no limit.
func ParseBPS(s string) (uint64, error) {
	if s == "max" {
		return 0, nil
	}
	n, err := ParseSize(s)
	if err != nil {
		return 0, fmt.Errorf("bytes per second (a positive size, or max for no limit): %w", err)
	}
	return uint64(n), nil
}

// CheckLimits is the rule for I/O limits: values the kernel enforces as
// given, and a host that can enforce them at all. Errors wrap ErrInvalid
// or ErrNotSupported; nothing is changed.
func (s *Store) CheckLimits(l IOLimits) error {
	if err := l.Validate(); err != nil {
		return fmt.Errorf("%w: %w", err, ErrInvalid)
	}
	if l.IsZero() {
		return nil
	}
	return s.opts.IOLimits.Supported()
}

// applyLimits converges the io.max entry of dev, v's own whole loop
// device, to v's limits (none: no entry, which also clears what a device
// of that number served before). The caller holds v's lock.
func (s *Store) applyLimits(v *Volume, dev *loop.Device) error {
	return s.applyLimitsOver(v, dev, nil)
}

// applyLimitsOver is applyLimits knowing the cgroup's entries (nil: not
// read), which spares a volume whose entry is right already any write.
// It is the one place a volume's limits are written: the entry is keyed
// by a device number, which an unbind frees for anyone's bind, so dev is
// held proven v's (loop.Hold) from before the write until after it;
// while held, a detach by anyone is only deferred and the number cannot
// be rebound. A dev that is no longer v's fails with loop.ErrNotAttached
// or loop.ErrNotOwned (wrapped), and nothing is written.
func (s *Store) applyLimitsOver(v *Volume, dev *loop.Device, entries map[uint64]IOLimits) error {
	if entries != nil {
		if n, err := dev.DevT(); err == nil && entries[n] == v.IOLimits {
			return nil
		}
	}
	held, err := loop.Hold(dev.Path, v.owner(dev.Backing))
	if err != nil {
		return fmt.Errorf("I/O limits of %s on %s: %w", v.Name, dev.Path, err)
	}
	defer held.Close()
	n, err := held.Device.DevT()
	if err == nil && limitsRace != nil {
		limitsRace(held.Device)
	}
	if err == nil {
		err = s.opts.IOLimits.Set(n, v.IOLimits)
	}
	if err != nil {
		return fmt.Errorf("I/O limits of %s on %s: %w", v.Name, dev.Path, err)
	}
	if !v.IOLimits.IsZero() {
		s.log.Info("I/O limits applied", "volume", v.Name, "device", dev.Path, "limits", FormatLimits(v.IOLimits), "cgroup", s.opts.IOLimits.Where())
	}
	return nil
}

// limitsRace, when a test sets it, runs in applyLimitsOver between the
// proof that the device is the volume's and the io.max write.
var limitsRace func(d *loop.Device)

// removeLimits drops the io.max entry of dev, v's own device about to be
// detached (see detachOwn); a failure is logged: the next attach of that
// device number converges it.
func (s *Store) removeLimits(v *Volume, dev *loop.Device) {
	n, err := dev.DevT()
	if err == nil {
		err = s.opts.IOLimits.Remove(n)
	}
	if err != nil {
		s.log.Warn("I/O limits left on a device being detached", "volume", v.Name, "device", dev.Path, "error", err)
	}
}

// restoreLimits puts v's limits back on dev, v's own device that a detach
// left bound (see detachOwn), if it is still v's (applyLimits holds it
// proven so): a deferred detach's device goes at its last close, and its
// number may be another volume's by then, which keeps its own limits. A
// failure is logged: the device stays unlimited until the next attach or
// limit change.
func (s *Store) restoreLimits(v *Volume, dev *loop.Device) {
	if v.IOLimits.IsZero() {
		return
	}
	err := s.applyLimits(v, dev)
	if err != nil && !errors.Is(err, loop.ErrNotAttached) && !errors.Is(err, loop.ErrNotOwned) {
		s.log.Warn("I/O limits not restored on a device still bound", "volume", v.Name, "device", dev.Path, "error", err)
	}
}

// FormatLimits renders limits in the one unit style ("none" for none).
func FormatLimits(l IOLimits) string {
	if l.IsZero() {
		return "none"
	}
	var out string
	add := func(what string, n uint64, size bool) {
		if n == 0 {
			return
		}
		if out != "" {
			out += ", "
		}
		if size {
			out += fmt.Sprintf("%s %s/s", what, FormatSize(int64(n)))
		} else {
			out += fmt.Sprintf("%s %d IOPS", what, n)
		}
	}
	add("read", l.ReadBPS, true)
	add("write", l.WriteBPS, true)
	add("read", l.ReadIOPS, false)
	add("write", l.WriteIOPS, false)
	return out
}

// LimitChange changes some of a volume's I/O limits: a field given (not
// nil) replaces that limit (0: none), the others keep the values the
// volume has when the change is applied, under its lock, so that two
// changes of different limits both take effect, whoever reads first.
type LimitChange struct {
	ReadBPS, WriteBPS, ReadIOPS, WriteIOPS *uint64
}

// LimitsTo is the change that makes all four limits l's (zero: lifts
// every limit).
func LimitsTo(l IOLimits) LimitChange {
	return LimitChange{&l.ReadBPS, &l.WriteBPS, &l.ReadIOPS, &l.WriteIOPS}
}

// IsZero reports whether c changes nothing.
func (c LimitChange) IsZero() bool { return c == LimitChange{} }

// Over returns l with the limits c gives replaced.
func (c LimitChange) Over(l IOLimits) IOLimits {
	for _, f := range []struct{ src, dst *uint64 }{
		{c.ReadBPS, &l.ReadBPS}, {c.WriteBPS, &l.WriteBPS}, {c.ReadIOPS, &l.ReadIOPS}, {c.WriteIOPS, &l.WriteIOPS},
	} {
		if f.src != nil {
			*f.dst = *f.src
		}
	}
	return l
}

// Change is a change of a volume's settings that takes effect live; nil
// (or false, or zero) fields stay as they are.
type Change struct {
	// IOLimits changes the limits it gives, over those the volume has
	// under its lock.
	IOLimits LimitChange
	// DirectIO turns direct I/O on the backing file on or off, on the
	// attached device too (the kernel may refuse it: see Status).
	DirectIO *bool
	// Preallocate makes a thin volume thick: its file is allocated in
	// place. A thick volume does not become thin.
	Preallocate bool
	// Labels are set; an empty value removes the label. The labels the
	// volume then carries meet ValidateLabels.
	Labels map[string]string
}

// Change applies ch to the volume ref, live: validated first (ErrInvalid,
// ErrNotSupported, ErrNoSpace: nothing changed; the limits the volume
// would end with are checked under its lock), then, under the volume's
// lock and with its devices proven its own, the file, the devices and the
// metadata. If a step fails, what was changed on the devices is put back
// and the metadata stays as it was; a file already allocated stays so
// (its data is the same).
func (s *Store) Change(ref string, ch Change) (*Status, error) {
	// The limits given alone: a value beyond the kernel's, or a limit on
	// a host that cannot enforce any, is refused before the lock.
	if err := s.CheckLimits(ch.IOLimits.Over(IOLimits{})); err != nil {
		return nil, fmt.Errorf("change %s: %w", Quote(ref), err)
	}
	var st *Status
	err := s.withVolume(ref, func(v *Volume) error {
		if v.State != StateReady {
			return fmt.Errorf("change %s: state %s: %w", v.Name, v.State, ErrNotReady)
		}
		limits := v.IOLimits
		if !ch.IOLimits.IsZero() {
			limits = ch.IOLimits.Over(v.IOLimits)
			if err := s.CheckLimits(limits); err != nil {
				return fmt.Errorf("change %s: %w", v.Name, err)
			}
		}
		labels := v.Labels
		if len(ch.Labels) > 0 {
			labels = maps.Clone(v.Labels)
			if labels == nil {
				labels = map[string]string{}
			}
			for k, val := range ch.Labels {
				if val == "" {
					delete(labels, k)
				} else {
					labels[k] = val
				}
			}
			if err := ValidateLabels(labels); err != nil {
				return fmt.Errorf("change %s: %w", v.Name, err)
			}
		}
		ids, present := s.backingIDs(v)
		bound, err := s.boundTo(v, ids)
		if err != nil {
			return fmt.Errorf("change %s: %w", v.Name, err)
		}
		ours, foreign := s.devicesOf(v, ids, present, bound)
		if len(foreign) > 0 {
			return s.foreignError("change", v, present, foreign)
		}
		if err := s.orphaned(v, ours); err != nil {
			return fmt.Errorf("change %s: %w", v.Name, err)
		}
		old := *v
		if ch.Preallocate && !v.Preallocate {
			if err := s.thicken(v); err != nil {
				return err
			}
			v.Preallocate = true
		}
		v.IOLimits = limits
		if ch.DirectIO != nil {
			v.DirectIO = *ch.DirectIO
		}
		v.Labels = labels
		if err := s.applyLive(v, ours); err != nil {
			if rerr := s.applyLive(&old, ours); rerr != nil {
				err = errors.Join(err, fmt.Errorf("putting back: %w", rerr))
			}
			return fmt.Errorf("change %s: %w", v.Name, err)
		}
		if err := s.writeMeta(v); err != nil {
			if rerr := s.applyLive(&old, ours); rerr != nil {
				err = errors.Join(err, fmt.Errorf("putting back: %w", rerr))
			}
			return fmt.Errorf("change %s: %w", v.Name, err)
		}
		st = s.status(v, ours, nil)
		return nil
	})
	return st, err
}

// applyLive sets v's direct I/O and limits on its devices (ours).
func (s *Store) applyLive(v *Volume, ours []*loop.Device) error {
	for i, d := range ours {
		if d.DirectIO() != v.DirectIO {
			now, err := loop.SetDirectIO(d.Path, v.owner(d.Backing), v.DirectIO)
			if err != nil {
				return err
			}
			if v.DirectIO && !now.DirectIO() {
				s.log.Warn("direct I/O refused by the kernel, using buffered I/O", "volume", v.Name, "device", d.Path)
			}
			ours[i] = now
		}
		if err := s.applyLimits(v, d); err != nil {
			return err
		}
	}
	return nil
}

// thicken allocates v's whole backing file in place (thin to thick),
// refusing with ErrNoSpace, before allocating anything, what the store's
// filesystem cannot hold (reallocate). The caller holds v's lock.
func (s *Store) thicken(v *Volume) error {
	fd, _, _, err := s.openOwned(v, "make thick")
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if _, _, err := s.reallocate(v, fd); err != nil {
		return fmt.Errorf("make %s thick: %w", v.Name, err)
	}
	return nil
}
