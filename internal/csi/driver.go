// Package csi serves the Container Storage Interface (Identity, Controller
// and Node) over the volume store of one node (Run wires the plugin
// process). Every volume operation is mapped onto internal/volume; what is
// CSI's own is here: the request checks (one preamble per node RPC, the
// kubelet path rule), the in-flight guard, mounting staged and published
// paths, and the mapping of store errors to gRPC codes, here and only here.
package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/k8sname"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// DefaultDriverName is the CSI driver name when none is configured.
const DefaultDriverName = "sparsevol.csi.io"

// maxDriverName is the longest CSI driver name the CSI spec allows.
const maxDriverName = 63

// checkDriverName is the rule for the CSI driver name, the CSI spec's for
// the name GetPluginInfo returns: at most maxDriverName characters, ASCII
// letters and digits with '-' and '.' between, beginning and ending with
// a letter or digit. The name also names kubelet's registration socket
// (kubelet.SocketPath: <name>-reg.sock), which the rule keeps one file
// name in its directory. A violation wraps volume.ErrInvalid.
func checkDriverName(name string) error {
	ok := name != "" && len(name) <= maxDriverName && alnum(name[0]) && alnum(name[len(name)-1])
	for i := 0; ok && i < len(name); i++ {
		ok = alnum(name[i]) || name[i] == '-' || name[i] == '.'
	}
	if !ok {
		return fmt.Errorf("driver name %s: want at most %d characters, ASCII letters and digits with '-' and '.' between, "+
			"beginning and ending with a letter or digit (the CSI spec's plugin name), e.g. %s: %w",
			volume.Quote(name), maxDriverName, DefaultDriverName, volume.ErrInvalid)
	}
	return nil
}

// checkNodeID is the rule for the node id: the node's name as Kubernetes
// knows it (a DNS-1123 subdomain), which is also the value of the topology
// segment kubelet labels the node with (TopologyKey), so a label value:
// at most 63 characters. A violation wraps volume.ErrInvalid.
func checkNodeID(id string) error {
	if id == "" {
		return fmt.Errorf("node id is empty; give the node's name (the downward API's spec.nodeName): %w", volume.ErrInvalid)
	}
	if msgs := append(k8sname.Subdomain(id), k8sname.LabelValue(id)...); len(msgs) > 0 {
		return fmt.Errorf("node id %s is not a Kubernetes node name that can be a label value (%s); give the node's name (the downward API's spec.nodeName): %w",
			volume.Quote(id), strings.Join(msgs, "; "), volume.ErrInvalid)
	}
	return nil
}

func alnum(c byte) bool { return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' }

// Labels the driver keeps on the volumes it creates.
const (
	// LabelCSIName records the CreateVolume name, which makes CreateVolume
	// idempotent across restarts of the plugin.
	LabelCSIName = "sparsevol.io/csi-name"
	// LabelManagedBy marks volumes the CSI driver owns (see
	// volume.LabelManagedBy).
	LabelManagedBy = volume.LabelManagedBy
	// ManagedByCSI is the value of LabelManagedBy for CSI volumes.
	ManagedByCSI = volume.ManagedByCSI
	// LabelProvisioning records thin or thick provisioning.
	LabelProvisioning = "sparsevol.io/provisioning"
	// LabelDiscard records the StorageClass parameter discard=true: the
	// node stages the filesystem with the discard mount option.
	LabelDiscard = "sparsevol.io/discard"
)

// TopologyKey is the topology segment that pins a volume to its node.
const TopologyKey = "topology.sparsevol.io/node"

// Config configures a Driver.
type Config struct {
	// DriverName is the CSI driver name (GetPluginInfo), checked by
	// checkDriverName; DefaultDriverName when empty.
	DriverName string
	// Version is reported by GetPluginInfo.
	Version string
	// NodeID names this node (NodeGetInfo and the topology segment),
	// checked by checkNodeID.
	NodeID string
	// MaxVolumes is reported as max_volumes_per_node; 0 means no limit.
	MaxVolumes int64
	// Store is the node's volume store.
	Store *volume.Store
	// Logger receives one structured record per call; nil discards.
	Logger *slog.Logger
	// Metrics, if not nil, records calls and exposes volume gauges.
	Metrics *Metrics
	// KubeletDir is the kubelet's root directory (DefaultKubeletDir when
	// empty): node RPCs act on paths below it only. It must be absolute,
	// clean and free of symbolic links.
	KubeletDir string
}

// Driver implements the CSI Identity, Controller, GroupController and Node
// services.
type Driver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer
	csi.UnimplementedGroupControllerServer

	name       string
	version    string
	nodeID     string
	maxVolumes int64
	store      *volume.Store
	log        *slog.Logger
	metrics    *Metrics
	kubeletDir string

	busy inflight
}

// New validates cfg and returns a Driver.
func New(cfg Config) (*Driver, error) {
	if err := cfg.normalize(); err != nil {
		return nil, err
	}
	if cfg.Store == nil {
		return nil, fmt.Errorf("csi driver: no volume store: %w", volume.ErrInvalid)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Driver{
		name:       cfg.DriverName,
		version:    cfg.Version,
		nodeID:     cfg.NodeID,
		maxVolumes: cfg.MaxVolumes,
		store:      cfg.Store,
		log:        cfg.Logger,
		metrics:    cfg.Metrics,
		kubeletDir: cfg.KubeletDir,
		busy:       inflight{keys: map[busyKey]struct{}{}},
	}, nil
}

// normalize fills cfg's defaults and checks what needs no store: node id
// (checkNodeID), max volumes, driver name (checkDriverName) and kubelet
// directory. New calls it; Run calls it first, so that a bad
// configuration is refused before anything is made. Errors wrap
// volume.ErrInvalid.
func (cfg *Config) normalize() error {
	if err := checkNodeID(cfg.NodeID); err != nil {
		return fmt.Errorf("csi driver: %w", err)
	}
	if cfg.MaxVolumes < 0 {
		return fmt.Errorf("csi driver: max volumes %d is negative: %w", cfg.MaxVolumes, volume.ErrInvalid)
	}
	if cfg.DriverName == "" {
		cfg.DriverName = DefaultDriverName
	}
	if err := checkDriverName(cfg.DriverName); err != nil {
		return fmt.Errorf("csi driver: %w", err)
	}
	if cfg.Version == "" {
		cfg.Version = "devel"
	}
	if cfg.KubeletDir == "" {
		cfg.KubeletDir = DefaultKubeletDir
	}
	if err := CheckDir(cfg.KubeletDir); err != nil {
		return fmt.Errorf("csi driver: kubelet directory: %w", err)
	}
	return nil
}

// topology is the accessible topology of every volume of this node.
func (d *Driver) topology() *csi.Topology {
	return &csi.Topology{Segments: map[string]string{TopologyKey: d.nodeID}}
}

// inflight is the set of keys with an operation running: volume and
// snapshot ids, their names, node paths. A second operation on the same
// key is refused with Aborted rather than queued: the CO retries, and a
// stuck mkfs cannot pile up goroutines.
type inflight struct {
	mu   sync.Mutex
	keys map[busyKey]struct{}
}

// busyKey is what an operation holds in flight: a kind of object and the
// client's string that names it. The kind keeps one string from ever
// being another kind's key: a volume_id "path /x" is not the path /x, nor
// a volume id a CreateVolume name.
type busyKey struct{ kind, value string }

func volumeKey(id string) busyKey       { return busyKey{"volume", id} }
func volumeNameKey(name string) busyKey { return busyKey{"volume name", name} }
func snapshotKey(id string) busyKey     { return busyKey{"snapshot", id} }

// snapshotNameKey is the in-flight key of a snapshot or group snapshot
// name (LabelCSIName of each snapshot made under it). A create holds it
// from before the store reserves its snapshots until they are ready, and
// a delete takes it, so that no snapshot is deleted while a create is
// still copying into it.
func snapshotNameKey(name string) busyKey { return busyKey{"snapshot name", name} }

// acquire claims key or returns an Aborted status error.
func (f *inflight) acquire(key busyKey) (func(), error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.keys[key]; ok {
		return nil, status.Errorf(codes.Aborted, "an operation on %s %s is already in progress; retry later", key.kind, volume.Quote(key.value))
	}
	f.keys[key] = struct{}{}
	return func() {
		f.mu.Lock()
		delete(f.keys, key)
		f.mu.Unlock()
	}, nil
}

// maxListed is how many values of a client's list quoteList shows.
const maxListed = 4

// quoteList is volume.Quote for a list a client sent: its first values
// quoted, then how many there are in all, so that a message echoes a
// hostile list neither whole nor unescaped.
func quoteList(vals []string) string {
	q := make([]string, 0, min(len(vals), maxListed)+1)
	for _, v := range vals[:min(len(vals), maxListed)] {
		q = append(q, volume.Quote(v))
	}
	if len(vals) > maxListed {
		q = append(q, fmt.Sprintf("... (%d in all)", len(vals)))
	}
	return "[" + strings.Join(q, " ") + "]"
}

// lookup finds a volume by its CSI volume id, which is the volume UUID and
// never a name (a name that happens to look like an id must not match).
// A volume whose record a newer sparsevol wrote is refused (ErrNewer):
// no call acts on it, not even an unmount.
func (d *Driver) lookup(id string) (*volume.Volume, error) {
	if !volume.ValidUUID(id) {
		return nil, fmt.Errorf("volume id %s is not a volume UUID: %w", volume.Quote(id), volume.ErrNotFound)
	}
	v, err := d.store.Get(id)
	if err != nil {
		return nil, err
	}
	if v.UUID != id {
		return nil, fmt.Errorf("volume %s: %w", id, volume.ErrNotFound)
	}
	if v.State == volume.StateNewer {
		return nil, v.Refusal()
	}
	return v, nil
}

// managed reports whether the CSI driver created v.
func managed(v *volume.Volume) bool { return v.Labels[LabelManagedBy] == ManagedByCSI }

// checkManaged is the rule for RPCs that change or copy a volume: only
// the driver's own (managed). Another volume (node mode, made with the
// CLI) is FailedPrecondition; instead, if not "", names what does the
// operation on it (a sparsevol command).
func checkManaged(v *volume.Volume, instead string) error {
	if managed(v) {
		return nil
	}
	if instead != "" {
		instead = "; " + instead
	}
	return status.Errorf(codes.FailedPrecondition, "volume %s (%s) was not created by the CSI driver%s", v.UUID, v.Name, instead)
}

// toStatus converts a store error (or the driver's errFrozen) into a gRPC
// status, classifying with errors.Is. It is the only place where store
// errors become codes. errFrozen comes last: where a refused record's
// put-back also met a frozen filesystem, the store's error decides.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	code := codes.Internal
	switch {
	case errors.Is(err, context.Canceled):
		code = codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		code = codes.DeadlineExceeded
	case errors.Is(err, volume.ErrInvalid):
		code = codes.InvalidArgument
	case errors.Is(err, volume.ErrNotFound):
		code = codes.NotFound
	case errors.Is(err, volume.ErrExists):
		code = codes.AlreadyExists
	case errors.Is(err, volume.ErrNoSpace), errors.Is(err, volume.ErrNoRoom):
		code = codes.ResourceExhausted
		var space *volume.SpaceError
		if errors.As(err, &space) {
			return status.Error(code, err.Error()+"; "+space.Advice("the plugin's --overcommit-ratio (chart value overcommitRatio)"))
		}
	case errors.Is(err, volume.ErrBusy), errors.Is(err, volume.ErrMismatch), errors.Is(err, volume.ErrNotSupported),
		errors.Is(err, volume.ErrUnsafe), errors.Is(err, volume.ErrOrphaned), errors.Is(err, volume.ErrNewer):
		code = codes.FailedPrecondition
	case errors.Is(err, volume.ErrNotReady):
		code = codes.Unavailable
	case errors.Is(err, errFrozen):
		code = codes.Aborted
	}
	return status.Error(code, err.Error())
}
