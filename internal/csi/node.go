package csi

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

func (d *Driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_GET_STORAGE_HEALTH,
	} {
		caps = append(caps, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}},
		})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (d *Driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{
		NodeId:             d.nodeID,
		MaxVolumesPerNode:  d.maxVolumes,
		AccessibleTopology: d.topology(),
	}, nil
}

// NodeStageVolume attaches the volume and, for mount volumes, mounts its
// filesystem at the staging path. It never formats: only CreateVolume
// does. A device that does not hold the volume's own filesystem is
// FailedPrecondition and stays as it is.
func (d *Driver) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id, staging, c := req.GetVolumeId(), req.GetStagingTargetPath(), req.GetVolumeCapability()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case staging == "":
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required")
	case c == nil:
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
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
	if err := checkCapability(v, c); err != nil {
		return nil, err
	}
	if _, err := d.stage(ctx, v, c, staging); err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// stage converges a volume to staged: attached and, for mount volumes,
// mounted at staging. Every step is idempotent.
func (d *Driver) stage(ctx context.Context, v *volume.Volume, c *csi.VolumeCapability, staging string) (*volume.Status, error) {
	// The device is held and proven the volume's while it is formatted and
	// mounted by path, so a concurrent detach cannot hand its number to
	// another file in between.
	var staged *volume.Status
	err := d.store.WithDevice(ctx, v.UUID, func(st *volume.Status) error {
		var err error
		staged, err = d.stageDevice(ctx, v, c, staging, st)
		return err
	})
	if err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, err
		}
		return nil, toStatus(err)
	}
	return staged, nil
}

func (d *Driver) stageDevice(ctx context.Context, v *volume.Volume, c *csi.VolumeCapability, staging string, st *volume.Status) (*volume.Status, error) {
	if v.Mode == volume.ModeBlock {
		if st.DataDevice == "" {
			return nil, status.Errorf(codes.Internal, "volume %s is attached to %s but the kernel shows no partition to use", v.UUID, st.Device)
		}
		return st, nil
	}
	uses, err := deviceUses(st.DataDevice)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
	}
	if containsPath(uses.fsMounts, staging) {
		return st, nil
	}
	if mp, err := isMountPoint(staging); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
	} else if mp {
		return nil, status.Errorf(codes.AlreadyExists, "staging path %s holds a mount of another device than %s of volume %s", staging, st.DataDevice, v.UUID)
	}
	if err := d.store.CheckFilesystem(ctx, v, st.DataDevice); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(staging, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: create staging path: %v", v.UUID, err)
	}
	flags := c.GetMount().GetMountFlags()
	if v.Labels[LabelDiscard] == "true" && !slices.Contains(flags, "discard") {
		flags = append(slices.Clone(flags), "discard")
	}
	if err := d.mounter.Mount(st.DataDevice, staging, v.FSType, flags); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: mount %s (%s) at %s: %v", v.UUID, st.DataDevice, v.FSType, staging, err)
	}
	d.log.Info("volume staged", "volume_id", v.UUID, "name", v.Name, "device", st.DataDevice, "staging_target_path", staging)
	return st, nil
}

// NodeUnstageVolume unmounts the staging path and detaches the volume.
func (d *Driver) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case staging == "":
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required")
	}
	release, err := d.busy.acquire(id)
	if err != nil {
		return nil, err
	}
	defer release()
	if err := d.unmountAll(staging); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	}
	v, err := d.lookup(id)
	if errors.Is(err, volume.ErrNotFound) {
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if err != nil {
		return nil, toStatus(err)
	}
	st, err := d.store.Status(v.UUID)
	if err != nil {
		return nil, toStatus(err)
	}
	if !st.Attached {
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	uses, err := deviceUses(st.DataDevice)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	}
	if all := uses.all(); len(all) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still published at %v; unpublish it first", id, all)
	}
	err = d.store.Detach(ctx, v.UUID)
	switch {
	case err == nil:
	case errors.Is(err, volume.ErrDeferred):
		// Someone still holds the device open; the kernel detaches it at
		// their last close. Nothing is mounted, so it is unstaged.
		d.log.Warn("detach deferred until last close", "volume_id", id, "error", err)
	default:
		return nil, toStatus(err)
	}
	d.log.Info("volume unstaged", "volume_id", id, "name", v.Name, "staging_target_path", staging)
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// unmountAll unmounts path until it is no mount point (mounts may stack).
func (d *Driver) unmountAll(path string) error {
	for range 8 {
		mp, err := isMountPoint(path)
		if err != nil || !mp {
			return err
		}
		if err := d.mounter.Unmount(path); err != nil {
			return fmt.Errorf("unmount %s: %w", path, err)
		}
	}
	return fmt.Errorf("unmount %s: still mounted after 8 unmounts", path)
}

// NodePublishVolume bind-mounts the staged filesystem (or the device node
// of a block volume) at the target path. If a reboot or anything else took
// the device or the staging mount away, it stages the volume again first:
// after a reboot the kubelet may publish without staging.
func (d *Driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id, target, staging, c := req.GetVolumeId(), req.GetTargetPath(), req.GetStagingTargetPath(), req.GetVolumeCapability()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case target == "":
		return nil, status.Error(codes.InvalidArgument, "target_path is required")
	case c == nil:
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	case staging == "":
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required (the plugin stages volumes)")
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
	if err := checkCapability(v, c); err != nil {
		return nil, err
	}
	st, err := d.ensureStaged(ctx, v, c, staging)
	if err != nil {
		return nil, err
	}
	uses, err := deviceUses(st.DataDevice)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
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
	if mp, err := isMountPoint(target); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	} else if mp {
		return nil, status.Errorf(codes.AlreadyExists, "target path %s holds a mount of something else than volume %s", target, id)
	}
	opts := []string{"bind"}
	if req.GetReadonly() {
		opts = append(opts, "ro")
	}
	source := staging
	if v.Mode == volume.ModeBlock {
		source = st.DataDevice
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
		}
		f, err := os.OpenFile(target, os.O_CREATE|os.O_RDONLY|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: create target file: %v", id, err)
		}
		f.Close()
	} else if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: create target path: %v", id, err)
	}
	if err := d.mounter.Mount(source, target, "", opts); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: bind %s at %s: %v", id, source, target, err)
	}
	d.log.Info("volume published", "volume_id", id, "name", v.Name, "target_path", target, "readonly", req.GetReadonly())
	return &csi.NodePublishVolumeResponse{}, nil
}

// ensureStaged returns the volume's status, re-staging it first when its
// device or staging mount is missing.
func (d *Driver) ensureStaged(ctx context.Context, v *volume.Volume, c *csi.VolumeCapability, staging string) (*volume.Status, error) {
	st, err := d.store.Status(v.UUID)
	if err != nil {
		return nil, toStatus(err)
	}
	healthy := st.Attached && st.DataDevice != ""
	if healthy && v.Mode == volume.ModeFilesystem {
		uses, err := deviceUses(st.DataDevice)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
		}
		healthy = containsPath(uses.fsMounts, staging)
	}
	if healthy {
		return st, nil
	}
	d.log.Warn("volume not staged at publish (reboot or manual detach?); staging it again",
		"volume_id", v.UUID, "name", v.Name, "attached", st.Attached, "staging_target_path", staging)
	d.metrics.restaged()
	// A staging path left mounted on a vanished device must go first.
	if v.Mode == volume.ModeFilesystem && !st.Attached {
		if err := d.unmountAll(staging); err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: %v", v.UUID, err)
		}
	}
	return d.stage(ctx, v, c, staging)
}

// NodeUnpublishVolume unmounts the target path and removes it.
func (d *Driver) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case target == "":
		return nil, status.Error(codes.InvalidArgument, "target_path is required")
	}
	release, err := d.busy.acquire(id)
	if err != nil {
		return nil, err
	}
	defer release()
	if err := d.unmountAll(target); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "volume %s: remove target path: %v", id, err)
	}
	d.log.Info("volume unpublished", "volume_id", id, "target_path", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// NodeGetVolumeStats reports bytes and inodes of a mounted volume, or the
// size of a block volume.
func (d *Driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case path == "":
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	}
	v, err := d.lookup(id)
	if err != nil {
		return nil, toStatus(err)
	}
	if _, err := os.Stat(path); err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %s: volume path: %v", id, err)
	}
	st, err := d.store.Status(id)
	if err != nil {
		return nil, toStatus(err)
	}
	if !st.Attached {
		return nil, status.Errorf(codes.NotFound, "volume %s is not attached, so it is not at %s", id, path)
	}
	uses, err := deviceUses(st.DataDevice)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	}
	if v.Mode == volume.ModeBlock {
		if !containsPath(uses.nodeBind, path) && !samePath(path, st.DataDevice) {
			return nil, status.Errorf(codes.NotFound, "volume %s is not published at %s", id, path)
		}
		if st.DataDeviceBytes == 0 {
			return nil, status.Errorf(codes.Internal, "volume %s: size of %s unknown", id, st.DataDevice)
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
			{Unit: csi.VolumeUsage_BYTES, Total: st.DataDeviceBytes},
		}}, nil
	}
	if !containsPath(uses.fsMounts, path) {
		return nil, status.Errorf(codes.NotFound, "volume %s is not mounted at %s", id, path)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(path, &sfs); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: statfs %s: %v", id, path, err)
	}
	bs := sfs.Bsize
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(sfs.Blocks) * bs, Available: int64(sfs.Bavail) * bs, Used: int64(sfs.Blocks-sfs.Bfree) * bs},
		{Unit: csi.VolumeUsage_INODES, Total: int64(sfs.Files), Available: int64(sfs.Ffree), Used: int64(sfs.Files - sfs.Ffree)},
	}}, nil
}

// NodeExpandVolume brings the loop device and the filesystem up to the
// size of the backing file grown by ControllerExpandVolume.
func (d *Driver) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case path == "":
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
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
	if c := req.GetVolumeCapability(); c != nil {
		if err := checkCapability(v, c); err != nil {
			return nil, err
		}
	}
	if _, err := os.Stat(path); err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %s: volume path: %v", id, err)
	}
	size := v.SizeBytes
	if lim := req.GetCapacityRange().GetLimitBytes(); lim > 0 && size > lim {
		return nil, status.Errorf(codes.OutOfRange, "volume %s is %d bytes, beyond the limit of %d; volumes do not shrink", id, size, lim)
	}
	if want := req.GetCapacityRange().GetRequiredBytes(); want > size {
		// The controller step did not reach this node's store (each node's
		// resizer sees every claim of the driver): grow the whole way here.
		nv, err := d.store.Expand(ctx, id, want, volume.ExpandOptions{})
		if err != nil {
			return nil, toStatus(err)
		}
		size = nv.SizeBytes
	} else if err := d.store.GrowFilesystem(ctx, id); err != nil {
		return nil, toStatus(err)
	}
	d.log.Info("volume expanded on node", "volume_id", id, "name", v.Name, "size", size)
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// NodeGetVolumeHealth reports a missing backing file (data loss) and, for
// the paths given, a missing device or mount (inaccessible).
func (d *Driver) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	v, err := d.lookup(id)
	if err != nil {
		return nil, toStatus(err)
	}
	st, err := d.store.Status(id)
	if err != nil {
		return nil, toStatus(err)
	}
	health := &csi.VolumeHealth{VolumeId: id}
	add := func(t csi.VolumeHealthErrorType, reason, msg string) {
		health.HealthStatuses = append(health.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{Status: t, Reason: reason, Message: msg})
	}
	if st.FileMissing {
		add(csi.VolumeHealthErrorType_DATA_LOSS, "BackingFileMissing", fmt.Sprintf("backing file %s of volume %s is gone", v.BackingFile, id))
	}
	var paths []string
	for _, p := range []string{req.GetStagingTargetPath(), req.GetVolumePublishPath()} {
		if p != "" {
			paths = append(paths, p)
		}
	}
	switch {
	case len(paths) == 0:
	case !st.Attached:
		add(csi.VolumeHealthErrorType_INACCESSIBLE, "DeviceMissing", fmt.Sprintf("volume %s has no loop device (reboot or manual detach?)", id))
	default:
		uses, err := deviceUses(st.DataDevice)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
		}
		mounts := uses.fsMounts
		if v.Mode == volume.ModeBlock {
			mounts = uses.nodeBind
			if req.GetStagingTargetPath() != "" {
				mounts = append(mounts, req.GetStagingTargetPath()) // block staging is the attach only
			}
		}
		for _, p := range paths {
			if !containsPath(mounts, p) {
				add(csi.VolumeHealthErrorType_INACCESSIBLE, "NotMounted", fmt.Sprintf("volume %s is not mounted at %s", id, p))
				break
			}
		}
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: health}, nil
}

// NodeGetStorageHealth reports the store and loop support of this node.
func (d *Driver) NodeGetStorageHealth(ctx context.Context, req *csi.NodeGetStorageHealthRequest) (*csi.NodeGetStorageHealthResponse, error) {
	resp := &csi.NodeGetStorageHealthResponse{}
	if err := d.healthy(); err != nil {
		resp.BackendHealth = append(resp.BackendHealth, &csi.NodeGetStorageHealthResponse_StorageBackendHealth{
			Status: csi.StorageHealthErrorType_STORAGE_UNREACHABLE, Reason: "StoreUnavailable", Message: err.Error(),
		})
		return resp, nil
	}
	sp, err := d.store.Space()
	if err != nil {
		return nil, toStatus(err)
	}
	if sp.CommittedBytes > sp.FreeBytes+sp.AllocatedBytes {
		resp.BackendHealth = append(resp.BackendHealth, &csi.NodeGetStorageHealthResponse_StorageBackendHealth{
			Status: csi.StorageHealthErrorType_STORAGE_DEGRADED, Reason: "Overcommitted",
			Message: fmt.Sprintf("volumes promise %s but the store can give them %s; writes may fail with ENOSPC",
				volume.FormatSize(sp.CommittedBytes), volume.FormatSize(sp.FreeBytes+sp.AllocatedBytes)),
		})
	}
	return resp, nil
}
