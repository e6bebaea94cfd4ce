package csi

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// NodePublishVolume bind-mounts the staged filesystem (or the device node
// of a block volume) at the target path. If a reboot or anything else took
// the device or the staging mount away, it stages the volume again first:
// after a reboot the kubelet may publish without staging.
func (d *Driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	target, staging, c := req.GetTargetPath(), req.GetStagingTargetPath(), req.GetVolumeCapability()
	v, release, err := d.begin(nodeRequest{
		id: req.GetVolumeId(), capability: c, needCapability: true,
		paths: []nodePath{
			{field: "target_path", path: target, required: true},
			{field: "staging_target_path (the plugin stages volumes)", path: staging, required: true},
		},
	})
	defer release()
	if err != nil {
		return nil, err
	}
	id := v.UUID
	st, uses, err := d.ensureStaged(ctx, v, c, staging)
	if err != nil {
		return nil, err
	}
	if !uses.known {
		if uses, err = deviceUses(st.DataDevice); err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
		}
	}
	published := uses.nodeBind
	if v.Mode == volume.ModeFilesystem {
		published = slices.DeleteFunc(slices.Clone(uses.fsMounts), func(p string) bool { return samePath(p, staging) })
	}
	if containsPath(published, target) {
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if c.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER && len(published) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is single-writer and already published at %v", id, published)
	}
	if mp, err := uses.isMountPoint(target); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	} else if mp {
		return nil, status.Errorf(codes.AlreadyExists, "target path %s holds a mount of something else than volume %s", target, id)
	}
	if err := publishAt(v, st.DataDevice, staging, target, req.GetReadonly()); err != nil {
		return nil, toStatus(fmt.Errorf("volume %s: %w", id, err))
	}
	d.log.Info("volume published", "volume_id", id, "name", v.Name, "target_path", target, "readonly", req.GetReadonly())
	return &csi.NodePublishVolumeResponse{}, nil
}

// ensureStaged returns the volume's status, staging it again first when
// its device or staging mount is missing: stage is idempotent, and looks
// at the volume's own device only, whatever the number bound. uses is
// stage's (unknown where it mounted).
func (d *Driver) ensureStaged(ctx context.Context, v *volume.Volume, c *csi.VolumeCapability, staging string) (*volume.Status, usesOf, error) {
	st, uses, restaged, err := d.stage(ctx, v, c, staging)
	if err != nil {
		return nil, usesOf{}, err
	}
	if restaged {
		d.log.Warn("volume was not staged at publish (reboot or manual detach?); staged it again",
			"volume_id", v.UUID, "name", v.Name, "staging_target_path", staging)
		d.metrics.restaged()
	}
	return st, uses, nil
}

// NodeUnpublishVolume unmounts the volume from the target path and removes
// the path. Only mounts proven the volume's are unmounted, and the path is
// removed only where one was: a foreign mount stays, and is an error only
// while the volume is still mounted beneath it.
func (d *Driver) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	target := req.GetTargetPath()
	v, release, err := d.begin(nodeRequest{
		id:    req.GetVolumeId(),
		paths: []nodePath{{field: "target_path", path: target, required: true}},
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
		// No device, so nothing at the target path can be the volume's.
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	uses, err := deviceUses(st.DataDevice)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
	}
	unmounted, foreign, err := d.unmountOwned(target, uses)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
	}
	if foreign != nil {
		if uses, err = deviceUses(st.DataDevice); err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
		}
		if containsPath(uses.all(), target) {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s: target path %s holds %s on top of the volume, which is not the volume's; left mounted",
				v.UUID, target, describeMount(foreign))
		}
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	if unmounted > 0 {
		if err := removeTarget(target); err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
		}
	}
	d.log.Info("volume unpublished", "volume_id", v.UUID, "target_path", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// publishAt binds the volume onto target, read-only if readOnly: its
// device node dev (a block volume, onto a regular file made at target)
// or its filesystem at staging (onto a directory made at target). Both
// paths are walked once, without following links (openNodePath), and the
// bind goes from fd to fd (bindMount): what is bound and where is what
// the walks found, and staging must be on dev.
func publishAt(v *volume.Volume, dev, staging, target string, readOnly bool) error {
	var source int
	var err error
	end := makeDir
	if v.Mode == volume.ModeBlock {
		source, err = openDevice(dev)
		end = makeFile
	} else {
		source, err = openOn(staging, dev)
	}
	if err != nil {
		return err
	}
	defer unix.Close(source)
	at, err := openNodePath(target, end)
	if err != nil {
		return fmt.Errorf("target path: %w", err)
	}
	defer unix.Close(at)
	return bindMount(source, at, readOnly)
}

// removeTarget removes what a volume was bound onto at target, as publish
// made it: an empty directory or an empty file. Anything else stays. The
// name is looked at and removed in its directory as the no-follow walk
// opened it (openNodeParent).
func removeTarget(target string) error {
	parent, base, err := openNodeParent(target)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("remove target path: %w", err)
	}
	defer unix.Close(parent)
	var st unix.Stat_t
	err = unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	switch {
	case errors.Is(err, unix.ENOENT):
		return nil
	case err != nil:
		return fmt.Errorf("remove target path %s: %w", target, err)
	case st.Mode&unix.S_IFMT == unix.S_IFDIR:
		err = unix.Unlinkat(parent, base, unix.AT_REMOVEDIR) // only if empty
	case st.Mode&unix.S_IFMT == unix.S_IFREG && st.Size == 0:
		err = unix.Unlinkat(parent, base, 0)
	default:
		return nil
	}
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove target path %s: %w", target, err)
	}
	return nil
}
