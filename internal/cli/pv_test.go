package cli

import (
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestPVManifest: what `sparsevol pv` writes decodes strictly as
// Kubernetes' own PersistentVolume, with the volume's size, path, mode and
// filesystem, and the node pinned.
func TestPVManifest(t *testing.T) {
	tests := []struct {
		name     string
		v        volume.Volume
		wantName string
		wantMode corev1.PersistentVolumeMode
		wantFS   string
		wantSize string
	}{
		{"filesystem", volume.Volume{Name: "data", UUID: "6f1c3a52-2f9e-4d7b-9a51-0c7f2d3e4b5a", SizeBytes: 1 << 30, Mode: volume.ModeFilesystem, FSType: "xfs"},
			"data", corev1.PersistentVolumeFilesystem, "xfs", "1Gi"},
		{"block, odd size, name not a DNS name", volume.Volume{Name: "Data_1", UUID: "0c7f2d3e-2f9e-4d7b-9a51-6f1c3a524b5a", SizeBytes: 1000, Mode: volume.ModeBlock},
			"sparsevol-0c7f2d3e-2f9e-4d7b-9a51-6f1c3a524b5a", corev1.PersistentVolumeBlock, "", "1000"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data := buildPV(&tt.v, "", "local", "node-1").manifest()
			var pv corev1.PersistentVolume
			if err := yaml.UnmarshalStrict(data, &pv); err != nil {
				t.Fatalf("not a PersistentVolume: %v\n%s", err, data)
			}
			size := pv.Spec.Capacity[corev1.ResourceStorage]
			switch {
			case pv.Kind != "PersistentVolume" || pv.APIVersion != "v1" || pv.Name != tt.wantName:
				t.Errorf("kind %q apiVersion %q name %q", pv.Kind, pv.APIVersion, pv.Name)
			case size.Cmp(resource.MustParse(tt.wantSize)) != 0 || size.Value() != tt.v.SizeBytes:
				t.Errorf("capacity %s, want %s (%d bytes)", size.String(), tt.wantSize, tt.v.SizeBytes)
			case pv.Spec.VolumeMode == nil || *pv.Spec.VolumeMode != tt.wantMode:
				t.Errorf("volumeMode %v, want %s", pv.Spec.VolumeMode, tt.wantMode)
			case pv.Spec.Local == nil || pv.Spec.Local.Path != tt.v.StablePath():
				t.Errorf("local %+v, want path %s", pv.Spec.Local, tt.v.StablePath())
			case tt.wantFS != "" && (pv.Spec.Local.FSType == nil || *pv.Spec.Local.FSType != tt.wantFS),
				tt.wantFS == "" && pv.Spec.Local.FSType != nil:
				t.Errorf("fsType %v, want %q", pv.Spec.Local.FSType, tt.wantFS)
			case pv.Spec.StorageClassName != "local" || pv.Spec.PersistentVolumeReclaimPolicy != corev1.PersistentVolumeReclaimRetain ||
				len(pv.Spec.AccessModes) != 1 || pv.Spec.AccessModes[0] != corev1.ReadWriteOnce:
				t.Errorf("spec %+v", pv.Spec)
			case pv.Labels["sparsevol.io/uuid"] != tt.v.UUID:
				t.Errorf("labels %v", pv.Labels)
			}
			terms := pv.Spec.NodeAffinity.Required.NodeSelectorTerms
			if len(terms) != 1 || len(terms[0].MatchExpressions) != 1 {
				t.Fatalf("node affinity %+v", pv.Spec.NodeAffinity)
			}
			if e := terms[0].MatchExpressions[0]; e.Key != "kubernetes.io/hostname" || e.Operator != corev1.NodeSelectorOpIn || len(e.Values) != 1 || e.Values[0] != "node-1" {
				t.Errorf("node affinity %+v", e)
			}
		})
	}
}

// TestPVManifestAsYAMLPackage: the manifest reads back as exactly what
// sigs.k8s.io/yaml writes of the same structs, for names, nodes and
// sizes that a YAML reader could take for numbers, times, booleans or
// null; byte for byte where neither quotes a string.
func TestPVManifestAsYAMLPackage(t *testing.T) {
	uuid := "0c7f2d3e-2f9e-4d7b-9a51-6f1c3a524b5a"
	odd := []string{"node-1", "1000", "1e3", "0x1f", "0b101", "017", "1_000", "2001-12-14", "2001-12-14t21:59:43.10z",
		"1.5", "y", "Y", "yes", "NO", "on", "Off", "true", "null", "Null", "n", "e", "inf", "nan", "1Mi", "1Ti", "12345678-1234",
		"10-0-0-1", "ip-10-0-0-1", "1e", "1z", "a.b", "a_b", "A", "7", uuid, "1f2e3d4c-2f9e-4d7b-9a51-6f1c3a524b5a"}
	for _, name := range odd {
		for _, size := range []int64{1000, 1 << 20, 3 << 40, 1<<30 + 512} {
			v := volume.Volume{Name: name, UUID: uuid, SizeBytes: size, Mode: volume.ModeFilesystem, FSType: "ext4"}
			pv := buildPV(&v, "", name, name)
			want, err := yaml.Marshal(pv)
			if err != nil {
				t.Fatal(err)
			}
			got := pv.manifest()
			var g, w corev1.PersistentVolume
			if err := yaml.UnmarshalStrict(got, &g); err != nil {
				t.Fatalf("name %q: not a PersistentVolume: %v\n%s", name, err, got)
			}
			if err := yaml.UnmarshalStrict(want, &w); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(g, w) {
				t.Errorf("name %q: manifest reads as\n%+v\nsigs.k8s.io/yaml's as\n%+v\n%s", name, g, w, got)
			}
			if !strings.Contains(string(want)+string(got), `"`) && string(got) != string(want) {
				t.Errorf("name %q: manifest\n%s\nsigs.k8s.io/yaml's\n%s", name, got, want)
			}
		}
	}
	if got := buildPV(&volume.Volume{Name: "v", UUID: uuid, SizeBytes: 1 << 20, Mode: volume.ModeBlock}, "", "", "n").manifest(); strings.Contains(string(got), "storageClassName") {
		t.Errorf("no storage class, yet:\n%s", got)
	}
}

// TestK8sNameRules: the name rules give what apimachinery's do, messages
// included, for every string of up to four bytes over the characters
// that matter and for lengths around the limits.
func TestK8sNameRules(t *testing.T) {
	alphabet := []string{"a", "Z", "0", "-", "_", ".", " ", "/", "\u00e9"}
	cases := []string{""}
	for prev, n := []string{""}, 0; n < 4; n++ {
		var next []string
		for _, p := range prev {
			for _, c := range alphabet {
				next = append(next, p+c)
			}
		}
		cases, prev = append(cases, next...), next
	}
	for _, n := range []int{62, 63, 64, 252, 253, 254} {
		cases = append(cases, strings.Repeat("a", n), strings.Repeat("a.", n/2)+"a", "-"+strings.Repeat("a", n))
	}
	for _, s := range cases {
		if got, want := isDNS1123Subdomain(s), validation.IsDNS1123Subdomain(s); !reflect.DeepEqual(got, want) {
			t.Errorf("isDNS1123Subdomain(%q) = %q, want %q", s, got, want)
		}
		if got, want := isLabelValue(s), validation.IsValidLabelValue(s); !reflect.DeepEqual(got, want) {
			t.Errorf("isLabelValue(%q) = %q, want %q", s, got, want)
		}
	}
}
