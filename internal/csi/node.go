package csi

import (
	"context"
	"fmt"
	"os"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// NodeGetCapabilities advertises the node RPCs implemented.
func (d *Driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: capabilities([]csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_GET_STORAGE_HEALTH,
	}, func(t csi.NodeServiceCapability_RPC_Type) *csi.NodeServiceCapability {
		return &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}}}
	})}, nil
}

func (d *Driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{
		NodeId:             d.nodeID,
		MaxVolumesPerNode:  d.maxVolumes,
		AccessibleTopology: d.topology(),
	}, nil
}

// NodeGetVolumeStats reports bytes and inodes of a mounted volume, or the
// size of a block volume, at volume_path (volumeAt).
func (d *Driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	path := req.GetVolumePath()
	v, release, err := d.begin(nodeRequest{
		id: req.GetVolumeId(), readOnly: true,
		paths: []nodePath{
			{field: "volume_path", path: path, required: true},
			{field: "staging_target_path", path: req.GetStagingTargetPath()},
		},
	})
	defer release()
	if err != nil {
		return nil, err
	}
	st, err := d.volumeAt(v, path)
	if err != nil {
		return nil, err
	}
	id := v.UUID
	if v.Mode == volume.ModeBlock {
		if st.DataDeviceBytes == 0 {
			return nil, status.Errorf(codes.Internal, "volume %s: size of %s unknown", id, st.DataDevice)
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
			{Unit: csi.VolumeUsage_BYTES, Total: st.DataDeviceBytes},
		}}, nil
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

// volumeAt is the rule for a volume_path: what is mounted there (the top
// of the mounts stacked at it) is v's filesystem, or for a block volume a
// bind of its device node (usesOf). path has passed checkNodePath, so it
// is spelled as the mount table spells it. It returns v's status; a path
// where v is not (nothing mounted, something else mounted over it, v not
// attached) is NotFound. Nothing at path is opened.
func (d *Driver) volumeAt(v *volume.Volume, path string) (*volume.Status, error) {
	id := v.UUID
	if _, err := os.Lstat(path); err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %s: volume path: %v", id, err)
	}
	st, err := d.store.Status(id)
	if err != nil {
		return nil, toStatus(err)
	}
	if !st.Attached {
		return nil, status.Errorf(codes.NotFound, "volume %s is not attached, so it is not at %s; stage and publish it first", id, path)
	}
	uses, err := deviceUses(st.DataDevice)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	}
	top, ok := topMountIn(uses.table, path)
	switch {
	case !ok:
		return nil, status.Errorf(codes.NotFound, "volume %s is not at %s: nothing is mounted there; name the path it is published at", id, path)
	case v.Mode == volume.ModeBlock && !uses.isNodeBind(top),
		v.Mode != volume.ModeBlock && !uses.fs.of(top):
		return nil, status.Errorf(codes.NotFound, "volume %s is not at %s: %s is mounted there; name the path it is published at", id, path, describeMount(top))
	}
	return st, nil
}

// NodeExpandVolume brings the loop device and the filesystem up to the
// size of the backing file grown by ControllerExpandVolume, for a volume
// the driver created (checkManaged) and at volume_path (volumeAt). A
// capacity range no size can meet (checkCapacityRange) is
// InvalidArgument.
func (d *Driver) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	if err := checkCapacityRange(req.GetCapacityRange()); err != nil {
		return nil, err
	}
	path := req.GetVolumePath()
	v, release, err := d.begin(nodeRequest{
		id: req.GetVolumeId(), capability: req.GetVolumeCapability(),
		paths: []nodePath{
			{field: "volume_path", path: path, required: true},
			{field: "staging_target_path", path: req.GetStagingTargetPath()},
		},
	})
	defer release()
	if err != nil {
		return nil, err
	}
	if err := checkManaged(v, "grow it with `sparsevol expand`"); err != nil {
		return nil, err
	}
	if _, err := d.volumeAt(v, path); err != nil {
		return nil, err
	}
	id := v.UUID
	size := v.SizeBytes
	if lim := req.GetCapacityRange().GetLimitBytes(); lim > 0 && size > lim {
		return nil, status.Errorf(codes.OutOfRange, "volume %s is %d bytes, beyond the limit of %d; volumes do not shrink", id, size, lim)
	}
	if want := req.GetCapacityRange().GetRequiredBytes(); want > size {
		// The controller step did not reach this node's store (each node's
		// resizer sees every claim of the driver): grow the whole way here.
		target, err := expandSize(want, req.GetCapacityRange())
		if err != nil {
			return nil, err
		}
		nv, err := d.store.Expand(ctx, id, target, volume.ExpandOptions{})
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
// the paths given, a missing device or a path the volume is not at
// (volumeAt; a block volume's staging path is its attach alone), as
// inaccessible.
func (d *Driver) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	v, release, err := d.begin(nodeRequest{
		id: req.GetVolumeId(), readOnly: true,
		paths: []nodePath{
			{field: "staging_target_path", path: req.GetStagingTargetPath()},
			{field: "volume_publish_path", path: req.GetVolumePublishPath()},
		},
	})
	defer release()
	if err != nil {
		return nil, err
	}
	id := v.UUID
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
	staging, publish := req.GetStagingTargetPath(), req.GetVolumePublishPath()
	var at []string // the paths the volume must be at
	if staging != "" && v.Mode != volume.ModeBlock {
		at = append(at, staging)
	}
	if publish != "" {
		at = append(at, publish)
	}
	switch {
	case staging == "" && publish == "":
	case !st.Attached:
		add(csi.VolumeHealthErrorType_INACCESSIBLE, "DeviceMissing", fmt.Sprintf("volume %s has no loop device (reboot or manual detach?)", id))
	default:
		for _, p := range at {
			if _, err := d.volumeAt(v, p); status.Code(err) == codes.NotFound {
				add(csi.VolumeHealthErrorType_INACCESSIBLE, "NotMounted", status.Convert(err).Message())
				break
			} else if err != nil {
				return nil, err
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
