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
	// calls on the volume (no in-flight guard), and a path that breaks the
	// path rule is NotFound for them, since the volume cannot be there.
	readOnly bool
}

// nodePath is one path field of a request, by its CSI field name.
type nodePath struct {
	field, path string
	required    bool
}

// begin is the preamble of every node RPC, in this order: required fields,
// in-flight guard, lookup, capability check, path check (checkNodePath on
// every path given). It returns the volume and a release the caller must
// call when done (also after an error; it is never nil). Nothing on the
// node is touched before begin returns without error.
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
		if release, err = d.busy.acquire(r.id); err != nil {
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
	return v, release, nil
}
