package csi

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// StorageClass parameters understood by CreateVolume.
const (
	ParamProvisioning = "provisioning" // thin (default) | thick
	ParamMkfsOptions  = "mkfsOptions"  // extra mkfs arguments, space separated
	ParamDirectIO     = "directIO"     // true | false (default: the store's)
	ParamFSType       = "fsType"       // ext4 (default) | xfs
	// ParamDiscard mounts the filesystem with online discard, so deleted
	// data goes back to the node's disk at once (thin volumes only).
	ParamDiscard = "discard" // true | false (default)
	// I/O limits of the volume's device (see package iolimit); max or
	// absent: none. Byte rates take the store's sizes (10M, 1.5Gi).
	ParamReadIOPS  = "readIOPS"
	ParamWriteIOPS = "writeIOPS"
	ParamReadBPS   = "readBytesPerSecond"
	ParamWriteBPS  = "writeBytesPerSecond"
	// Keys under this prefix are set by the external provisioner and ignored.
	provisionerPrefix = "csi.storage.k8s.io/"
)

// DefaultVolumeSize is what CreateVolume makes when the request names no
// size at all.
const DefaultVolumeSize = 1 << 30

// spec is a validated CreateVolume request: the volume request, whose
// layout volume normalized and whose size is chosen, and what only the CSI
// driver knows.
type spec struct {
	req      volume.CreateRequest
	discard  bool
	required int64
	limit    int64
	fsNamed  bool           // the capability or parameters name a filesystem
	source   *contentSource // content source, nil for none
}

// ControllerGetCapabilities advertises the controller RPCs implemented.
func (d *Driver) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: capabilities([]csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
	}, func(t csi.ControllerServiceCapability_RPC_Type) *csi.ControllerServiceCapability {
		return &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}}
	})}, nil
}

// parseRequest maps the capabilities, parameters and capacity of a
// CreateVolume request to a volume request. The rules of what a volume may
// be (modes, filesystems, mkfs options) are volume's: NormalizeLayout.
func parseRequest(caps []*csi.VolumeCapability, params map[string]string, cr *csi.CapacityRange) (*spec, error) {
	if len(caps) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	s := &spec{}
	r := &s.req
	capFS := ""
	for i, c := range caps {
		if err := checkRequested(c); err != nil {
			return nil, err
		}
		var mode volume.Mode
		switch {
		case c.GetBlock() != nil:
			mode = volume.ModeBlock
		case c.GetMount() != nil:
			mode = volume.ModeFilesystem
			if fs := c.GetMount().GetFsType(); fs != "" {
				if capFS != "" && capFS != fs {
					return nil, status.Errorf(codes.InvalidArgument, "volume capabilities ask for both %s and %s", volume.Quote(capFS), volume.Quote(fs))
				}
				capFS = fs
			}
		default:
			return nil, status.Errorf(codes.InvalidArgument, "volume capability %d has neither mount nor block access type", i)
		}
		if i > 0 && mode != r.Mode {
			return nil, status.Error(codes.InvalidArgument, "volume capabilities mix block and mount access types")
		}
		r.Mode = mode
	}
	var limits volume.LimitChange
	for k, v := range params {
		switch k {
		case ParamProvisioning:
			switch v {
			case "", "thin":
			case "thick":
				r.Preallocate = true
			default:
				return nil, status.Errorf(codes.InvalidArgument, "parameter %s=%s: want thin or thick", k, volume.Quote(v))
			}
		case ParamMkfsOptions:
			r.MkfsOptions = []string{v}
		case ParamDirectIO:
			b, err := strconv.ParseBool(v)
			if err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "parameter %s=%s: want true or false", k, volume.Quote(v))
			}
			r.DirectIO = &b
		case ParamFSType:
			r.FSType = v
		case ParamDiscard:
			b, err := strconv.ParseBool(v)
			if err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "parameter %s=%s: want true or false", k, volume.Quote(v))
			}
			s.discard = b
		case ParamReadIOPS, ParamWriteIOPS, ParamReadBPS, ParamWriteBPS:
			if err := parseLimit(k, v, &limits); err != nil {
				return nil, err
			}
		default:
			if !strings.HasPrefix(k, provisionerPrefix) {
				return nil, status.Errorf(codes.InvalidArgument, "unknown parameter %s (known: %s, %s, %s, %s, %s, %s, %s, %s, %s)",
					volume.Quote(k), ParamProvisioning, ParamMkfsOptions, ParamDirectIO, ParamFSType, ParamDiscard,
					ParamReadIOPS, ParamWriteIOPS, ParamReadBPS, ParamWriteBPS)
			}
		}
	}
	r.IOLimits = limits.Over(r.IOLimits)
	if capFS != "" {
		if r.FSType != "" && r.FSType != capFS {
			return nil, status.Errorf(codes.InvalidArgument, "parameter %s=%s contradicts the capability's fs_type %s", ParamFSType, volume.Quote(r.FSType), volume.Quote(capFS))
		}
		r.FSType = capFS
	}
	s.fsNamed = r.FSType != ""
	// Block volumes are whole devices: the pod partitions them if it wants.
	r.NoPartition = r.Mode == volume.ModeBlock
	if err := r.NormalizeLayout(); err != nil {
		return nil, toStatus(err)
	}
	if err := checkDiscard(s.discard, r.Preallocate, r.Mode); err != nil {
		return nil, err
	}
	size, err := sizeFor(cr, r.FSType)
	if err != nil {
		return nil, err
	}
	r.SizeBytes, s.required, s.limit = size, cr.GetRequiredBytes(), cr.GetLimitBytes()
	if err := r.NormalizeSize(); err != nil {
		return nil, toStatus(err)
	}
	return s, nil
}

// sizeFor picks the volume size for a capacity range: the required bytes
// (or a default), raised to the filesystem's minimum, as wholeMiBWithin
// the limit.
func sizeFor(cr *csi.CapacityRange, fsType string) (int64, error) {
	if err := checkCapacityRange(cr); err != nil {
		return 0, err
	}
	req, lim := cr.GetRequiredBytes(), cr.GetLimitBytes()
	size := req
	if size == 0 {
		size = DefaultVolumeSize
		if lim > 0 && lim < size {
			size = lim
		}
	}
	floor := max(req, volume.MinSize(fsType))
	size, ok := wholeMiBWithin(max(size, floor), floor, lim)
	if !ok {
		what := "block volumes"
		if fsType != "" {
			what = fsType
		}
		return 0, status.Errorf(codes.OutOfRange,
			"no size fits %d..%d bytes: sizes are whole MiB and at least %s for %s", req, lim, volume.FormatSize(volume.MinSize(fsType)), what)
	}
	return size, nil
}

// wholeMiBWithin is the one rule of sizes against a limit (0: none):
// want rounded up to a whole MiB, or, where that passes the limit, the
// largest whole MiB within it if that is still floor or more (a range
// that gives only a limit asks for no more than the limit). ok is false
// where no whole-MiB size from floor to the limit exists.
func wholeMiBWithin(want, floor, limit int64) (size int64, ok bool) {
	size = volume.RoundUpMiB(want)
	if limit <= 0 || size <= limit {
		return size, true
	}
	if down := limit / volume.MiB * volume.MiB; down > 0 && down >= floor {
		return down, true
	}
	return 0, false
}

// checkCapacityRange refuses a capacity range no size can meet by its
// own terms: negative bytes, or required beyond a limit. Zero means unset.
func checkCapacityRange(cr *csi.CapacityRange) error {
	req, lim := cr.GetRequiredBytes(), cr.GetLimitBytes()
	if req < 0 || lim < 0 {
		return status.Errorf(codes.InvalidArgument, "capacity range %d..%d is negative", req, lim)
	}
	if lim > 0 && req > lim {
		return status.Errorf(codes.InvalidArgument, "required bytes %d exceed limit bytes %d", req, lim)
	}
	return nil
}

// checkRequested applies what a capability may ask of any volume: one
// of the single-node access modes (a sparse file on one node's disk
// cannot be shared with other nodes), and mount flags that
// checkMountOptions passes.
func checkRequested(c *csi.VolumeCapability) error {
	if c == nil || c.GetAccessMode() == nil {
		return status.Error(codes.InvalidArgument, "volume capability without access mode")
	}
	switch m := c.GetAccessMode().GetMode(); m {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
	default:
		return status.Errorf(codes.InvalidArgument, "access mode %s is not supported: volumes live on one node", m)
	}
	if err := checkMountOptions(c.GetMount().GetMountFlags()); err != nil {
		return status.Errorf(codes.InvalidArgument, "mount_flags: %v", err)
	}
	return nil
}

// checkCapability reports whether capability c can be served by volume v.
func checkCapability(v *volume.Volume, c *csi.VolumeCapability) error {
	if err := checkRequested(c); err != nil {
		return err
	}
	switch {
	case c.GetBlock() != nil:
		if v.Mode != volume.ModeBlock {
			return status.Errorf(codes.InvalidArgument, "volume %s has a %s filesystem and cannot be used as a block device", v.UUID, v.FSType)
		}
	case c.GetMount() != nil:
		if v.Mode != volume.ModeFilesystem {
			return status.Errorf(codes.InvalidArgument, "volume %s is a block volume and cannot be mounted", v.UUID)
		}
		if fs := c.GetMount().GetFsType(); fs != "" && fs != v.FSType {
			return status.Errorf(codes.InvalidArgument, "volume %s has a %s filesystem, not %s", v.UUID, v.FSType, volume.Quote(fs))
		}
	default:
		return status.Error(codes.InvalidArgument, "volume capability has neither mount nor block access type")
	}
	return nil
}

// incompatibility says why an existing volume does not satisfy s ("" if
// it does).
func (s *spec) incompatibility(v *volume.Volume) string {
	switch {
	case v.Mode != s.req.Mode:
		return fmt.Sprintf("it is a %s volume", v.Mode)
	case (s.source == nil || s.fsNamed) && v.FSType != s.req.FSType:
		return fmt.Sprintf("it has filesystem %s", v.FSType)
	case v.SizeBytes < s.required || (s.limit > 0 && v.SizeBytes > s.limit):
		return fmt.Sprintf("its size %d is outside %d..%d", v.SizeBytes, s.required, s.limit)
	case v.Preallocate != s.req.Preallocate:
		return fmt.Sprintf("its provisioning is %s", v.Labels[LabelProvisioning])
	case sourceOf(v).String() != s.source.String():
		return fmt.Sprintf("its content source is %q", sourceOf(v))
	case !slices.Equal(v.MkfsOptions, s.req.MkfsOptions):
		return fmt.Sprintf("its mkfs options are %q", v.MkfsOptions)
	case s.req.DirectIO != nil && v.DirectIO != *s.req.DirectIO:
		return fmt.Sprintf("its directIO is %t", v.DirectIO)
	case s.discard != (v.Labels[LabelDiscard] == "true"):
		return fmt.Sprintf("its discard is %t", !s.discard)
	case v.IOLimits != s.req.IOLimits:
		return fmt.Sprintf("its I/O limits are %s", volume.FormatLimits(v.IOLimits))
	}
	return ""
}

func provisioning(preallocate bool) string {
	if preallocate {
		return "thick"
	}
	return "thin"
}

func (d *Driver) csiVolume(v *volume.Volume) *csi.Volume {
	return &csi.Volume{
		VolumeId:           v.UUID,
		CapacityBytes:      v.SizeBytes,
		AccessibleTopology: []*csi.Topology{d.topology()},
		ContentSource:      sourceOf(v).csi(),
	}
}

// onThisNode reports whether a topology requirement can be met here.
func (d *Driver) onThisNode(req *csi.TopologyRequirement) bool {
	if len(req.GetRequisite()) == 0 {
		return true
	}
	for _, t := range req.GetRequisite() {
		if node, ok := t.GetSegments()[TopologyKey]; ok && node == d.nodeID && len(t.GetSegments()) == 1 {
			return true
		}
	}
	return false
}

// CreateVolume makes a sparse volume, idempotent by name: empty, or from a
// content source of this node (source.go).
func (d *Driver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	name := req.GetName()
	if name == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	if err := volume.ValidateName(name); err != nil {
		return nil, toStatus(err)
	}
	params, err := withMutable(req.GetParameters(), req.GetMutableParameters())
	if err != nil {
		return nil, err
	}
	s, err := parseRequest(req.GetVolumeCapabilities(), params, req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	src, err := parseContentSource(req.GetVolumeContentSource())
	if err != nil {
		return nil, err
	}
	if !d.onThisNode(req.GetAccessibilityRequirements()) {
		return nil, status.Errorf(codes.ResourceExhausted, "volumes of node %s can only be accessible from %s=%s", d.nodeID, TopologyKey, d.nodeID)
	}
	release, err := d.busy.acquire(volumeNameKey(name))
	if err != nil {
		return nil, err
	}
	defer release()
	if src != nil {
		// The source stays while it is copied: no CSI delete meanwhile.
		releaseSrc, err := d.busy.acquire(src.key())
		if err != nil {
			return nil, err
		}
		defer releaseSrc()
		if err := d.fromSource(ctx, s, src); err != nil {
			return nil, err
		}
		// What a copy may not say (mkfs options ...) is refused before a
		// volume of that name is looked at.
		check := s.req
		check.Name = name
		if err := check.Normalize(); err != nil {
			return nil, toStatus(err)
		}
	}

	cr := s.req
	cr.Name = name
	cr.Labels = map[string]string{
		LabelCSIName:      name,
		LabelManagedBy:    ManagedByCSI,
		LabelProvisioning: provisioning(cr.Preallocate),
	}
	if s.discard {
		cr.Labels[LabelDiscard] = "true"
	}
	// The store decides whether the name is free, under its lock; only a
	// name that is taken is looked at here (taken).
	v, err := d.store.Create(ctx, cr)
	if errors.Is(err, volume.ErrExists) {
		return d.taken(ctx, s, cr, err)
	}
	if err != nil {
		return nil, toStatus(err)
	}
	return &csi.CreateVolumeResponse{Volume: d.csiVolume(v)}, nil
}

// taken answers a CreateVolume whose name the store found taken (exists,
// the store's error): the same request again is success; a crashed
// create of it is finished with its recorded size; anything else is
// refused. The caller holds the name's in-flight guard.
func (d *Driver) taken(ctx context.Context, s *spec, cr volume.CreateRequest, exists error) (*csi.CreateVolumeResponse, error) {
	vols, err := d.store.List()
	if err != nil {
		return nil, toStatus(err)
	}
	i := slices.IndexFunc(vols, func(v *volume.Volume) bool { return v.Name == cr.Name })
	if i < 0 {
		return nil, toStatus(exists) // not a volume's name: the store says what holds it
	}
	v := vols[i]
	if !managed(v) {
		return nil, status.Errorf(codes.AlreadyExists, "name %q is taken by volume %s, which the CSI driver does not manage", cr.Name, v.UUID)
	}
	if why := s.incompatibility(v); why != "" {
		return nil, status.Errorf(codes.AlreadyExists, "volume %q (%s) exists and is incompatible with the request: %s", cr.Name, v.UUID, why)
	}
	switch v.State {
	case volume.StateReady:
		return &csi.CreateVolumeResponse{Volume: d.csiVolume(v)}, nil
	case volume.StateDeleting:
		return nil, status.Errorf(codes.Aborted, "volume %q (%s) is being deleted; retry later", cr.Name, v.UUID)
	}
	// State creating: a crashed create; store.Create finishes it with the
	// same (recorded) size.
	cr.SizeBytes = v.SizeBytes
	if v, err = d.store.Create(ctx, cr); err != nil {
		return nil, toStatus(err)
	}
	return &csi.CreateVolumeResponse{Volume: d.csiVolume(v)}, nil
}

// DeleteVolume removes a volume; an unknown id is success. A volume that is
// still attached (staged) or in use is refused.
func (d *Driver) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	release, err := d.busy.acquire(volumeKey(id))
	if err != nil {
		return nil, err
	}
	defer release()
	v, err := d.lookup(id)
	if errors.Is(err, volume.ErrNotFound) {
		return &csi.DeleteVolumeResponse{}, nil
	}
	if err != nil {
		return nil, toStatus(err)
	}
	if err := checkManaged(v, "delete it with `sparsevol delete`"); err != nil {
		return nil, err
	}
	st, err := d.store.Status(id)
	if err != nil {
		return nil, toStatus(err)
	}
	if st.Attached {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still staged (attached to %s, mounted at %v); unstage it first",
			id, st.Device, st.MountPoints)
	}
	if err := d.store.Delete(ctx, id, volume.DetachOptions{}); err != nil && !errors.Is(err, volume.ErrNotFound) {
		return nil, toStatus(err)
	}
	return &csi.DeleteVolumeResponse{}, nil
}

// ValidateVolumeCapabilities confirms capabilities a volume can serve.
func (d *Driver) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	v, err := d.lookup(id)
	if err != nil {
		return nil, toStatus(err)
	}
	for _, c := range req.GetVolumeCapabilities() {
		if err := checkCapability(v, c); err != nil {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
		}
	}
	if len(req.GetParameters()) > 0 {
		s, err := parseRequest(req.GetVolumeCapabilities(), req.GetParameters(), &csi.CapacityRange{RequiredBytes: v.SizeBytes})
		if err != nil {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
		}
		if why := s.incompatibility(v); why != "" {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: "parameters do not match volume " + id + ": " + why}, nil
		}
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

// ListVolumes pages through the CSI volumes in UUID order. The token is
// the last UUID of the previous page, so deleting or adding volumes
// between pages neither repeats nor skips the others. Ready volumes are
// listed, and those whose record a newer sparsevol wrote: they exist,
// and every call on one says why it is refused (lookup).
func (d *Driver) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	pg, err := parsePage(req.GetMaxEntries(), req.GetStartingToken())
	if err != nil {
		return nil, err
	}
	vols, err := d.store.List()
	if err != nil {
		return nil, toStatus(err)
	}
	var ours []*volume.Volume
	for _, v := range vols {
		if managed(v) && (v.State == volume.StateReady || v.State == volume.StateNewer) && v.UUID > pg.token {
			ours = append(ours, v)
		}
	}
	resp := &csi.ListVolumesResponse{}
	ours, resp.NextToken = pageOf(pg, ours, func(v *volume.Volume) string { return v.UUID })
	for _, v := range ours {
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{Volume: d.csiVolume(v)})
	}
	return resp, nil
}

// listPage is what a list call (ListVolumes, ListSnapshots) asked for:
// entries after token, a UUID the previous page ended with (or ""), at
// most max of them.
type listPage struct {
	max   int
	token string
}

// defaultListPage is how many entries a list call that gives no
// max_entries gets per page (the spec leaves it to the driver): a page
// of every volume or snapshot of a store could pass what a client
// accepts in one message (gRPC's 4 MiB by default).
var defaultListPage = 1000

// parsePage checks a list call's max_entries and starting_token.
func parsePage(maxEntries int32, token string) (listPage, error) {
	if maxEntries < 0 {
		return listPage{}, status.Errorf(codes.InvalidArgument, "max_entries %d is negative", maxEntries)
	}
	if token != "" && !volume.ValidUUID(token) {
		return listPage{}, status.Errorf(codes.Aborted, "starting_token %s was not issued by this driver", volume.Quote(token))
	}
	pg := listPage{max: int(maxEntries), token: token}
	if pg.max == 0 {
		pg.max = defaultListPage
	}
	return pg, nil
}

// pageOf sorts items (those after pg.token) by uuid and cuts them to one
// page; next is the token of the page after it, "" at the end.
func pageOf[T any](pg listPage, items []T, uuid func(T) string) (page []T, next string) {
	sort.Slice(items, func(i, j int) bool { return uuid(items[i]) < uuid(items[j]) })
	if len(items) > pg.max {
		items = items[:pg.max]
		next = uuid(items[pg.max-1])
	}
	return items, next
}

// GetCapacity reports what the store can still promise under its
// overcommit policy (for thick volumes, no more than is free); the same
// numbers CreateVolume checks against. Parameters CreateVolume refuses
// (I/O limits on a host that cannot enforce them too) have none.
func (d *Driver) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	if t := req.GetAccessibleTopology(); t != nil && !d.onThisNode(&csi.TopologyRequirement{Requisite: []*csi.Topology{t}}) {
		return &csi.GetCapacityResponse{}, nil
	}
	caps := req.GetVolumeCapabilities()
	if len(caps) == 0 {
		caps = []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}}
	}
	s, err := parseRequest(caps, req.GetParameters(), nil)
	if err == nil {
		err = d.store.CheckLimits(s.req.IOLimits)
	}
	if err != nil {
		// Nothing of that kind can be made here: CreateVolume refuses it.
		return &csi.GetCapacityResponse{}, nil
	}
	sp, err := d.store.Space()
	if err != nil {
		return nil, toStatus(err)
	}
	// A thick volume allocates everything now: it must also fit in what is
	// physically free, whatever the overcommit ratio.
	capacity := sp.Available(s.req.Preallocate) / volume.MiB * volume.MiB
	resp := &csi.GetCapacityResponse{
		AvailableCapacity: capacity,
		MaximumVolumeSize: wrapperspb.Int64(capacity),
		MinimumVolumeSize: wrapperspb.Int64(volume.MinSize(s.req.FSType)),
	}
	return resp, nil
}

// ControllerExpandVolume grows the backing file (and an attached loop
// device) of a volume the driver created (checkManaged); the node grows
// the filesystem.
func (d *Driver) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	cr := req.GetCapacityRange()
	if cr == nil || (cr.GetRequiredBytes() == 0 && cr.GetLimitBytes() == 0) {
		return nil, status.Error(codes.InvalidArgument, "capacity_range is required")
	}
	if err := checkCapacityRange(cr); err != nil {
		return nil, err
	}
	release, err := d.busy.acquire(volumeKey(id))
	if err != nil {
		return nil, err
	}
	defer release()
	v, err := d.lookup(id)
	if err != nil {
		return nil, toStatus(err)
	}
	if err := checkManaged(v, "grow it with `sparsevol expand`"); err != nil {
		return nil, err
	}
	if req.GetVolumeCapability() != nil {
		if err := checkCapability(v, req.GetVolumeCapability()); err != nil {
			return nil, err
		}
	}
	nodeExpansion := v.Mode == volume.ModeFilesystem
	want := cr.GetRequiredBytes()
	if want == 0 {
		want = cr.GetLimitBytes()
	}
	if v.SizeBytes >= want && v.ExpandingTo == 0 {
		if lim := cr.GetLimitBytes(); lim > 0 && v.SizeBytes > lim {
			return nil, status.Errorf(codes.OutOfRange, "volume %s is %d bytes, beyond the limit of %d; volumes do not shrink", id, v.SizeBytes, lim)
		}
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.SizeBytes, NodeExpansionRequired: nodeExpansion}, nil
	}
	size, err := expandSize(want, cr)
	if err != nil {
		return nil, err
	}
	nv, err := d.store.Expand(ctx, id, size, volume.ExpandOptions{FileOnly: true})
	if err != nil {
		return nil, toStatus(err)
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: nv.SizeBytes, NodeExpansionRequired: nodeExpansion}, nil
}

// expandSize is the rule of both expand RPCs for growing to want bytes
// within cr (checked by checkCapacityRange): the whole-MiB size the
// volume becomes (wholeMiBWithin), or OutOfRange where none fits.
func expandSize(want int64, cr *csi.CapacityRange) (int64, error) {
	size, ok := wholeMiBWithin(want, cr.GetRequiredBytes(), cr.GetLimitBytes())
	if !ok {
		return 0, status.Errorf(codes.OutOfRange, "no whole-MiB size fits %d..%d bytes", cr.GetRequiredBytes(), cr.GetLimitBytes())
	}
	return size, nil
}

// FSTypeParameter is the StorageClass parameter the external provisioner
// turns into the mount capability's fs_type (and strips).
const FSTypeParameter = provisionerPrefix + "fstype"

// ValidateParameters checks StorageClass parameters the way CreateVolume
// will see them behind the external provisioner, for a filesystem claim
// and, unless they name a filesystem, for a block claim.
func ValidateParameters(params map[string]string) error {
	mount := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: params[FSTypeParameter]}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	if _, err := parseRequest([]*csi.VolumeCapability{mount}, params, nil); err != nil {
		return err
	}
	if params[FSTypeParameter] != "" || params[ParamFSType] != "" || params[ParamMkfsOptions] != "" {
		return nil
	}
	block := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: mount.AccessMode,
	}
	_, err := parseRequest([]*csi.VolumeCapability{block}, params, nil)
	return err
}
