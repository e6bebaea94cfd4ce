package cli

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/sparsevol/sparsevol/internal/k8sname"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// PVStorageClass is the storageClassName `sparsevol pv` gives by default:
// deploy/kubernetes ships it (no provisioner, WaitForFirstConsumer).
const PVStorageClass = "sparsevol-local"

func newPVCommand(g *globals) *cobra.Command {
	var storageClass, node, name string
	cmd := &cobra.Command{
		Use: "pv VOLUME [--storage-class SC] [--node NODE]",
		Example: `  sparsevol pv data > data-pv.json && kubectl apply -f data-pv.json
  sparsevol pv data --storage-class local --name data-on-node1`,
		Short: "Print a local PersistentVolume for a volume (node mode, static PVs)",
		Long: `Print a 'local' PersistentVolume whose path is the volume's stable path
(/dev/disk/by-uuid/<uuid>, /dev/disk/by-partuuid/<uuid>, or /dev/sparsevol/<uuid>
for whole raw volumes), pinned to this node with nodeAffinity. The manifest is
JSON, which kubectl apply and kustomize read as they read YAML.

The PV is named after the volume, whose name is unique on this node only:
where other nodes have a volume of the same name, give each PV its own
--name (PV names are cluster-wide). Volumes the CSI driver made are refused:
their PersistentVolume is the driver's.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkPVFlags(name, storageClass, node); err != nil {
				return err
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			v, err := s.Get(args[0])
			if err != nil {
				return err
			}
			// A broken record's fields are unchecked (Get gives a
			// placeholder), an unfinished volume holds no filesystem yet:
			// a manifest of either would send kubelet to a path that is
			// not the volume's, or have it format one.
			if v.State != volume.StateReady {
				return fmt.Errorf("pv %s: state %s: %w (`sparsevol status %s` says what to do)", v.UUID, v.State, volume.ErrNotReady, v.UUID)
			}
			if v.Labels[volume.LabelManagedBy] == volume.ManagedByCSI {
				return fmt.Errorf("pv %s: the CSI driver made this volume and its PersistentVolume already exposes it; a second PV would give it a second claim, and the CSI delete of the first would delete it under the second: %w", v.UUID, volume.ErrInvalid)
			}
			if node == "" {
				if node, err = defaultNode(); err != nil {
					return err
				}
				if err := checkK8sName("node (this host's name)", node, k8sname.LabelValue); err != nil {
					return err
				}
			}
			data, err := pvManifest(buildPV(v, name, storageClass, node))
			if err != nil {
				return err
			}
			_, err = g.stdout.Write(data)
			return err
		},
	}
	cmd.Flags().StringVar(&storageClass, "storage-class", PVStorageClass, "storageClassName of the PV (empty: none)")
	cmd.Flags().StringVar(&node, "node", "", "node name for nodeAffinity (default: this host's name, lowercased, as kubelet names the node)")
	cmd.Flags().StringVar(&name, "name", "", "PV name, unique in the cluster (default: the volume name if it is a valid name, else sparsevol-<uuid>; give one where other nodes have a volume of the same name)")
	return cmd
}

// hostname is os.Hostname; a variable for tests.
var hostname = os.Hostname

// defaultNode is this host's node name as kubelet makes it, and so the
// value of its kubernetes.io/hostname label: the host name lowercased
// (without --hostname-override).
func defaultNode() (string, error) {
	h, err := hostname()
	if err != nil {
		return "", fmt.Errorf("this host's name (give --node): %w", err)
	}
	return strings.ToLower(strings.TrimSpace(h)), nil
}

// checkPVFlags refuses flags that would make an invalid manifest: the PV
// name and the storage class are DNS-1123 subdomains, the node a label
// value (it is matched against the kubernetes.io/hostname label). Empty
// means the default, or for the storage class, none.
func checkPVFlags(name, storageClass, node string) error {
	for _, f := range []struct {
		flag, value string
		check       func(string) []string
	}{
		{"--name", name, k8sname.Subdomain},
		{"--storage-class", storageClass, k8sname.Subdomain},
		{"--node", node, k8sname.LabelValue},
	} {
		if f.value == "" {
			continue
		}
		if err := checkK8sName(f.flag, f.value, f.check); err != nil {
			return err
		}
	}
	return nil
}

func checkK8sName(what, value string, check func(string) []string) error {
	if errs := check(value); len(errs) > 0 {
		return usagef("%s %s: %s", what, volume.Quote(value), strings.Join(errs, "; "))
	}
	return nil
}

// persistentVolume is the part of Kubernetes' core/v1 PersistentVolume
// that `sparsevol pv` writes, with the API's field names. It is declared
// here rather than taken from k8s.io/api: that package tree costs every
// start of every node command its package initialisation (a test checks
// the manifest against the real type).
type persistentVolume struct {
	APIVersion string     `json:"apiVersion"`
	Kind       string     `json:"kind"`
	Metadata   objectMeta `json:"metadata"`
	Spec       pvSpec     `json:"spec"`
}

type objectMeta struct {
	Name   string            `json:"name"`
	Labels map[string]string `json:"labels,omitempty"`
}

type pvSpec struct {
	Capacity                      map[string]string `json:"capacity"`
	VolumeMode                    string            `json:"volumeMode"`
	AccessModes                   []string          `json:"accessModes"`
	PersistentVolumeReclaimPolicy string            `json:"persistentVolumeReclaimPolicy"`
	StorageClassName              string            `json:"storageClassName,omitempty"`
	Local                         localSource       `json:"local"`
	NodeAffinity                  nodeAffinity      `json:"nodeAffinity"`
}

type localSource struct {
	Path   string `json:"path"`
	FSType string `json:"fsType,omitempty"`
}

type nodeAffinity struct {
	Required struct {
		NodeSelectorTerms []nodeSelectorTerm `json:"nodeSelectorTerms"`
	} `json:"required"`
}

type nodeSelectorTerm struct {
	MatchExpressions []nodeSelectorRequirement `json:"matchExpressions"`
}

type nodeSelectorRequirement struct {
	Key      string   `json:"key"`
	Operator string   `json:"operator"`
	Values   []string `json:"values"`
}

// pvManifest is what `sparsevol pv` prints for pv: indented JSON, which
// every Kubernetes client reads as it reads YAML (JSON is YAML). A YAML
// encoder would cost every node command its package initialisation.
func pvManifest(pv *persistentVolume) ([]byte, error) {
	data, err := json.MarshalIndent(pv, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encode the PersistentVolume: %w", err)
	}
	return append(data, '\n'), nil
}

func buildPV(v *volume.Volume, name, storageClass, node string) *persistentVolume {
	if name == "" {
		name = v.Name
		if len(k8sname.Subdomain(name)) > 0 {
			name = "sparsevol-" + v.UUID
		}
	}
	pv := &persistentVolume{
		APIVersion: "v1",
		Kind:       "PersistentVolume",
		Metadata: objectMeta{
			Name: name,
			Labels: map[string]string{
				"app.kubernetes.io/managed-by": "sparsevol",
				"sparsevol.io/uuid":            v.UUID,
			},
		},
		Spec: pvSpec{
			// A quantity: FormatSize's units are Kubernetes' binary
			// suffixes; a size in no whole unit is a plain byte count.
			Capacity:                      map[string]string{"storage": strings.TrimSuffix(volume.FormatSize(v.SizeBytes), "B")},
			VolumeMode:                    "Filesystem",
			AccessModes:                   []string{"ReadWriteOnce"},
			PersistentVolumeReclaimPolicy: "Retain",
			StorageClassName:              storageClass,
			Local:                         localSource{Path: v.StablePath()},
		},
	}
	if v.Mode == volume.ModeBlock {
		pv.Spec.VolumeMode = "Block"
	} else {
		pv.Spec.Local.FSType = v.FSType
	}
	pv.Spec.NodeAffinity.Required.NodeSelectorTerms = []nodeSelectorTerm{{
		MatchExpressions: []nodeSelectorRequirement{{Key: "kubernetes.io/hostname", Operator: "In", Values: []string{node}}},
	}}
	return pv
}
