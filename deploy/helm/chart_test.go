// Package helm tests the Helm chart deploy/helm/sparsevol: with default
// values it renders the objects `kubectl apply -k deploy/kubernetes` makes
// (one truth: deploy/kubernetes' own test checks those against the
// binary), `helm lint` finds nothing wrong, and each value does what it
// says. Its own module: Helm and kustomize stay out of the main go.mod.
package helm

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

const (
	chartDir  = "sparsevol"
	kustomize = "../kubernetes"
	namespace = "sparsevol"
)

// snapshotClass is a VolumeSnapshotClass or VolumeGroupSnapshotClass
// (CRDs: their types are not in k8s.io/api), strictly decoded.
type snapshotClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Driver            string            `json:"driver"`
	DeletionPolicy    string            `json:"deletionPolicy"`
	Parameters        map[string]string `json:"parameters,omitempty"`
}

// objects are decoded manifests by kind/namespace/name.
type objects map[string]any

// decode splits a YAML stream and decodes each document strictly into
// its typed object.
func decode(t *testing.T, what, stream string) objects {
	t.Helper()
	out := objects{}
	for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(stream, -1) {
		var head struct {
			APIVersion string            `json:"apiVersion"`
			Kind       string            `json:"kind"`
			Metadata   metav1.ObjectMeta `json:"metadata"`
		}
		if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
			t.Fatalf("%s document %d: %v", what, i+1, err)
		}
		if head.Kind == "" {
			continue // comments only
		}
		var obj any
		switch head.APIVersion + " " + head.Kind {
		case "v1 Namespace":
			obj = &corev1.Namespace{}
		case "v1 ServiceAccount":
			obj = &corev1.ServiceAccount{}
		case "v1 Service":
			obj = &corev1.Service{}
		case "rbac.authorization.k8s.io/v1 ClusterRole":
			obj = &rbacv1.ClusterRole{}
		case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
			obj = &rbacv1.ClusterRoleBinding{}
		case "rbac.authorization.k8s.io/v1 Role":
			obj = &rbacv1.Role{}
		case "rbac.authorization.k8s.io/v1 RoleBinding":
			obj = &rbacv1.RoleBinding{}
		case "storage.k8s.io/v1 CSIDriver":
			obj = &storagev1.CSIDriver{}
		case "storage.k8s.io/v1 StorageClass":
			obj = &storagev1.StorageClass{}
		case "apps/v1 DaemonSet":
			obj = &appsv1.DaemonSet{}
		case "snapshot.storage.k8s.io/v1 VolumeSnapshotClass", "groupsnapshot.storage.k8s.io/v1 VolumeGroupSnapshotClass":
			obj = &snapshotClass{}
		default:
			t.Fatalf("%s document %d: unexpected %s %s", what, i+1, head.APIVersion, head.Kind)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			t.Fatalf("%s document %d (%s %s): strict decoding: %v", what, i+1, head.Kind, head.Metadata.Name, err)
		}
		key := head.Kind + "/" + head.Metadata.Namespace + "/" + head.Metadata.Name
		if _, dup := out[key]; dup {
			t.Fatalf("%s: %s twice", what, key)
		}
		out[key] = obj
	}
	return out
}

// renderChart renders the chart as `helm install -n sparsevol` would.
func renderChart(t *testing.T, values map[string]any) (objects, error) {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	vals, err := chartutil.ToRenderValues(ch, values,
		chartutil.ReleaseOptions{Name: "sparsevol", Namespace: namespace, IsInstall: true}, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	files, err := engine.Render(ch, vals)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	var stream strings.Builder
	for _, n := range names {
		if strings.HasSuffix(n, ".yaml") {
			stream.WriteString("\n---\n" + files[n])
		}
	}
	return decode(t, "chart", stream.String()), nil
}

func mustRenderChart(t *testing.T, values map[string]any) objects {
	t.Helper()
	objs, err := renderChart(t, values)
	if err != nil {
		t.Fatalf("render with %v: %v", values, err)
	}
	return objs
}

// renderKustomize builds dir of fs as `kubectl apply -k` would.
func renderKustomize(t *testing.T, fs filesys.FileSystem, dir string) objects {
	t.Helper()
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fs, dir)
	if err != nil {
		t.Fatalf("kustomize %s: %v", dir, err)
	}
	y, err := m.AsYaml()
	if err != nil {
		t.Fatal(err)
	}
	return decode(t, "kustomize", string(y))
}

// TestDefaultsAreKustomize: the chart with default values is the
// kustomize output, object for object, but for the Namespace (Helm
// installs into a namespace that exists; see values.yaml).
func TestDefaultsAreKustomize(t *testing.T) {
	chart := mustRenderChart(t, nil)
	kust := renderKustomize(t, filesys.MakeFsOnDisk(), kustomize)
	for key, k := range kust {
		c, ok := chart[key]
		if !ok {
			if strings.HasPrefix(key, "Namespace//") {
				continue
			}
			t.Errorf("%s: kustomize makes it, the chart does not", key)
			continue
		}
		if !reflect.DeepEqual(c, k) {
			cy, _ := yaml.Marshal(c)
			ky, _ := yaml.Marshal(k)
			t.Errorf("%s differs:\n%s", key, lineDiff(string(ky), string(cy)))
		}
	}
	for key := range chart {
		if _, ok := kust[key]; !ok {
			t.Errorf("%s: the chart makes it, kustomize does not", key)
		}
	}
	if _, ok := kust["Namespace//"+namespace]; !ok {
		t.Errorf("kustomize makes no Namespace %s: the chart's namespace note is stale", namespace)
	}
}

// lineDiff lists the lines only in a (-, kustomize) or only in b (+, chart).
func lineDiff(a, b string) string {
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	var out []string
	for _, l := range al {
		if !slices.Contains(bl, l) {
			out = append(out, "- "+l)
		}
	}
	for _, l := range bl {
		if !slices.Contains(al, l) {
			out = append(out, "+ "+l)
		}
	}
	return strings.Join(out, "\n")
}

func TestLint(t *testing.T) {
	l := action.NewLint()
	l.Namespace = namespace
	l.Strict = true
	res := l.Run([]string{chartDir}, nil)
	for _, m := range res.Messages {
		if m.Severity > support.InfoSev {
			t.Errorf("helm lint: %s", m)
		} else {
			t.Logf("helm lint: %s", m)
		}
	}
	for _, err := range res.Errors {
		t.Errorf("helm lint: %v", err)
	}
}

func daemonSet(t *testing.T, objs objects) *appsv1.DaemonSet {
	t.Helper()
	ds, ok := objs["DaemonSet/"+namespace+"/sparsevol-csi"].(*appsv1.DaemonSet)
	if !ok {
		t.Fatal("no DaemonSet sparsevol-csi")
	}
	return ds
}

func containerNames(ds *appsv1.DaemonSet) []string {
	var n []string
	for _, c := range ds.Spec.Template.Spec.Containers {
		n = append(n, c.Name)
	}
	return n
}

func kinds(objs objects, kind string) []string {
	var n []string
	for k := range objs {
		if strings.HasPrefix(k, kind+"/") {
			n = append(n, k)
		}
	}
	sort.Strings(n)
	return n
}

// TestValues: each value changes what it says and nothing breaks.
func TestValues(t *testing.T) {
	t.Run("image", func(t *testing.T) {
		ds := daemonSet(t, mustRenderChart(t, map[string]any{"image": map[string]any{"repository": "registry.example/sv", "tag": "v9"}}))
		if got := ds.Spec.Template.Spec.Containers[0].Image; got != "registry.example/sv:v9" {
			t.Errorf("plugin image %s", got)
		}
	})
	t.Run("storeDir and overcommitRatio", func(t *testing.T) {
		ds := daemonSet(t, mustRenderChart(t, map[string]any{"storeDir": "/srv/sparsevol", "overcommitRatio": 2}))
		plugin := ds.Spec.Template.Spec.Containers[0]
		if !slices.Equal(plugin.Args[:2], []string{"--root=/srv/sparsevol", "--overcommit-ratio=2"}) {
			t.Errorf("args %q: want the store and the ratio first", plugin.Args)
		}
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if v.Name == "store-dir" && v.HostPath.Path != "/srv/sparsevol" {
				t.Errorf("store hostPath %s", v.HostPath.Path)
			}
		}
		for _, m := range plugin.VolumeMounts {
			if m.Name == "store-dir" && m.MountPath != "/srv/sparsevol" {
				t.Errorf("store mounted at %s: the plugin's --root must be the host path", m.MountPath)
			}
		}
	})
	t.Run("defaultClass", func(t *testing.T) {
		objs := mustRenderChart(t, map[string]any{"defaultClass": "sparsevol-xfs"})
		var defaults []string
		for _, k := range kinds(objs, "StorageClass") {
			if objs[k].(*storagev1.StorageClass).Annotations["storageclass.kubernetes.io/is-default-class"] == "true" {
				defaults = append(defaults, k)
			}
		}
		if !slices.Equal(defaults, []string{"StorageClass//sparsevol-xfs"}) {
			t.Errorf("default classes %v, want sparsevol-xfs alone", defaults)
		}
		if _, err := renderChart(t, map[string]any{"defaultClass": "no-such-class"}); err == nil || !strings.Contains(err.Error(), "no-such-class") {
			t.Errorf("a defaultClass that is no class renders (%v)", err)
		}
	})
	t.Run("which StorageClasses", func(t *testing.T) {
		objs := mustRenderChart(t, map[string]any{
			"storageClasses": []any{map[string]any{"name": "fast", "parameters": map[string]any{"provisioning": "thick"}, "reclaimPolicy": "Retain"}},
			"localClass":     false,
		})
		if got := kinds(objs, "StorageClass"); !slices.Equal(got, []string{"StorageClass//fast"}) {
			t.Fatalf("classes %v, want fast alone", got)
		}
		sc := objs["StorageClass//fast"].(*storagev1.StorageClass)
		if sc.Parameters["provisioning"] != "thick" || sc.ReclaimPolicy == nil || *sc.ReclaimPolicy != corev1.PersistentVolumeReclaimRetain {
			t.Errorf("class fast: %v, reclaim %v", sc.Parameters, sc.ReclaimPolicy)
		}
	})
	t.Run("nodeSelector and tolerations", func(t *testing.T) {
		ds := daemonSet(t, mustRenderChart(t, map[string]any{"nodeSelector": map[string]any{"disk": "nvme"}, "tolerations": []any{}}))
		spec := ds.Spec.Template.Spec
		if spec.NodeSelector["disk"] != "nvme" || len(spec.Tolerations) != 0 {
			t.Errorf("nodeSelector %v, tolerations %v", spec.NodeSelector, spec.Tolerations)
		}
	})
	t.Run("metrics", func(t *testing.T) {
		objs := mustRenderChart(t, map[string]any{"metrics": map[string]any{"port": 9900, "service": false}})
		if got := kinds(objs, "Service"); len(got) != 0 {
			t.Errorf("services %v with metrics.service false", got)
		}
		plugin := daemonSet(t, objs).Spec.Template.Spec.Containers[0]
		if !slices.Contains(plugin.Args, "--metrics-address=:9900") || plugin.Ports[0].ContainerPort != 9900 {
			t.Errorf("args %q, ports %v", plugin.Args, plugin.Ports)
		}
	})
	t.Run("no snapshots, no resizer", func(t *testing.T) {
		objs := mustRenderChart(t, map[string]any{
			"snapshotter": map[string]any{"enabled": false}, "resizer": map[string]any{"enabled": false}, "snapshotClasses": false,
		})
		if got := containerNames(daemonSet(t, objs)); !slices.Equal(got, []string{"sparsevol", "csi-provisioner"}) {
			t.Errorf("containers %v", got)
		}
		if got := append(kinds(objs, "VolumeSnapshotClass"), kinds(objs, "VolumeGroupSnapshotClass")...); len(got) != 0 {
			t.Errorf("snapshot classes %v", got)
		}
	})
}

// TestUdevMounts: whatever the values, the plugin's --udev-dir is the
// node's /run/udev mounted elsewhere than /run/udev (where the plugin
// would take udev for running in its container) and --udev-identity-dir
// the node's /run/sparsevol/udev at the same path (the rule names it),
// both hostPath DirectoryOrCreate, mounted by the plugin alone.
// deploy/kubernetes' test checks the same of the defaults against the
// binary's flags.
func TestUdevMounts(t *testing.T) {
	for _, values := range []map[string]any{
		nil,
		{"storeDir": "/srv/sparsevol", "kubeletDir": "/data/kubelet"},
		{"snapshotter": map[string]any{"enabled": false}, "resizer": map[string]any{"enabled": false}, "snapshotClasses": false},
	} {
		ds := daemonSet(t, mustRenderChart(t, values))
		spec := ds.Spec.Template.Spec
		plugin := spec.Containers[0]
		for _, vm := range plugin.VolumeMounts {
			if p := strings.TrimSuffix(vm.MountPath, "/"); p == "" || p == "/run" || p == "/run/udev" {
				t.Errorf("values %v: the plugin mounts %s at %s: it would take udev for running in its container", values, vm.Name, vm.MountPath)
			}
		}
		for _, want := range []struct{ flag, host string }{
			{"udev-dir", "/run/udev"},
			{"udev-identity-dir", "/run/sparsevol/udev"},
		} {
			dir := ""
			for _, a := range plugin.Args {
				if v, ok := strings.CutPrefix(a, "--"+want.flag+"="); ok {
					dir = v
				}
			}
			var mount *corev1.VolumeMount
			for i, vm := range plugin.VolumeMounts {
				if vm.MountPath == dir {
					mount = &plugin.VolumeMounts[i]
				}
			}
			if mount == nil {
				t.Errorf("values %v: --%s %q is no mount of the plugin's", values, want.flag, dir)
				continue
			}
			var host *corev1.HostPathVolumeSource
			for _, v := range spec.Volumes {
				if v.Name == mount.Name {
					host = v.HostPath
				}
			}
			if host == nil || host.Path != want.host || host.Type == nil || *host.Type != corev1.HostPathDirectoryOrCreate {
				t.Errorf("values %v: --%s %s mounts %+v, want hostPath %s (DirectoryOrCreate)", values, want.flag, dir, host, want.host)
			}
			if want.flag == "udev-dir" && dir == want.host || want.flag == "udev-identity-dir" && dir != want.host {
				t.Errorf("values %v: --%s %s: the node's %s mounted there", values, want.flag, dir, want.host)
			}
			for _, c := range spec.Containers[1:] {
				for _, vm := range c.VolumeMounts {
					if vm.Name == mount.Name {
						t.Errorf("values %v: %s mounts %s: only the plugin uses udev", values, c.Name, vm.Name)
					}
				}
			}
		}
	}
}

// TestKustomizeImages: an overlay's images: entry replaces the plugin
// image, as test/k8s's overlay and an operator's do.
func TestKustomizeImages(t *testing.T) {
	fs := filesys.MakeFsInMemory()
	files, err := filepath.Glob(filepath.Join(kustomize, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s: %v", kustomize, err)
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := fs.WriteFile("/base/"+filepath.Base(f), data); err != nil {
			t.Fatal(err)
		}
	}
	overlay := `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../base
images:
  - name: ghcr.io/sparsevol/sparsevol
    newName: localhost/sparsevol
    newTag: test
`
	if err := fs.WriteFile("/overlay/kustomization.yaml", []byte(overlay)); err != nil {
		t.Fatal(err)
	}
	ds := daemonSet(t, renderKustomize(t, fs, "/overlay"))
	if got := ds.Spec.Template.Spec.Containers[0].Image; got != "localhost/sparsevol:test" {
		t.Errorf("plugin image %s after the overlay", got)
	}
}

// TestHostileValues: a value that flows into a path, a flag or a field the
// plugin pod runs with is refused at render time (values.schema.json)
// unless it has its documented form, so that no value can add a flag,
// an argument or a YAML key of its own.
func TestHostileValues(t *testing.T) {
	inject := "\n            - --kubelet-dir=/"
	tests := []struct {
		name   string
		values map[string]any
	}{
		{"storeDir with a newline", map[string]any{"storeDir": "/var/lib/sparsevol" + inject}},
		{"relative storeDir", map[string]any{"storeDir": "var/lib/sparsevol"}},
		{"storeDir with ..", map[string]any{"storeDir": "/var/lib/../sparsevol"}},
		{"storeDir with a space", map[string]any{"storeDir": "/var/lib/sparse vol"}},
		{"kubeletDir with a newline", map[string]any{"kubeletDir": "/var/lib/kubelet" + inject}},
		{"kubeletDir with a trailing slash", map[string]any{"kubeletDir": "/var/lib/kubelet/"}},
		{"logLevel with a flag", map[string]any{"logLevel": "info" + inject}},
		{"logLevel unknown", map[string]any{"logLevel": "loud"}},
		{"overcommitRatio with a flag", map[string]any{"overcommitRatio": "2" + inject}},
		{"metrics port with a flag", map[string]any{"metrics": map[string]any{"port": "9809" + inject}}},
		{"metrics port out of range", map[string]any{"metrics": map[string]any{"port": 70000}}},
		{"pullPolicy with a key", map[string]any{"image": map[string]any{"pullPolicy": "IfNotPresent\n          privileged: true"}}},
		{"pullPolicy unknown", map[string]any{"image": map[string]any{"pullPolicy": "Sometimes"}}},
		{"image tag with a newline", map[string]any{"image": map[string]any{"tag": "v1\nx"}}},
		// Values of the documented form that the plugin refuses at start
		// (a crash loop) or that make a pod or a class twice.
		{"overcommitRatio zero", map[string]any{"overcommitRatio": "0"}},
		{"overcommitRatio zero, decimal", map[string]any{"overcommitRatio": "0.0"}},
		{"overcommitRatio zeroes", map[string]any{"overcommitRatio": "000"}},
		{"overcommitRatio zero as a number", map[string]any{"overcommitRatio": 0}},
		{"overcommitRatio beyond a float", map[string]any{"overcommitRatio": "1" + strings.Repeat("0", 400)}},
		{"storeDir is kubeletDir", map[string]any{"storeDir": "/var/lib/kubelet"}},
		{"storeDir under kubeletDir", map[string]any{"storeDir": "/data/kubelet/sparsevol", "kubeletDir": "/data/kubelet"}},
		{"storeDir holds kubeletDir", map[string]any{"storeDir": "/var/lib", "kubeletDir": "/var/lib/kubelet"}},
		{"storeDir is /csi", map[string]any{"storeDir": "/csi"}},
		{"storeDir under /dev", map[string]any{"storeDir": "/dev/sparsevol"}},
		{"storeDir under /host", map[string]any{"storeDir": "/host/sys"}},
		{"storeDir is /usr", map[string]any{"storeDir": "/usr"}},
		{"storeDir hides the binary", map[string]any{"storeDir": "/usr/local/bin"}},
		{"storeDir is the udev rule's", map[string]any{"storeDir": "/run/sparsevol/udev"}},
		{"storeDir under /etc", map[string]any{"storeDir": "/etc/sparsevol"}},
		{"a class named sparsevol-local with localClass", map[string]any{"storageClasses": []any{map[string]any{"name": "sparsevol-local"}}}},
		{"two classes of one name", map[string]any{"storageClasses": []any{map[string]any{"name": "fast"}, map[string]any{"name": "fast"}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			objs, err := renderChart(t, tt.values)
			if err == nil {
				plugin := daemonSet(t, objs).Spec.Template.Spec.Containers[0]
				t.Errorf("rendered with %q: args %q, pull policy %q", tt.values, plugin.Args, plugin.ImagePullPolicy)
			}
		})
	}
	for _, ok := range []map[string]any{
		{"storeDir": "/srv/sparsevol", "kubeletDir": "/data/kubelet", "logLevel": "debug", "overcommitRatio": 1.5},
		{"overcommitRatio": "2", "metrics": map[string]any{"port": 9900}, "image": map[string]any{"tag": "v1.2.3", "pullPolicy": "Always"}},
		{"overcommitRatio": "0.5", "storeDir": "/var/lib/kubelet-store", "kubeletDir": "/var/lib/kubelet"},
		{"overcommitRatio": "10", "storeDir": "/usrdata/sparsevol"},
		{"overcommitRatio": "1.0"},
		{"storageClasses": []any{map[string]any{"name": "sparsevol-local"}}, "localClass": false},
	} {
		if _, err := renderChart(t, ok); err != nil {
			t.Errorf("render with %v: %v", ok, err)
		}
	}
}

// TestRBACFollowsSidecars: the ClusterRole grants a sidecar's rules only
// when the sidecar runs. With csi-snapshotter and csi-resizer off, no
// snapshot content is written, no pod listed cluster-wide and no claim
// status patched; csi-provisioner keeps what it reads.
func TestRBACFollowsSidecars(t *testing.T) {
	type grant struct{ resource, verb string }
	sidecars := []grant{
		{"volumesnapshotclasses", "list"},
		{"volumesnapshotcontents", "update"},
		{"volumesnapshotcontents/status", "patch"},
		{"volumegroupsnapshotcontents", "update"},
		{"volumegroupsnapshotcontents/status", "patch"},
		{"pods", "list"},
		{"persistentvolumeclaims/status", "patch"},
	}
	provisioner := []grant{
		{"volumesnapshots", "get"},
		{"volumesnapshotcontents", "get"},
		{"persistentvolumes", "create"},
	}
	grants := func(objs objects) map[grant]bool {
		role, ok := objs["ClusterRole//sparsevol-csi"].(*rbacv1.ClusterRole)
		if !ok {
			t.Fatal("no ClusterRole sparsevol-csi")
		}
		out := map[grant]bool{}
		for _, r := range role.Rules {
			for _, res := range r.Resources {
				for _, v := range r.Verbs {
					out[grant{res, v}] = true
				}
			}
		}
		return out
	}
	on := grants(mustRenderChart(t, nil))
	off := grants(mustRenderChart(t, map[string]any{
		"snapshotter": map[string]any{"enabled": false}, "resizer": map[string]any{"enabled": false}, "snapshotClasses": false,
	}))
	for _, g := range sidecars {
		if !on[g] {
			t.Errorf("default chart does not grant %s %s", g.verb, g.resource)
		}
		if off[g] {
			t.Errorf("chart without snapshotter and resizer grants %s %s", g.verb, g.resource)
		}
	}
	for _, g := range provisioner {
		if !off[g] {
			t.Errorf("chart without snapshotter and resizer does not grant csi-provisioner %s %s", g.verb, g.resource)
		}
	}
}
