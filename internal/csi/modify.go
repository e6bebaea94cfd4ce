package csi

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// mutableParams are the parameters a VolumeAttributesClass may set, at
// CreateVolume and later by ControllerModifyVolume: what changes on a live
// volume. Every other parameter is fixed at create.
var mutableParams = []string{
	ParamReadIOPS, ParamWriteIOPS, ParamReadBPS, ParamWriteBPS,
	ParamDirectIO, ParamDiscard, ParamProvisioning,
}

// checkMutable refuses, naming it, a parameter a VolumeAttributesClass
// cannot set.
func checkMutable(params map[string]string) error {
	for _, k := range slices.Sorted(maps.Keys(params)) {
		if !slices.Contains(mutableParams, k) {
			return status.Errorf(codes.InvalidArgument, "parameter %s cannot be changed on a volume (mutable: %s)", volume.Quote(k), strings.Join(mutableParams, ", "))
		}
	}
	return nil
}

// withMutable returns the StorageClass parameters with a
// VolumeAttributesClass's (mutable) parameters over them.
func withMutable(params, mutable map[string]string) (map[string]string, error) {
	if len(mutable) == 0 {
		return params, nil
	}
	if err := checkMutable(mutable); err != nil {
		return nil, err
	}
	out := maps.Clone(params)
	if out == nil {
		out = map[string]string{}
	}
	maps.Copy(out, mutable)
	return out, nil
}

// parseLimit parses the limit parameter k into a change of that limit
// in ch; the rules are volume's.
func parseLimit(k, v string, ch *volume.LimitChange) error {
	var dst **uint64
	parse := volume.ParseIOPS
	switch k {
	case ParamReadIOPS:
		dst = &ch.ReadIOPS
	case ParamWriteIOPS:
		dst = &ch.WriteIOPS
	case ParamReadBPS:
		dst, parse = &ch.ReadBPS, volume.ParseBPS
	case ParamWriteBPS:
		dst, parse = &ch.WriteBPS, volume.ParseBPS
	default:
		return nil
	}
	n, err := parse(v)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "parameter %s: %v", k, err)
	}
	*dst = &n
	return nil
}

// checkDiscard is the rule for discard=true: thin filesystem volumes only.
func checkDiscard(discard, thick bool, mode volume.Mode) error {
	if discard && (thick || mode == volume.ModeBlock) {
		return status.Errorf(codes.InvalidArgument, "parameter %s=true applies to thin filesystem volumes only (thick volumes keep their blocks; block volumes are not mounted)", ParamDiscard)
	}
	return nil
}

// ControllerModifyVolume applies a VolumeAttributesClass's parameters to
// a volume, live: I/O limits, direct I/O, discard (on a staged
// filesystem, setDiscard) and thin to thick. Parameters not named stay as
// they are; any other parameter is refused with InvalidArgument naming
// it, before anything changes. What is recorded is what took effect: a
// change refused anywhere leaves the record and the filesystem as they
// were. A discard change while a snapshot holds the filesystem frozen is
// Aborted (errFrozen): the CO retries, and it works once thawed.
func (d *Driver) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (*csi.ControllerModifyVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	params := req.GetMutableParameters()
	if err := checkMutable(params); err != nil {
		return nil, err
	}
	release, err := d.busy.acquire(volumeKey(id))
	if err != nil {
		return nil, err
	}
	defer release()
	v, err := d.lookup(id)
	if err != nil {
		return nil, toStatus(err)
	}
	if err := checkManaged(v, "change it with `sparsevol limit`"); err != nil {
		return nil, err
	}
	ch, discard, err := changeFor(v, params)
	if err != nil {
		return nil, err
	}
	// Checked again, over the limits the volume has then, under its lock
	// (Store.Change): a `sparsevol limit` may change another meanwhile.
	if !ch.IOLimits.IsZero() {
		if err := d.store.CheckLimits(ch.IOLimits.Over(v.IOLimits)); err != nil {
			return nil, toStatus(fmt.Errorf("modify volume %s: %w", id, err))
		}
	}
	// The filesystem first, the record after: a setting the filesystem
	// does not take is not recorded, and a record that fails puts the
	// filesystem back.
	var putBack func() error
	if discard != nil {
		if putBack, err = d.setDiscard(id, *discard); err != nil {
			return nil, toStatus(fmt.Errorf("modify volume %s: %w", id, err))
		}
	}
	if _, err := d.store.Change(id, ch); err != nil {
		if putBack != nil {
			if perr := putBack(); perr != nil {
				err = errors.Join(err, fmt.Errorf("putting discard back: %w", perr))
			}
		}
		return nil, toStatus(err)
	}
	d.log.Info("volume modified", "volume_id", id, "name", v.Name, "parameters", params)
	return &csi.ControllerModifyVolumeResponse{}, nil
}

// changeFor maps mutable parameters onto a change of v; discard, if not
// nil, is the discard mount option a staged filesystem must have.
func changeFor(v *volume.Volume, params map[string]string) (volume.Change, *bool, error) {
	ch := volume.Change{Labels: map[string]string{}}
	thick := v.Preallocate
	discard := v.Labels[LabelDiscard] == "true"
	var discardChanged, discardGiven bool
	for _, k := range slices.Sorted(maps.Keys(params)) {
		val := params[k]
		switch k {
		case ParamReadIOPS, ParamWriteIOPS, ParamReadBPS, ParamWriteBPS:
			if err := parseLimit(k, val, &ch.IOLimits); err != nil {
				return ch, nil, err
			}
		case ParamDirectIO:
			b, err := strconv.ParseBool(val)
			if err != nil {
				return ch, nil, status.Errorf(codes.InvalidArgument, "parameter %s=%s: want true or false", k, volume.Quote(val))
			}
			ch.DirectIO = &b
		case ParamDiscard:
			b, err := strconv.ParseBool(val)
			if err != nil {
				return ch, nil, status.Errorf(codes.InvalidArgument, "parameter %s=%s: want true or false", k, volume.Quote(val))
			}
			discardChanged, discardGiven = b != discard, true
			discard = b
		case ParamProvisioning:
			switch val {
			case "thick":
				thick, ch.Preallocate = true, !v.Preallocate
			case "thin", "":
				if v.Preallocate {
					return ch, nil, status.Errorf(codes.InvalidArgument, "parameter %s=%s: volume %s is thick, and a thick volume does not become thin", k, val, v.UUID)
				}
			default:
				return ch, nil, status.Errorf(codes.InvalidArgument, "parameter %s=%s: want thin or thick", k, volume.Quote(val))
			}
		}
	}
	if err := checkDiscard(discard, thick, v.Mode); err != nil {
		return ch, nil, err
	}
	if ch.Preallocate {
		ch.Labels[LabelProvisioning] = provisioning(true)
	}
	if discardChanged {
		ch.Labels[LabelDiscard] = ""
		if discard {
			ch.Labels[LabelDiscard] = "true"
		}
	}
	if !discardGiven {
		return ch, nil, nil
	}
	// Applied also when the label says so already: the filesystem's own
	// setting decides whether there is anything to do (setDiscard).
	return ch, &discard, nil
}

// setDiscard switches online discard of volume id's filesystem, if it is
// mounted, and returns how to put it back (nil: nothing changed). Discard
// is a superblock option: one reconfigure through any mount of the
// filesystem serves them all. It goes through an fd of a mount proven to
// reach the volume's filesystem (openMounted), by fspick and fsconfig on
// that fd, so what is mounted over a mount point of the volume is never
// reconfigured. A filesystem that keeps its setting on a live mount (XFS)
// is volume.ErrBusy, a frozen one (a snapshot in progress) errFrozen,
// each with nothing changed. The caller holds the volume's in-flight
// guard.
func (d *Driver) setDiscard(id string, on bool) (putBack func() error, err error) {
	st, err := d.store.Status(id)
	if err != nil {
		return nil, err
	}
	if !st.Attached || len(st.MountPoints) == 0 {
		return nil, nil
	}
	fd, mp, err := openMounted(st)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	was, err := discardOf(fd)
	if err != nil || was == on {
		return nil, err
	}
	if err := reconfigureDiscard(fd, on); err != nil {
		return nil, fmt.Errorf("discard=%t through %s: %w", on, mp, err)
	}
	now, err := discardOf(fd)
	if err == nil && now != on {
		err = fmt.Errorf("the filesystem keeps its setting while mounted (XFS does); change it while the volume is not staged, the next stage mounts it so: %w", volume.ErrBusy)
	}
	if err != nil {
		if perr := reconfigureDiscard(fd, was); perr != nil {
			err = errors.Join(err, fmt.Errorf("putting it back: %w", perr))
		}
		return nil, fmt.Errorf("discard=%t through %s: %w", on, mp, err)
	}
	return func() error { _, err := d.setDiscard(id, was); return err }, nil
}

// openMounted opens, by openOn, the first of st's mount points (the mount
// table's, for its data device) at which the volume's filesystem is on
// top: its own mount or a bind of it. None being so (each covered by
// another mount, or swapped) is volume.ErrUnsafe, naming what each was.
// The caller closes the fd.
func openMounted(st *volume.Status) (fd int, mountPoint string, err error) {
	var why []string
	for _, mp := range st.MountPoints {
		fd, err := openOn(mp, st.DataDevice)
		if err == nil {
			return fd, mp, nil
		}
		why = append(why, err.Error())
	}
	return -1, "", fmt.Errorf("discard: its filesystem is not on top at any of its mount points (%s); unmount what is mounted over them: %w",
		strings.Join(why, "; "), volume.ErrUnsafe)
}

// errFrozen: the volume's filesystem is frozen (FIFREEZE), which a
// snapshot of the volume holds while it copies, and the kernel refused to
// reconfigure it; nothing was changed. It is over once the filesystem is
// thawed: toStatus makes it Aborted, which the CO retries.
var errFrozen = errors.New("its filesystem is frozen, as a snapshot of the volume in progress holds it (or someone's fsfreeze --freeze); nothing was changed: retry once the snapshot is done and the filesystem thawed")

// reconfigureDiscard sets the superblock option discard (or nodiscard) of
// the filesystem fd is at the root of a mount of (fspick), through a
// filesystem context of its own: no path is looked up, no process run.
// A frozen filesystem, which the kernel refuses to reconfigure (EBUSY:
// a change of a flag other than ro is refused only so), is errFrozen,
// with nothing changed. The caller owns fd.
func reconfigureDiscard(fd int, on bool) error {
	opt := "nodiscard"
	if on {
		opt = "discard"
	}
	fc, err := unix.Fspick(fd, "", unix.FSPICK_EMPTY_PATH|unix.FSPICK_CLOEXEC)
	if err != nil {
		return fmt.Errorf("fspick: %w", err)
	}
	defer unix.Close(fc)
	if err := unix.FsconfigSetFlag(fc, opt); err != nil {
		return fmt.Errorf("fsconfig %s: %w", opt, err)
	}
	err = unix.FsconfigReconfigure(fc)
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("fsconfig reconfigure with %s: %w: %w", opt, err, errFrozen)
	}
	if err != nil {
		return fmt.Errorf("fsconfig reconfigure with %s: %w", opt, err)
	}
	return nil
}

// discardOf reports whether the filesystem fd is on has online discard, a
// superblock option: the mount table shows it on each of its mounts.
func discardOf(fd int) (bool, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return false, fmt.Errorf("fstat: %w", err)
	}
	n := devNumOf(st.Dev)
	infos, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) { return !n.of(m), false })
	if err != nil || len(infos) == 0 {
		return false, fmt.Errorf("read the mount table for %d:%d: %w", n.major, n.minor, errors.Join(err, errors.New("no such mount")))
	}
	return slices.Contains(strings.Split(infos[0].VFSOptions, ","), "discard"), nil
}
