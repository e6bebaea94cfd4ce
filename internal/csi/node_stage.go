package csi

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// NodeStageVolume attaches the volume and, for mount volumes, mounts its
// filesystem at the staging path. It never formats: only CreateVolume
// does. A device that does not hold the volume's own filesystem is
// FailedPrecondition and stays as it is.
func (d *Driver) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	staging := req.GetStagingTargetPath()
	v, release, err := d.begin(nodeRequest{
		id: req.GetVolumeId(), capability: req.GetVolumeCapability(), needCapability: true,
		paths: []nodePath{{field: "staging_target_path", path: staging, required: true}},
	})
	defer release()
	if err != nil {
		return nil, err
	}
	if _, _, _, err := d.stage(ctx, v, req.GetVolumeCapability(), staging); err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// stage converges a volume to staged: attached and, for mount volumes,
// mounted at staging. Every step is idempotent; changed says a step was
// needed (the device was bound or the filesystem mounted by this call).
// uses is what the mount table said of the device where this call found
// the volume staged already, and unknown (its known false) where it
// mounted or looked at no table (block volumes).
func (d *Driver) stage(ctx context.Context, v *volume.Volume, c *csi.VolumeCapability, staging string) (st *volume.Status, uses usesOf, changed bool, err error) {
	// The device is held and proven the volume's while it is probed and
	// mounted by path, so a concurrent detach cannot hand its number to
	// another file in between.
	err = d.store.WithDevice(ctx, v.UUID, func(held *volume.Status, fresh bool) error {
		found, mounted, err := d.stageDevice(ctx, v, c, staging, held)
		st, uses, changed = held, found, fresh || mounted
		return err
	})
	if err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, usesOf{}, false, err
		}
		return nil, usesOf{}, false, toStatus(err)
	}
	return st, uses, changed, nil
}

// stageDevice mounts a mount volume's filesystem at staging unless it is
// there; mounted says it mounted it. uses is the mount table's uses of
// the device where it was there already (see stage).
func (d *Driver) stageDevice(ctx context.Context, v *volume.Volume, c *csi.VolumeCapability, staging string, st *volume.Status) (uses usesOf, mounted bool, err error) {
	if v.Mode == volume.ModeBlock {
		if st.DataDevice == "" {
			return usesOf{}, false, status.Errorf(codes.Internal, "volume %s is attached to %s but the kernel shows no partition to use", v.UUID, st.Device)
		}
		return usesOf{}, false, nil
	}
	uses, err = deviceUses(st.DataDevice)
	if err != nil {
		return usesOf{}, false, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
	}
	if containsPath(uses.fsMounts, staging) {
		return uses, false, nil
	}
	if mp, err := uses.isMountPoint(staging); err != nil {
		return usesOf{}, false, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
	} else if mp {
		return usesOf{}, false, status.Errorf(codes.AlreadyExists, "staging path %s holds a mount of another device than %s of volume %s", staging, st.DataDevice, v.UUID)
	}
	if err := d.store.CheckFilesystem(ctx, v, st.DataDevice); err != nil {
		return usesOf{}, false, err
	}
	flags := c.GetMount().GetMountFlags()
	if v.Labels[LabelDiscard] == "true" && !slices.Contains(flags, "discard") {
		flags = append(slices.Clone(flags), "discard")
	}
	if err := mountFilesystem(st.DataDevice, staging, v.FSType, flags); err != nil {
		return usesOf{}, false, toStatus(fmt.Errorf("volume %s: mount %s (%s) at %s: %w", v.UUID, st.DataDevice, v.FSType, staging, err))
	}
	d.log.Info("volume staged", "volume_id", v.UUID, "name", v.Name, "device", st.DataDevice, "staging_target_path", staging)
	return usesOf{}, true, nil
}

// NodeUnstageVolume unmounts the volume's filesystem from the staging path
// and detaches the volume. Only mounts proven the volume's are unmounted; a
// foreign mount at the staging path stays, and is an error only while the
// volume's filesystem is still mounted beneath it or elsewhere.
func (d *Driver) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	staging := req.GetStagingTargetPath()
	v, release, err := d.begin(nodeRequest{
		id:    req.GetVolumeId(),
		paths: []nodePath{{field: "staging_target_path", path: staging, required: true}},
	})
	defer release()
	if err != nil {
		return nil, err
	}
	st, err := d.store.Status(v.UUID)
	if err != nil {
		return nil, toStatus(err)
	}
	if !st.Attached {
		// No device, so nothing at the staging path can be the volume's.
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if st.State == volume.StateOrphaned {
		// Detach would refuse after the unmount; refuse before it.
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s stays staged: %s", v.UUID, st.Problem)
	}
	uses, err := deviceUses(st.DataDevice)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
	}
	_, foreign, err := d.unmountOwned(staging, uses)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
	}
	if uses, err = deviceUses(st.DataDevice); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
	}
	if all := uses.all(); len(all) > 0 {
		if foreign != nil && containsPath(all, staging) {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s: staging path %s holds %s on top of the volume, which is not the volume's; left mounted",
				v.UUID, staging, describeMount(foreign))
		}
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still published at %v; unpublish it first", v.UUID, all)
	}
	err = d.store.Detach(v.UUID, volume.DetachOptions{})
	switch {
	case err == nil:
	case errors.Is(err, volume.ErrDeferred):
		// Someone still holds the device open; the kernel detaches it at
		// their last close. Nothing is mounted, so it is unstaged.
		d.log.Warn("detach deferred until last close", "volume_id", v.UUID, "error", err)
	default:
		return nil, toStatus(err)
	}
	d.log.Info("volume unstaged", "volume_id", v.UUID, "name", v.Name, "staging_target_path", staging)
	return &csi.NodeUnstageVolumeResponse{}, nil
}
