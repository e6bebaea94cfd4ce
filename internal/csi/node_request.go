package csi

import (
	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// nodeRequest is what a node RPC names. Every node RPC passes it through
// begin before it acts, so that each check has one home and one order.
type nodeRequest struct {
	id string
	// capability is checked against the volume when given; needCapability
	// makes it a required field.
	capability     *csi.VolumeCapability
	needCapability bool
	paths          []nodePath
	// readOnly RPCs (stats, health) change nothing: they run beside other
	// calls on the volume and its paths (no in-flight guard), and a path
	// that breaks the path rule is NotFound for them, since the volume
	// cannot be there.
	readOnly bool
}

// nodePath is one path field of a request, by its CSI field name.
type nodePath struct {
	field, path string
	required    bool
}

// begin is the preamble of every node RPC, in this order: required fields,
// in-flight guard of the volume id, lookup, capability check, path check
// (checkNodePath on every path given), in-flight guard of every path
// given (pathKey). It returns the volume and a release the caller must
// call when done (also after an error; it is never nil): it releases the
// keys taken. Nothing on the node is touched before begin returns without
// error.
func (d *Driver) begin(r nodeRequest) (*volume.Volume, func(), error) {
	release := func() {}
	if r.id == "" {
		return nil, release, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	for _, p := range r.paths {
		if p.required && p.path == "" {
			return nil, release, status.Errorf(codes.InvalidArgument, "%s is required", p.field)
		}
	}
	if r.needCapability && r.capability == nil {
		return nil, release, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	if !r.readOnly {
		var err error
		if release, err = d.busy.acquire(volumeKey(r.id)); err != nil {
			return nil, func() {}, err
		}
	}
	v, err := d.lookup(r.id)
	if err != nil {
		return nil, release, toStatus(err)
	}
	if r.capability != nil {
		if err := checkCapability(v, r.capability); err != nil {
			return nil, release, err
		}
	}
	for _, p := range r.paths {
		if p.path == "" {
			continue
		}
		if err := checkNodePath(d.kubeletDir, p.field, p.path); err != nil {
			if r.readOnly {
				return nil, release, status.Errorf(codes.NotFound, "volume %s is not at %s: %v", v.UUID, p.path, err)
			}
			return nil, release, toStatus(err)
		}
	}
	if r.readOnly {
		return v, release, nil
	}
	// Two volumes' calls on one path would both pass the path's checks
	// (nothing of theirs mounted there yet) and mount one over the other.
	for _, p := range r.paths {
		if p.path == "" {
			continue
		}
		releasePath, err := d.busy.acquire(pathKey(p.path))
		if err != nil {
			return nil, release, err
		}
		release = chain(release, releasePath)
	}
	return v, release, nil
}

// pathKey is the in-flight key of a node path that passed checkNodePath
// (absolute and clean, so one spelling a path): a node RPC that may mount
// or unmount there holds it, whatever volume it names.
func pathKey(p string) busyKey { return busyKey{"path", p} }

// chain returns a release that calls second, then first.
func chain(first, second func()) func() {
	return func() { second(); first() }
}
