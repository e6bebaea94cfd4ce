package cli

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// PVStorageClass is the storageClassName `sparsevol pv` gives by default:
// deploy/kubernetes ships it (no provisioner, WaitForFirstConsumer).
const PVStorageClass = "sparsevol-local"

func newPVCommand(g *globals) *cobra.Command {
	var storageClass, node, name string
	cmd := &cobra.Command{
		Use: "pv VOLUME [--storage-class SC] [--node NODE]",
		Example: `  sparsevol pv data > data-pv.yaml && kubectl apply -f data-pv.yaml
  sparsevol pv data --storage-class local --name data-on-node1`,
		Short: "Print a local PersistentVolume for a volume (node mode, static PVs)",
		Long: `Print a 'local' PersistentVolume whose path is the volume's stable path
(/dev/disk/by-uuid/<uuid>, /dev/disk/by-partuuid/<uuid>, or /dev/sparsevol/<uuid>
for whole raw volumes), pinned to this node with nodeAffinity.`,
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
			if node == "" {
				if node, err = os.Hostname(); err != nil {
					return err
				}
				if err := checkK8sName("node (this host's name)", node, isLabelValue); err != nil {
					return err
				}
			}
			_, err = g.stdout.Write(buildPV(v, name, storageClass, node).manifest())
			return err
		},
	}
	cmd.Flags().StringVar(&storageClass, "storage-class", PVStorageClass, "storageClassName of the PV (empty: none)")
	cmd.Flags().StringVar(&node, "node", "", "node name for nodeAffinity (default: this host's name)")
	cmd.Flags().StringVar(&name, "name", "", "PV name (default: the volume name if it is a valid name, else sparsevol-<uuid>)")
	return cmd
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
		{"--name", name, isDNS1123Subdomain},
		{"--storage-class", storageClass, isDNS1123Subdomain},
		{"--node", node, isLabelValue},
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
		return usagef("%s %q: %s", what, value, strings.Join(errs, "; "))
	}
	return nil
}

// persistentVolume is the part of Kubernetes' core/v1 PersistentVolume
// that `sparsevol pv` writes, with the API's field names. It is declared
// here rather than taken from k8s.io/api, and written by manifest rather
// than a YAML package: those package trees cost every start of every node
// command their package initialisation (tests decode the manifest as the
// real type, and against what sigs.k8s.io/yaml makes of these structs).
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

func buildPV(v *volume.Volume, name, storageClass, node string) *persistentVolume {
	if name == "" {
		name = v.Name
		if len(isDNS1123Subdomain(name)) > 0 {
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

// manifest is pv as YAML, laid out as sigs.k8s.io/yaml lays it out (keys
// sorted, two spaces a level, a sequence at its key's indentation); each
// string is yamlString's.
func (pv *persistentVolume) manifest() []byte {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	q := yamlString
	sortedMap := func(indent string, m map[string]string) {
		for _, k := range slices.Sorted(maps.Keys(m)) {
			w("%s%s: %s\n", indent, q(k), q(m[k]))
		}
	}
	w("apiVersion: %s\nkind: %s\nmetadata:\n", q(pv.APIVersion), q(pv.Kind))
	if len(pv.Metadata.Labels) > 0 {
		w("  labels:\n")
		sortedMap("    ", pv.Metadata.Labels)
	}
	sp := pv.Spec
	w("  name: %s\nspec:\n  accessModes:\n", q(pv.Metadata.Name))
	for _, m := range sp.AccessModes {
		w("  - %s\n", q(m))
	}
	w("  capacity:\n")
	sortedMap("    ", sp.Capacity)
	w("  local:\n")
	if sp.Local.FSType != "" {
		w("    fsType: %s\n", q(sp.Local.FSType))
	}
	w("    path: %s\n  nodeAffinity:\n    required:\n      nodeSelectorTerms:\n", q(sp.Local.Path))
	for _, t := range sp.NodeAffinity.Required.NodeSelectorTerms {
		w("      - matchExpressions:\n")
		for _, e := range t.MatchExpressions {
			w("        - key: %s\n          operator: %s\n          values:\n", q(e.Key), q(e.Operator))
			for _, v := range e.Values {
				w("          - %s\n", q(v))
			}
		}
	}
	w("  persistentVolumeReclaimPolicy: %s\n", q(sp.PersistentVolumeReclaimPolicy))
	if sp.StorageClassName != "" {
		w("  storageClassName: %s\n", q(sp.StorageClassName))
	}
	w("  volumeMode: %s\n", q(sp.VolumeMode))
	return []byte(b.String())
}

// yamlString is s as a YAML scalar that reads back as the string s: plain
// where no YAML 1.1 reader can take it for anything else (a number, a
// time, a boolean, null, or syntax), else double-quoted. Plain: letters,
// digits and "._/-" only, starting with a letter or '/', or with a digit
// where a letter no number or time has follows, or a UUID; and none of
// YAML 1.1's words for booleans and null.
func yamlString(s string) string {
	plain := s != "" && strings.Trim(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._/-") == ""
	switch {
	case !plain:
	case 'a' <= s[0]|0x20 && s[0]|0x20 <= 'z' || s[0] == '/':
	case '0' <= s[0] && s[0] <= '9':
		plain = volume.ValidUUID(s) || strings.Trim(s, "0123456789._/-abcdefABCDEFbBoOxXeEtTzZ") != ""
	default:
		plain = false
	}
	switch s {
	case "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO",
		"true", "True", "TRUE", "false", "False", "FALSE",
		"on", "On", "ON", "off", "Off", "OFF", "null", "Null", "NULL":
		plain = false
	}
	if plain {
		return s
	}
	return strconv.QuoteToASCII(s)
}

// Kubernetes' rules for the names in the manifest, with its messages word
// for word, as k8s.io/apimachinery's util/validation states them; written
// out rather than imported, for that package's initialisation (regular
// expressions, and klog and net) ran at every start of every node
// command. A test holds them to apimachinery's.
const (
	dns1123SubdomainMaxLength = 253
	dns1123SubdomainError     = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
	labelValueMaxLength       = 63
	labelValueError           = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)

// isDNS1123Subdomain is apimachinery's IsDNS1123Subdomain: the problems
// with value as an RFC 1123 subdomain (an object name), none if it is one.
func isDNS1123Subdomain(value string) []string {
	var errs []string
	if len(value) > dns1123SubdomainMaxLength {
		errs = append(errs, maxLenError(dns1123SubdomainMaxLength, "characters"))
	}
	for label := range strings.SplitSeq(value, ".") {
		if !edgedBy(label, isLowerAlnum, func(c byte) bool { return isLowerAlnum(c) || c == '-' }) {
			return append(errs, dns1123SubdomainError)
		}
	}
	return errs
}

// isLabelValue is apimachinery's IsValidLabelValue: the problems with
// value as a label value, none if it is one (empty is one).
func isLabelValue(value string) []string {
	var errs []string
	if len(value) > labelValueMaxLength {
		errs = append(errs, maxLenError(labelValueMaxLength, "bytes"))
	}
	if value != "" && !edgedBy(value, isAlnum, func(c byte) bool { return isAlnum(c) || c == '-' || c == '_' || c == '.' }) {
		errs = append(errs, labelValueError)
	}
	return errs
}

func maxLenError(n int, unit string) string {
	return fmt.Sprintf("must be no more than %d %s", n, unit)
}

// edgedBy reports whether s is not empty, starts and ends with a byte
// edge accepts, and has only bytes inner accepts between.
func edgedBy(s string, edge, inner func(byte) bool) bool {
	if s == "" || !edge(s[0]) || !edge(s[len(s)-1]) {
		return false
	}
	for i := 1; i < len(s)-1; i++ {
		if !inner(s[i]) {
			return false
		}
	}
	return true
}

func isLowerAlnum(c byte) bool { return 'a' <= c && c <= 'z' || '0' <= c && c <= '9' }

func isAlnum(c byte) bool { return isLowerAlnum(c) || 'A' <= c && c <= 'Z' }
