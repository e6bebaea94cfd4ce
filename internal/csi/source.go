package csi

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// Content sources: CreateVolume restores a snapshot or clones a volume of
// this node (the store has no other), through the engine's create from a
// source (volume.CreateRequest FromSnapshot / CloneOf), which owns the
// rules of a copy (mode and filesystem the source's, no mkfs options, at
// least the source's size) and gives the copy its own identity. The
// volume records its source (FromSnapshot / ClonedFrom).

// Kinds of content source.
const (
	sourceSnapshot = "snapshot"
	sourceVolume   = "volume"
)

// contentSource is the validated shape of a CreateVolume content source.
type contentSource struct {
	kind string // sourceSnapshot or sourceVolume
	id   string
}

// key is the in-flight key of the source: a snapshot's or a volume's.
func (s *contentSource) key() busyKey {
	if s.kind == sourceSnapshot {
		return snapshotKey(s.id)
	}
	return volumeKey(s.id)
}

// parseContentSource checks the shape of a content source; nil is none.
func parseContentSource(cs *csi.VolumeContentSource) (*contentSource, error) {
	switch {
	case cs == nil:
		return nil, nil
	case cs.GetSnapshot() != nil:
		if cs.GetSnapshot().GetSnapshotId() == "" {
			return nil, status.Error(codes.InvalidArgument, "volume_content_source.snapshot.snapshot_id is required")
		}
		return &contentSource{kind: sourceSnapshot, id: cs.GetSnapshot().GetSnapshotId()}, nil
	case cs.GetVolume() != nil:
		if cs.GetVolume().GetVolumeId() == "" {
			return nil, status.Error(codes.InvalidArgument, "volume_content_source.volume.volume_id is required")
		}
		return &contentSource{kind: sourceVolume, id: cs.GetVolume().GetVolumeId()}, nil
	}
	return nil, status.Error(codes.InvalidArgument, "volume_content_source names neither a snapshot nor a volume")
}

// sourceOf is the content source volume v was made from, nil for none.
func sourceOf(v *volume.Volume) *contentSource {
	switch {
	case v.FromSnapshot != "":
		return &contentSource{kind: sourceSnapshot, id: v.FromSnapshot}
	case v.ClonedFrom != "":
		return &contentSource{kind: sourceVolume, id: v.ClonedFrom}
	}
	return nil
}

// String names c in messages and comparisons ("" for none).
func (c *contentSource) String() string {
	if c == nil {
		return ""
	}
	return c.kind + " " + c.id
}

// csi is c as the CSI message.
func (c *contentSource) csi() *csi.VolumeContentSource {
	switch {
	case c == nil:
		return nil
	case c.kind == sourceSnapshot:
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: c.id}}}
	}
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: c.id}}}
}

// fromSource turns s into a request for a copy of c: the source must be
// the driver's and on this node (the store's); the filesystem is left to
// the source unless the request names one; the size is at least the
// source's, within the request's limit. Errors are status errors.
func (d *Driver) fromSource(ctx context.Context, s *spec, c *contentSource) error {
	var size int64
	switch c.kind {
	case sourceSnapshot:
		sn, err := d.lookupSnapshot(ctx, c.id)
		if err != nil {
			return toStatus(err)
		}
		size = sn.SizeBytes
		s.req.FromSnapshot = sn.UUID
	case sourceVolume:
		v, err := d.managedSource(c.id)
		if err != nil {
			return err
		}
		size = v.SizeBytes
		s.req.CloneOf = v.UUID
	}
	if !s.fsNamed {
		s.req.FSType = ""
	}
	s.req.NoPartition = false // the layout is the source's
	if s.required == 0 {
		s.req.SizeBytes = size
	}
	s.req.SizeBytes = max(s.req.SizeBytes, size)
	if s.limit > 0 && s.req.SizeBytes > s.limit {
		return status.Errorf(codes.OutOfRange, "%s is %d bytes, beyond the limit of %d: a volume made from it is at least as large", c, size, s.limit)
	}
	s.source = c
	return nil
}
