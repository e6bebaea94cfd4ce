package csi

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os/exec"
	"slices"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
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
			return status.Errorf(codes.InvalidArgument, "parameter %q cannot be changed on a volume (mutable: %s)", k, strings.Join(mutableParams, ", "))
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

// parseLimit parses the limit parameter k into l; the rules are volume's.
func parseLimit(k, v string, l *volume.IOLimits) error {
	var err error
	switch k {
	case ParamReadIOPS:
		l.ReadIOPS, err = volume.ParseIOPS(v)
	case ParamWriteIOPS:
		l.WriteIOPS, err = volume.ParseIOPS(v)
	case ParamReadBPS:
		l.ReadBPS, err = volume.ParseBPS(v)
	case ParamWriteBPS:
		l.WriteBPS, err = volume.ParseBPS(v)
	}
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "parameter %s=%q: %v", k, v, err)
	}
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
// a volume, live: I/O limits, direct I/O, discard (remounting a staged
// filesystem) and thin to thick. Parameters not named stay as they are;
// any other parameter is refused with InvalidArgument naming it, before
// anything changes.
func (d *Driver) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (*csi.ControllerModifyVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	params := req.GetMutableParameters()
	if err := checkMutable(params); err != nil {
		return nil, err
	}
	release, err := d.busy.acquire(id)
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
	st, err := d.store.Change(id, ch)
	if err != nil {
		return nil, toStatus(err)
	}
	if discard != nil && len(st.MountPoints) > 0 {
		if err := remountDiscard(ctx, st.MountPoints[0], *discard); err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: %v (the setting is recorded and applies at the next stage)", id, err)
		}
	}
	d.log.Info("volume modified", "volume_id", id, "name", v.Name, "parameters", params)
	return &csi.ControllerModifyVolumeResponse{}, nil
}

// changeFor maps mutable parameters onto a change of v; discard, if not
// nil, is the discard mount option a staged filesystem must have.
func changeFor(v *volume.Volume, params map[string]string) (volume.Change, *bool, error) {
	ch := volume.Change{Labels: map[string]string{}}
	limits := v.IOLimits
	thick := v.Preallocate
	discard := v.Labels[LabelDiscard] == "true"
	var discardChanged, discardGiven bool
	for _, k := range slices.Sorted(maps.Keys(params)) {
		val := params[k]
		switch k {
		case ParamReadIOPS, ParamWriteIOPS, ParamReadBPS, ParamWriteBPS:
			if err := parseLimit(k, val, &limits); err != nil {
				return ch, nil, err
			}
			ch.IOLimits = &limits
		case ParamDirectIO:
			b, err := strconv.ParseBool(val)
			if err != nil {
				return ch, nil, status.Errorf(codes.InvalidArgument, "parameter %s=%q: want true or false", k, val)
			}
			ch.DirectIO = &b
		case ParamDiscard:
			b, err := strconv.ParseBool(val)
			if err != nil {
				return ch, nil, status.Errorf(codes.InvalidArgument, "parameter %s=%q: want true or false", k, val)
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
				return ch, nil, status.Errorf(codes.InvalidArgument, "parameter %s=%q: want thin or thick", k, val)
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
	// Remounted also when the label says so already: a retry after a
	// failed remount must not find nothing to do.
	return ch, &discard, nil
}

// remountDiscard switches online discard of the filesystem mounted at mp
// (a superblock option: one remount serves every mount of it) and checks
// that the kernel took it.
func remountDiscard(ctx context.Context, mp string, on bool) error {
	opt := "nodiscard"
	if on {
		opt = "discard"
	}
	if out, err := exec.CommandContext(ctx, "mount", "-o", "remount,"+opt, mp).CombinedOutput(); err != nil {
		return fmt.Errorf("remount %s with %s: %w: %s", mp, opt, err, strings.TrimSpace(string(out)))
	}
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(mp))
	if err != nil || len(infos) == 0 {
		return fmt.Errorf("remount %s with %s: read the mount table: %w", mp, opt, errors.Join(err, errors.New("no such mount")))
	}
	has := slices.Contains(strings.Split(infos[0].VFSOptions, ","), "discard")
	if has != on {
		return fmt.Errorf("remount %s with %s: the filesystem kept %q", mp, opt, infos[0].VFSOptions)
	}
	return nil
}
