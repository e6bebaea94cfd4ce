package csi

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// Snapshots are the store's (volume.Snapshot): files on this node's disk,
// made by the node engine, so a snapshot is usable on this node only and
// says so in its accessible topology. The driver shows and deletes only the
// snapshots it made (LabelManagedBy), as with volumes: a snapshot an
// operator took with the CLI is not the CO's.

// checkSnapshotParameters refuses VolumeSnapshotClass parameters: none are
// defined; the ones the external snapshotter adds are ignored.
func checkSnapshotParameters(params map[string]string) error {
	for k := range params {
		if !strings.HasPrefix(k, provisionerPrefix) {
			return status.Errorf(codes.InvalidArgument, "unknown snapshot parameter %s (snapshots take none)", volume.Quote(k))
		}
	}
	return nil
}

// snapshotLabels are the labels of a snapshot the driver makes.
func snapshotLabels(name string) map[string]string {
	return map[string]string{LabelCSIName: name, LabelManagedBy: ManagedByCSI}
}

func managedSnapshot(s *volume.Snapshot) bool { return s.Labels[LabelManagedBy] == ManagedByCSI }

// lookupSnapshot finds a snapshot the driver made by its CSI id, which is
// the snapshot UUID and never a name. Anything else is ErrNotFound.
func (d *Driver) lookupSnapshot(ctx context.Context, id string) (*volume.Snapshot, error) {
	if !volume.ValidUUID(id) {
		return nil, fmt.Errorf("snapshot id %s is not a snapshot UUID: %w", volume.Quote(id), volume.ErrNotFound)
	}
	s, err := d.store.GetSnapshot(ctx, id)
	if err != nil {
		return nil, err
	}
	if s.UUID != id || !managedSnapshot(s) {
		return nil, fmt.Errorf("snapshot %s: %w", id, volume.ErrNotFound)
	}
	return s, nil
}

// managedSource finds the CSI volume a snapshot or clone is taken of.
func (d *Driver) managedSource(id string) (*volume.Volume, error) {
	v, err := d.lookup(id)
	if err != nil {
		return nil, toStatus(err)
	}
	if err := checkManaged(v, "snapshot or copy it with `sparsevol snapshot create` or `sparsevol create --clone-of`"); err != nil {
		return nil, err
	}
	return v, nil
}

func (d *Driver) csiSnapshot(s *volume.Snapshot) *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:         s.UUID,
		SourceVolumeId:     s.SourceUUID,
		SizeBytes:          s.SizeBytes,
		CreationTime:       timestamppb.New(s.CreatedAt),
		ReadyToUse:         s.ReadyToUse,
		GroupSnapshotId:    s.Group,
		AccessibleTopology: []*csi.Topology{d.topology()},
	}
}

// CreateSnapshot takes a point-in-time copy of a volume of this node,
// idempotent by name: the same name of the same source returns the
// snapshot made before, of another source AlreadyExists.
func (d *Driver) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	name, src := req.GetName(), req.GetSourceVolumeId()
	if name == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	if err := volume.ValidateName(name); err != nil {
		return nil, toStatus(err)
	}
	if src == "" {
		return nil, status.Error(codes.InvalidArgument, "source_volume_id is required")
	}
	if err := checkSnapshotParameters(req.GetParameters()); err != nil {
		return nil, err
	}
	if !d.onThisNode(req.GetAccessibilityRequirements()) {
		return nil, status.Errorf(codes.ResourceExhausted, "snapshots of node %s can only be accessible from %s=%s", d.nodeID, TopologyKey, d.nodeID)
	}
	release, err := d.busy.acquire(snapshotNameKey(name))
	if err != nil {
		return nil, err
	}
	defer release()
	if _, err := d.managedSource(src); err != nil {
		return nil, err
	}
	s, err := d.store.CreateSnapshot(ctx, src, name, volume.SnapshotOptions{Labels: snapshotLabels(name)})
	if err != nil {
		return nil, toStatus(err)
	}
	if !managedSnapshot(s) {
		return nil, status.Errorf(codes.AlreadyExists, "name %q is taken by snapshot %s, which the CSI driver did not make", name, s.UUID)
	}
	return &csi.CreateSnapshotResponse{Snapshot: d.csiSnapshot(s)}, nil
}

// DeleteSnapshot removes a snapshot; an unknown id is success. Volumes
// restored from it are copies and stay. It holds the id's in-flight key,
// then its name's (snapshotNameKey): a snapshot whose create (or its
// group's) is still running is Aborted.
func (d *Driver) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot_id is required")
	}
	release, err := d.busy.acquire(snapshotKey(id))
	if err != nil {
		return nil, err
	}
	defer release()
	s, err := d.lookupSnapshot(ctx, id)
	if errors.Is(err, volume.ErrNotFound) {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	if err != nil {
		return nil, toStatus(err)
	}
	releaseName, err := d.busy.acquire(snapshotNameKey(s.Labels[LabelCSIName]))
	if err != nil {
		return nil, err
	}
	defer releaseName()
	if err := d.deleteSnapshot(ctx, s); err != nil {
		return nil, err
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// deleteSnapshot deletes s, a snapshot the caller found the driver made
// (lookupSnapshot, groupMembers); gone already is success. The caller
// holds s's id and its snapshotNameKey in busy.
func (d *Driver) deleteSnapshot(ctx context.Context, s *volume.Snapshot) error {
	if err := d.store.DeleteSnapshot(ctx, s.UUID); err != nil && !errors.Is(err, volume.ErrNotFound) {
		return toStatus(err)
	}
	return nil
}

// GetSnapshot returns one snapshot by id.
func (d *Driver) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (*csi.GetSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot_id is required")
	}
	s, err := d.lookupSnapshot(ctx, id)
	if err != nil {
		return nil, toStatus(err)
	}
	return &csi.GetSnapshotResponse{Snapshot: d.csiSnapshot(s)}, nil
}

// ListSnapshots pages through the driver's snapshots in UUID order,
// filtered by snapshot id or source volume id. The token is the last UUID
// of the previous page, as in ListVolumes. A filter naming nothing that
// exists gives an empty list, not an error.
func (d *Driver) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	pg, err := parsePage(req.GetMaxEntries(), req.GetStartingToken())
	if err != nil {
		return nil, err
	}
	byID, bySource := req.GetSnapshotId(), req.GetSourceVolumeId()
	resp := &csi.ListSnapshotsResponse{}
	if (byID != "" && !volume.ValidUUID(byID)) || (bySource != "" && !volume.ValidUUID(bySource)) {
		return resp, nil
	}
	all, err := d.store.ListSnapshots(ctx)
	if err != nil {
		return nil, toStatus(err)
	}
	var ours []*volume.Snapshot
	for _, s := range all {
		if managedSnapshot(s) && s.UUID > pg.token &&
			(byID == "" || s.UUID == byID) && (bySource == "" || s.SourceUUID == bySource) {
			ours = append(ours, s)
		}
	}
	ours, resp.NextToken = pageOf(pg, ours, func(s *volume.Snapshot) string { return s.UUID })
	for _, s := range ours {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: d.csiSnapshot(s)})
	}
	return resp, nil
}
