package cli

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestPVManifest: what `sparsevol pv` writes decodes strictly, with the
// YAML decoder Kubernetes' clients use, as Kubernetes' own
// PersistentVolume, with the volume's size, path, mode and filesystem,
// and the node pinned.
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
			data, err := pvManifest(buildPV(&tt.v, "", "local", "node-1"))
			if err != nil {
				t.Fatal(err)
			}
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

// TestDefaultNodeAsKubeletNamesIt: without --node the manifest is pinned
// to the name kubelet gives this node and its kubernetes.io/hostname
// label, the host name lowercased: a host named Node1 is node1, which a
// nodeAffinity of Node1 would never match (the pod stays Pending).
func TestDefaultNodeAsKubeletNamesIt(t *testing.T) {
	saved := hostname
	t.Cleanup(func() { hostname = saved })
	for _, tc := range []struct{ host, want string }{
		{"node-1", "node-1"},
		{"Node1", "node1"},
		{"WORKER-3.Example.COM", "worker-3.example.com"},
	} {
		hostname = func() (string, error) { return tc.host, nil }
		if got, err := defaultNode(); err != nil || got != tc.want {
			t.Errorf("defaultNode() on host %q = %q, %v; want %q", tc.host, got, err, tc.want)
		}
	}
}
