package csi

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// A group snapshot is the set of the store's snapshots that carry the same
// group (volume.Snapshot.Group, the group's name): the node engine freezes
// every member volume, copies them all and thaws them, so the members are
// consistent with each other. The group is the CSI group snapshot id.
// Members are ordinary snapshots: a volume can be restored from each.

// GroupControllerGetCapabilities advertises group snapshots.
func (d *Driver) GroupControllerGetCapabilities(context.Context, *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	return &csi.GroupControllerGetCapabilitiesResponse{Capabilities: capabilities([]csi.GroupControllerServiceCapability_RPC_Type{
		csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT,
	}, func(t csi.GroupControllerServiceCapability_RPC_Type) *csi.GroupControllerServiceCapability {
		return &csi.GroupControllerServiceCapability{Type: &csi.GroupControllerServiceCapability_Rpc{Rpc: &csi.GroupControllerServiceCapability_RPC{Type: t}}}
	})}, nil
}

// groupMembers returns the driver's snapshots of group id, in UUID order;
// none is ErrNotFound.
func (d *Driver) groupMembers(ctx context.Context, id string) ([]*volume.Snapshot, error) {
	if volume.ValidateName(id) != nil {
		return nil, status.Errorf(codes.NotFound, "group snapshot id %s is not one this driver issues", volume.Quote(id))
	}
	all, err := d.store.ListSnapshots(ctx)
	if err != nil {
		return nil, toStatus(err)
	}
	var members []*volume.Snapshot
	for _, s := range all {
		if s.Group == id && managedSnapshot(s) {
			members = append(members, s)
		}
	}
	if len(members) == 0 {
		return nil, status.Errorf(codes.NotFound, "group snapshot %s not found", id)
	}
	slices.SortFunc(members, func(a, b *volume.Snapshot) int { return strings.Compare(a.UUID, b.UUID) })
	return members, nil
}

// checkMemberIDs compares the snapshot ids a request names (if any) with
// the group's members.
func checkMemberIDs(id string, members []*volume.Snapshot, want []string) error {
	if len(want) == 0 {
		return nil
	}
	have := make([]string, len(members))
	for i, s := range members {
		have[i] = s.UUID
	}
	want = slices.Clone(want)
	slices.Sort(want)
	if !slices.Equal(have, want) {
		return status.Errorf(codes.InvalidArgument, "snapshot_ids %s are not the members %v of group snapshot %s; name them all, or none", quoteList(want), have, id)
	}
	return nil
}

func (d *Driver) csiGroupSnapshot(id string, members []*volume.Snapshot) *csi.VolumeGroupSnapshot {
	g := &csi.VolumeGroupSnapshot{GroupSnapshotId: id, ReadyToUse: true}
	var created time.Time
	for _, s := range members {
		g.Snapshots = append(g.Snapshots, d.csiSnapshot(s))
		g.ReadyToUse = g.ReadyToUse && s.ReadyToUse
		if created.IsZero() || s.CreatedAt.Before(created) {
			created = s.CreatedAt
		}
	}
	g.CreationTime = timestamppb.New(created)
	return g
}

// CreateVolumeGroupSnapshot snapshots volumes of this node together,
// idempotent by name: the same name of the same volumes returns the group
// made before, of other volumes AlreadyExists.
func (d *Driver) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	name, ids := req.GetName(), req.GetSourceVolumeIds()
	if name == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	if err := volume.ValidateName(name); err != nil {
		return nil, toStatus(err)
	}
	if len(ids) == 0 {
		return nil, status.Error(codes.InvalidArgument, "source_volume_ids are required")
	}
	seen := map[string]bool{}
	for _, id := range ids {
		if id == "" {
			return nil, status.Error(codes.InvalidArgument, "source_volume_ids holds an empty id")
		}
		if seen[id] {
			return nil, status.Errorf(codes.InvalidArgument, "source_volume_ids names %s twice", volume.Quote(id))
		}
		seen[id] = true
	}
	if err := checkSnapshotParameters(req.GetParameters()); err != nil {
		return nil, err
	}
	release, err := d.busy.acquire(snapshotNameKey(name))
	if err != nil {
		return nil, err
	}
	defer release()
	for _, id := range ids {
		if _, err := d.managedSource(id); err != nil {
			return nil, err
		}
	}
	if err := d.groupNameFree(ctx, name, ids); err != nil {
		return nil, err
	}
	members, err := d.store.CreateSnapshotGroup(ctx, ids, name, volume.SnapshotOptions{Labels: snapshotLabels(name)})
	if err != nil {
		return nil, toStatus(err)
	}
	if len(members) == 0 || members[0].Group == "" {
		return nil, status.Errorf(codes.Internal, "group snapshot %q: the store returned no group", name)
	}
	id := members[0].Group
	for _, s := range members {
		if !managedSnapshot(s) {
			return nil, status.Errorf(codes.AlreadyExists, "name %q is taken by group snapshot %s, which the CSI driver did not make", name, id)
		}
	}
	slices.SortFunc(members, func(a, b *volume.Snapshot) int { return strings.Compare(a.UUID, b.UUID) })
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: d.csiGroupSnapshot(id, members)}, nil
}

// groupNameFree refuses a group name that names a group of other volumes
// (the store makes each member idempotent on its own, so a second request
// for a subset would return part of the first group). The caller holds the
// name in busy.
func (d *Driver) groupNameFree(ctx context.Context, name string, ids []string) error {
	all, err := d.store.ListSnapshots(ctx)
	if err != nil {
		return toStatus(err)
	}
	var have []string
	for _, s := range all {
		if s.Group == name {
			have = append(have, s.SourceUUID)
		}
	}
	if len(have) == 0 {
		return nil
	}
	want := slices.Clone(ids)
	slices.Sort(want)
	slices.Sort(have)
	if !slices.Equal(have, want) {
		return status.Errorf(codes.AlreadyExists, "group snapshot %q exists with the volumes %v, not %v", name, have, want)
	}
	return nil
}

// GetVolumeGroupSnapshot returns a group snapshot by id.
func (d *Driver) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (*csi.GetVolumeGroupSnapshotResponse, error) {
	id := req.GetGroupSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "group_snapshot_id is required")
	}
	members, err := d.groupMembers(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := checkMemberIDs(id, members, req.GetSnapshotIds()); err != nil {
		return nil, err
	}
	return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: d.csiGroupSnapshot(id, members)}, nil
}

// DeleteVolumeGroupSnapshot deletes every member of a group snapshot; an
// unknown id is success. It holds the group's name (its id) in busy as
// CreateVolumeGroupSnapshot does (snapshotNameKey), so a group still being
// made is Aborted, then each member's id in turn.
func (d *Driver) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	id := req.GetGroupSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "group_snapshot_id is required")
	}
	release, err := d.busy.acquire(snapshotNameKey(id))
	if err != nil {
		return nil, err
	}
	defer release()
	members, err := d.groupMembers(ctx, id)
	if status.Code(err) == codes.NotFound {
		return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	// A member deleted on its own before is no mismatch: the ids named
	// must include every member left.
	if want := req.GetSnapshotIds(); len(want) > 0 {
		for _, s := range members {
			if !slices.Contains(want, s.UUID) {
				return nil, status.Errorf(codes.InvalidArgument, "snapshot %s of group snapshot %s is not among snapshot_ids %s", s.UUID, id, quoteList(want))
			}
		}
	}
	for _, s := range members {
		rel, err := d.busy.acquire(snapshotKey(s.UUID))
		if err != nil {
			return nil, err
		}
		err = d.deleteSnapshot(ctx, s)
		rel()
		if err != nil {
			return nil, err
		}
	}
	return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
}
