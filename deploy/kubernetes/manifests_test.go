// Package kubernetes holds the Kubernetes manifests of the CSI driver; its
// test proves that kustomization.yaml lists them all, that they decode
// strictly and agree with each other and with the flags of the binary they
// run.
package kubernetes

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/sparsevol/sparsevol/internal/cli"
	"github.com/sparsevol/sparsevol/internal/csi"
	"github.com/sparsevol/sparsevol/internal/kubelet"
	"github.com/sparsevol/sparsevol/internal/plugincli"
	"github.com/sparsevol/sparsevol/internal/systemd"
	"github.com/sparsevol/sparsevol/internal/udev"
)

// manifests is every object of every YAML file here, decoded strictly.
type manifests struct {
	namespaces          []*corev1.Namespace
	serviceAccounts     []*corev1.ServiceAccount
	clusterRoles        []*rbacv1.ClusterRole
	clusterRoleBindings []*rbacv1.ClusterRoleBinding
	roles               []*rbacv1.Role
	roleBindings        []*rbacv1.RoleBinding
	drivers             []*storagev1.CSIDriver
	daemonSets          []*appsv1.DaemonSet
	services            []*corev1.Service
	storageClasses      []*storagev1.StorageClass
	snapshotClasses     []*snapshotClass
	kustomization       kustomization
}

// snapshotClass is a VolumeSnapshotClass or VolumeGroupSnapshotClass (the
// same fields; their Go types live in external-snapshotter, which the
// main module does not depend on).
type snapshotClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Driver            string            `json:"driver"`
	DeletionPolicy    string            `json:"deletionPolicy"`
	Parameters        map[string]string `json:"parameters,omitempty"`
}

// kustomization is the part of kustomization.yaml this test reads.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
	Images     []struct {
		Name    string `json:"name"`
		NewName string `json:"newName,omitempty"`
		NewTag  string `json:"newTag,omitempty"`
	} `json:"images"`
}

// load decodes the files kustomization.yaml lists; every other YAML file
// here must be one of them.
func load(t *testing.T) *manifests {
	t.Helper()
	m := &manifests{}
	data, err := os.ReadFile("kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict(data, &m.kustomization); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	files := m.kustomization.Resources
	all, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range all {
		if f != "kustomization.yaml" && !slices.Contains(files, f) {
			t.Errorf("%s is not in kustomization.yaml's resources: `kubectl apply -k` would leave it out", f)
		}
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(data), -1) {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			where := fmt.Sprintf("%s document %d", f, i+1)
			var head struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
			}
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				t.Fatalf("%s: %v", where, err)
			}
			var obj any
			switch head.APIVersion + " " + head.Kind {
			case "v1 Namespace":
				obj = appendNew(&m.namespaces)
			case "v1 ServiceAccount":
				obj = appendNew(&m.serviceAccounts)
			case "rbac.authorization.k8s.io/v1 ClusterRole":
				obj = appendNew(&m.clusterRoles)
			case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
				obj = appendNew(&m.clusterRoleBindings)
			case "rbac.authorization.k8s.io/v1 Role":
				obj = appendNew(&m.roles)
			case "rbac.authorization.k8s.io/v1 RoleBinding":
				obj = appendNew(&m.roleBindings)
			case "storage.k8s.io/v1 CSIDriver":
				obj = appendNew(&m.drivers)
			case "apps/v1 DaemonSet":
				obj = appendNew(&m.daemonSets)
			case "v1 Service":
				obj = appendNew(&m.services)
			case "storage.k8s.io/v1 StorageClass":
				obj = appendNew(&m.storageClasses)
			case "snapshot.storage.k8s.io/v1 VolumeSnapshotClass", "groupsnapshot.storage.k8s.io/v1 VolumeGroupSnapshotClass":
				obj = appendNew(&m.snapshotClasses)
			default:
				t.Fatalf("%s: unexpected %s %s", where, head.APIVersion, head.Kind)
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s: strict decoding: %v", where, err)
			}
		}
	}
	return m
}

func appendNew[T any](list *[]*T) *T {
	v := new(T)
	*list = append(*list, v)
	return v
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

func one[T any](t *testing.T, what string, list []*T) *T {
	t.Helper()
	if len(list) != 1 {
		t.Fatalf("want exactly one %s, have %d", what, len(list))
	}
	return list[0]
}

func TestManifests(t *testing.T) {
	m := load(t)
	ns := one(t, "Namespace", m.namespaces).Name
	sa := one(t, "ServiceAccount", m.serviceAccounts)
	driver := one(t, "CSIDriver", m.drivers)
	ds := one(t, "DaemonSet", m.daemonSets)

	t.Run("namespaces and RBAC agree", func(t *testing.T) {
		for what, got := range map[string]string{
			"ServiceAccount": sa.Namespace, "DaemonSet": ds.Namespace, "Service": one(t, "Service", m.services).Namespace,
			"Role": one(t, "Role", m.roles).Namespace, "RoleBinding": one(t, "RoleBinding", m.roleBindings).Namespace,
		} {
			if got != ns {
				t.Errorf("%s is in namespace %q, want %q", what, got, ns)
			}
		}
		if ds.Spec.Template.Spec.ServiceAccountName != sa.Name {
			t.Errorf("DaemonSet runs as %q, the ServiceAccount is %q", ds.Spec.Template.Spec.ServiceAccountName, sa.Name)
		}
		crb, rb := one(t, "ClusterRoleBinding", m.clusterRoleBindings), one(t, "RoleBinding", m.roleBindings)
		if crb.RoleRef.Kind != "ClusterRole" || crb.RoleRef.Name != one(t, "ClusterRole", m.clusterRoles).Name {
			t.Errorf("ClusterRoleBinding refers to %s %q", crb.RoleRef.Kind, crb.RoleRef.Name)
		}
		if rb.RoleRef.Kind != "Role" || rb.RoleRef.Name != m.roles[0].Name {
			t.Errorf("RoleBinding refers to %s %q", rb.RoleRef.Kind, rb.RoleRef.Name)
		}
		for _, subjects := range [][]rbacv1.Subject{crb.Subjects, rb.Subjects} {
			if len(subjects) != 1 || subjects[0].Kind != "ServiceAccount" || subjects[0].Name != sa.Name || subjects[0].Namespace != ns {
				t.Errorf("binding subjects %+v, want the ServiceAccount %s/%s", subjects, ns, sa.Name)
			}
		}
		if !grants(m.roles[0].Rules, "storage.k8s.io", "csistoragecapacities", "create") {
			t.Error("the Role does not let the provisioner publish CSIStorageCapacity")
		}
		// What each sidecar needs to start and work (its informers and
		// writes), from their own deploy/kubernetes/rbac.yaml.
		for _, need := range []struct{ group, resource, verb string }{
			{"", "persistentvolumes", "create"}, {"", "persistentvolumes", "patch"}, {"", "persistentvolumes", "watch"},
			{"", "persistentvolumeclaims", "watch"}, {"", "persistentvolumeclaims/status", "patch"},
			{"", "pods", "list"}, {"", "pods", "watch"}, // csi-resizer's pod informer
			{"", "events", "create"}, {"", "nodes", "get"}, {"storage.k8s.io", "csinodes", "watch"},
			{"storage.k8s.io", "storageclasses", "watch"}, {"storage.k8s.io", "volumeattributesclasses", "watch"},
			// csi-snapshotter, and csi-provisioner restoring a snapshot
			{"snapshot.storage.k8s.io", "volumesnapshots", "get"}, {"snapshot.storage.k8s.io", "volumesnapshots", "update"}, {"snapshot.storage.k8s.io", "volumesnapshotclasses", "watch"},
			{"snapshot.storage.k8s.io", "volumesnapshotcontents", "watch"}, {"snapshot.storage.k8s.io", "volumesnapshotcontents", "update"},
			{"snapshot.storage.k8s.io", "volumesnapshotcontents/status", "patch"},
			{"groupsnapshot.storage.k8s.io", "volumegroupsnapshotclasses", "watch"},
			{"groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "update"},
			{"groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents/status", "patch"},
		} {
			if !grants(m.clusterRoles[0].Rules, need.group, need.resource, need.verb) {
				t.Errorf("the ClusterRole does not grant %s on %s", need.verb, need.resource)
			}
		}
	})

	t.Run("CSIDriver", func(t *testing.T) {
		if driver.Name != csi.DefaultDriverName {
			t.Errorf("CSIDriver %q, the binary's default driver name is %q", driver.Name, csi.DefaultDriverName)
		}
		if driver.Spec.AttachRequired == nil || *driver.Spec.AttachRequired {
			t.Error("attachRequired must be false: there is no ControllerPublishVolume")
		}
		if driver.Spec.StorageCapacity == nil || !*driver.Spec.StorageCapacity {
			t.Error("storageCapacity must be true: the provisioner publishes per-node capacity")
		}
	})

	t.Run("StorageClasses", func(t *testing.T) {
		names := map[string]bool{}
		for _, sc := range m.storageClasses {
			names[sc.Name] = true
			if v, ok := sc.Annotations["storageclass.kubernetes.io/is-default-class"]; ok {
				t.Errorf("StorageClass %s: is-default-class %q; none is the default unless asked (a cluster with a default would have two)", sc.Name, v)
			}
			if sc.VolumeBindingMode == nil || *sc.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
				t.Errorf("StorageClass %s: volumes must be bound on the pod's node (WaitForFirstConsumer)", sc.Name)
			}
			if sc.Name == cli.PVStorageClass {
				// `sparsevol pv` volumes: made on the node, never provisioned.
				if sc.Provisioner != "kubernetes.io/no-provisioner" {
					t.Errorf("StorageClass %s: provisioner %q, want kubernetes.io/no-provisioner", sc.Name, sc.Provisioner)
				}
				continue
			}
			if sc.Provisioner != driver.Name {
				t.Errorf("StorageClass %s: provisioner %q, want %q", sc.Name, sc.Provisioner, driver.Name)
			}
			if sc.AllowVolumeExpansion == nil || !*sc.AllowVolumeExpansion {
				t.Errorf("StorageClass %s: allowVolumeExpansion must be true", sc.Name)
			}
			if err := csi.ValidateParameters(sc.Parameters); err != nil {
				t.Errorf("StorageClass %s: the driver would refuse its parameters: %v", sc.Name, err)
			}
		}
		for _, want := range []string{"sparsevol-ext4", "sparsevol-xfs", "sparsevol-block", "sparsevol-thick", cli.PVStorageClass} {
			if !names[want] {
				t.Errorf("StorageClass %s is missing", want)
			}
		}
	})

	t.Run("snapshot classes", func(t *testing.T) {
		kinds := map[string]bool{}
		for _, c := range m.snapshotClasses {
			kinds[c.Kind] = true
			if c.Driver != driver.Name {
				t.Errorf("%s %s: driver %q, want %q", c.Kind, c.Name, c.Driver, driver.Name)
			}
			if c.DeletionPolicy != "Delete" && c.DeletionPolicy != "Retain" {
				t.Errorf("%s %s: deletionPolicy %q, want Delete or Retain", c.Kind, c.Name, c.DeletionPolicy)
			}
			if len(c.Parameters) > 0 {
				t.Errorf("%s %s: parameters %v; snapshots take none", c.Kind, c.Name, c.Parameters)
			}
		}
		for _, want := range []string{"VolumeSnapshotClass", "VolumeGroupSnapshotClass"} {
			if !kinds[want] {
				t.Errorf("no %s", want)
			}
		}
	})
	t.Run("DaemonSet", func(t *testing.T) { checkDaemonSet(t, ds, driver.Name) })
	t.Run("metrics Service", func(t *testing.T) { checkService(t, one(t, "Service", m.services), ds) })
	t.Run("kustomize images", func(t *testing.T) { checkImages(t, m.kustomization, ds) })
	t.Run("Dockerfile", func(t *testing.T) { checkDockerfile(t, ds) })
}

func grants(rules []rbacv1.PolicyRule, group, resource, verb string) bool {
	for _, r := range rules {
		if slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, verb) {
			return true
		}
	}
	return false
}

func container(t *testing.T, ds *appsv1.DaemonSet, name string) *corev1.Container {
	t.Helper()
	for i := range ds.Spec.Template.Spec.Containers {
		if c := &ds.Spec.Template.Spec.Containers[i]; c.Name == name {
			return c
		}
	}
	t.Fatalf("DaemonSet has no container %q", name)
	return nil
}

// flagValue returns the value of --name=value in args.
func flagValue(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// mountOf returns the host path and mount of the volume mounted at path in c.
func mountOf(t *testing.T, ds *appsv1.DaemonSet, c *corev1.Container, mountPath string) (string, corev1.VolumeMount) {
	t.Helper()
	for _, vm := range c.VolumeMounts {
		if vm.MountPath != mountPath {
			continue
		}
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if v.Name == vm.Name {
				if v.HostPath == nil {
					t.Fatalf("volume %s is not a hostPath", v.Name)
				}
				return v.HostPath.Path, vm
			}
		}
		t.Fatalf("container %s mounts unknown volume %s", c.Name, vm.Name)
	}
	t.Fatalf("container %s mounts nothing at %s", c.Name, mountPath)
	return "", corev1.VolumeMount{}
}

// expandEnv replaces $(VAR) with the container's literal env values;
// fieldRef variables stay as they are.
func expandEnv(c *corev1.Container, s string) string {
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			s = strings.ReplaceAll(s, "$("+e.Name+")", e.Value)
		}
	}
	return s
}

// pluginCommand parses the plugin container's arguments with the real
// command of the plugin binary, so any flag the manifest passes must exist.
func pluginCommand(t *testing.T, c *corev1.Container) *cobra.Command {
	t.Helper()
	if len(c.Command) != 1 || path.Base(c.Command[0]) != plugincli.Name {
		t.Fatalf("plugin command %q, want the %s binary", c.Command, plugincli.Name)
	}
	args := make([]string, len(c.Args))
	for i, a := range c.Args {
		args[i] = expandEnv(c, a)
	}
	cmd := plugincli.NewCommand(io.Discard, io.Discard)
	if err := cmd.ParseFlags(args); err != nil {
		t.Fatalf("args %q: %v", args, err)
	}
	if n := cmd.Flags().NArg(); n != 0 {
		t.Fatalf("args %q leave %d positional arguments", args, n)
	}
	return cmd
}

func checkDaemonSet(t *testing.T, ds *appsv1.DaemonSet, driverName string) {
	plugin := container(t, ds, "sparsevol")
	cmd := pluginCommand(t, plugin)
	get := func(name string) string {
		t.Helper()
		v, err := cmd.Flags().GetString(name)
		if err != nil {
			t.Fatalf("flag --%s: %v", name, err)
		}
		return v
	}

	if plugin.SecurityContext == nil || plugin.SecurityContext.Privileged == nil || !*plugin.SecurityContext.Privileged {
		t.Error("the plugin container must be privileged (loop devices, mounts)")
	}
	if got := get(plugincli.CSIFlagDriverName); got != driverName {
		t.Errorf("plugin serves driver %q, CSIDriver is %q", got, driverName)
	}
	if get(plugincli.CSIFlagNodeID) != "$(NODE_NAME)" || !fieldRefEnv(plugin, "NODE_NAME", "spec.nodeName") {
		t.Error("--node-id must be the node name from the downward API")
	}

	// The CSI socket: the plugin listens where every sidecar connects, in
	// the directory kubelet is told about.
	socket, err := csi.ParseEndpoint(get(plugincli.CSIFlagEndpoint))
	if err != nil {
		t.Fatal(err)
	}
	socketHostDir, _ := mountOf(t, ds, plugin, path.Dir(socket))
	if want := "/var/lib/kubelet/plugins/" + driverName; socketHostDir != want {
		t.Errorf("socket directory on the host is %s, want %s", socketHostDir, want)
	}
	// The sidecars: one container each, nothing the binary does itself.
	sidecars := []string{"csi-provisioner", "csi-snapshotter", "csi-resizer"}
	for _, c := range ds.Spec.Template.Spec.Containers {
		if c.Name != plugin.Name && !slices.Contains(sidecars, c.Name) {
			t.Errorf("container %s: the plugin registers with kubelet and answers /healthz itself; only %q run beside it", c.Name, sidecars)
		}
	}
	for _, name := range sidecars {
		c := container(t, ds, name)
		if !strings.HasPrefix(c.Image, "registry.k8s.io/sig-storage/"+name+":v") {
			t.Errorf("%s image %q is not a pinned registry.k8s.io/sig-storage release", name, c.Image)
		}
		addr, ok := flagValue(c.Args, "csi-address")
		if !ok {
			t.Errorf("%s has no --csi-address", name)
			continue
		}
		if addr != socket {
			t.Errorf("%s connects to %s, the plugin listens on %s", name, addr, socket)
		}
		if hostDir, _ := mountOf(t, ds, c, path.Dir(addr)); hostDir != socketHostDir {
			t.Errorf("%s sees the socket directory %s, the plugin %s", name, hostDir, socketHostDir)
		}
	}
	if got := container(t, ds, "csi-provisioner").Image; !strings.HasSuffix(got, ":v6.4.0") {
		t.Errorf("csi-provisioner %s; the tests prove v6.4.0", got)
	}

	// Native registration: the registration socket in kubelet's plugin
	// registry, which the kubelet directory mount brings in, and the CSI
	// socket announced at its host path.
	if got := get(plugincli.CSIFlagKubeletEndpoint); got != path.Join(socketHostDir, path.Base(socket)) {
		t.Errorf("--%s %s: kubelet finds the socket at %s on the host", plugincli.CSIFlagKubeletEndpoint, got, path.Join(socketHostDir, path.Base(socket)))
	}
	registry := path.Clean(get(plugincli.CSIFlagKubeletRegistration))
	if registry != kubelet.DefaultRegistrationDir {
		t.Errorf("--%s %s, kubelet watches %s", plugincli.CSIFlagKubeletRegistration, registry, kubelet.DefaultRegistrationDir)
	}
	if !strings.HasPrefix(registry+"/", get(plugincli.CSIFlagKubeletDir)+"/") {
		t.Errorf("registration directory %s is not below the mounted kubelet directory", registry)
	}

	// Kubelet's directory at the same path, with mounts propagating back;
	// the plugin accepts node paths below it only.
	kubeletDir := get(plugincli.CSIFlagKubeletDir)
	kubeletHost, kubeletMount := mountOf(t, ds, plugin, kubeletDir)
	if kubeletHost != "/var/lib/kubelet" || kubeletDir != kubeletHost || kubeletMount.MountPropagation == nil || *kubeletMount.MountPropagation != corev1.MountPropagationBidirectional {
		t.Errorf("--%s %s: the kubelet directory must be mounted at the same path with Bidirectional propagation", plugincli.CSIFlagKubeletDir, kubeletDir)
	}
	if devHost, _ := mountOf(t, ds, plugin, "/dev"); devHost != "/dev" {
		t.Error("the host's /dev must be mounted at /dev")
	}
	root := get("root")
	if storeHost, _ := mountOf(t, ds, plugin, root); storeHost != root {
		t.Errorf("the store --root %s is %s on the host; node mode and CSI mode must share one store path", root, storeHost)
	}

	checkUdev(t, ds, plugin, get)

	// Health and metrics: one port, served by the plugin (--metrics-address).
	if plugin.LivenessProbe == nil || plugin.LivenessProbe.HTTPGet == nil {
		t.Fatal("the plugin container has no HTTP liveness probe")
	}
	probe := plugin.LivenessProbe.HTTPGet
	if port := containerPort(t, plugin, probe.Port.String()); port != portOf(t, get(plugincli.CSIFlagMetrics)) || probe.Path != "/healthz" {
		t.Errorf("liveness probe checks %s on port %d, the plugin serves /healthz on %s", probe.Path, port, get(plugincli.CSIFlagMetrics))
	}
	if port := containerPort(t, plugin, "metrics"); port != portOf(t, get(plugincli.CSIFlagMetrics)) {
		t.Errorf("metrics port %d, plugin serves metrics on %s", port, get(plugincli.CSIFlagMetrics))
	}

	prov := container(t, ds, "csi-provisioner")
	for _, want := range []string{"--node-deployment=true", "--enable-capacity=true"} {
		if !slices.Contains(prov.Args, want) {
			t.Errorf("csi-provisioner lacks %s", want)
		}
	}
	for env, field := range map[string]string{"NODE_NAME": "spec.nodeName", "NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"} {
		if !fieldRefEnv(prov, env, field) {
			t.Errorf("csi-provisioner needs %s from %s", env, field)
		}
	}
	// Snapshots are files on the volume's node: each node's snapshotter
	// takes its own (snapshot-controller --enable-distributed-snapshotting).
	snap := container(t, ds, "csi-snapshotter")
	if !slices.Contains(snap.Args, "--node-deployment=true") || !fieldRefEnv(snap, "NODE_NAME", "spec.nodeName") {
		t.Error("csi-snapshotter must run with --node-deployment=true and NODE_NAME from spec.nodeName")
	}
	if got := snap.Image; !strings.HasSuffix(got, ":v8.7.0") {
		t.Errorf("csi-snapshotter %s; the tests prove v8.7.0", got)
	}
}

// checkUdev: --udev-dir is the node's udev runtime directory mounted
// elsewhere than where the plugin would take udev for running in its
// container, --udev-identity-dir the node's identity directory at the
// node's path (the rule names it), both made where missing; only the
// plugin mounts them.
func checkUdev(t *testing.T, ds *appsv1.DaemonSet, plugin *corev1.Container, get func(string) string) {
	t.Helper()
	udevDir, identityDir := get(plugincli.CSIFlagUdevDir), get(plugincli.CSIFlagUdevIdentityDir)
	if udevDir == "" || identityDir == "" {
		t.Fatalf("the plugin is not given --%s and --%s", plugincli.CSIFlagUdevDir, plugincli.CSIFlagUdevIdentityDir)
	}
	if host, vm := mountOf(t, ds, plugin, udevDir); host != string(udev.Host) || hostPathType(t, ds, vm.Name) != corev1.HostPathDirectoryOrCreate {
		t.Errorf("--%s %s is the host's %s (%s), want %s (DirectoryOrCreate)", plugincli.CSIFlagUdevDir, udevDir, host, hostPathType(t, ds, vm.Name), udev.Host)
	}
	for _, vm := range plugin.VolumeMounts {
		if p := path.Clean(vm.MountPath); p == "/" || strings.HasPrefix(string(udev.Host)+"/", p+"/") {
			t.Errorf("the plugin mounts %s at %s: it would take udev for running in its container", vm.Name, vm.MountPath)
		}
	}
	node := systemd.Manager{}.UdevIdentityDir()
	if host, vm := mountOf(t, ds, plugin, identityDir); host != node || identityDir != node || hostPathType(t, ds, vm.Name) != corev1.HostPathDirectoryOrCreate {
		t.Errorf("--%s %s is the host's %s (%s), want the host's %s at the same path (DirectoryOrCreate): the rule reads the node's",
			plugincli.CSIFlagUdevIdentityDir, identityDir, host, hostPathType(t, ds, vm.Name), node)
	}
	udevVolumes := map[string]bool{}
	for _, vm := range plugin.VolumeMounts {
		if vm.MountPath == udevDir || vm.MountPath == identityDir {
			udevVolumes[vm.Name] = true
		}
	}
	for _, c := range ds.Spec.Template.Spec.Containers {
		for _, vm := range c.VolumeMounts {
			if c.Name != plugin.Name && udevVolumes[vm.Name] {
				t.Errorf("container %s mounts %s: only the plugin uses udev", c.Name, vm.Name)
			}
		}
	}
}

// hostPathType is the type of the hostPath volume name.
func hostPathType(t *testing.T, ds *appsv1.DaemonSet, name string) corev1.HostPathType {
	t.Helper()
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.Name == name && v.HostPath != nil {
			if v.HostPath.Type == nil {
				return ""
			}
			return *v.HostPath.Type
		}
	}
	t.Fatalf("no hostPath volume %s", name)
	return ""
}

func checkService(t *testing.T, svc *corev1.Service, ds *appsv1.DaemonSet) {
	labels := ds.Spec.Template.Labels
	if len(svc.Spec.Selector) == 0 {
		t.Fatal("the metrics Service selects nothing")
	}
	for k, v := range svc.Spec.Selector {
		if labels[k] != v {
			t.Errorf("the metrics Service selects %s=%s, the plugin pods are %v", k, v, labels)
		}
	}
	plugin := container(t, ds, "sparsevol")
	for _, p := range svc.Spec.Ports {
		containerPort(t, plugin, p.TargetPort.String())
	}
}

// checkImages: kustomization.yaml's images name the DaemonSet's images
// with the same tags, so `images:` in an overlay replaces them.
func checkImages(t *testing.T, k kustomization, ds *appsv1.DaemonSet) {
	used := map[string]string{}
	for _, c := range ds.Spec.Template.Spec.Containers {
		name, tag, _ := strings.Cut(c.Image, ":")
		used[name] = tag
	}
	for _, img := range k.Images {
		tag, ok := used[img.Name]
		if !ok {
			t.Errorf("kustomization image %s: no container runs it", img.Name)
		}
		if img.NewName != "" || img.NewTag != tag {
			t.Errorf("kustomization image %s: newName %q newTag %q, the DaemonSet has tag %q; keep the base as shipped", img.Name, img.NewName, img.NewTag, tag)
		}
		delete(used, img.Name)
	}
	for name := range used {
		t.Errorf("image %s is not in kustomization.yaml's images", name)
	}
}

func fieldRefEnv(c *corev1.Container, name, field string) bool {
	for _, e := range c.Env {
		if e.Name == name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == field {
			return true
		}
	}
	return false
}

func containerPort(t *testing.T, c *corev1.Container, nameOrNumber string) int32 {
	t.Helper()
	for _, p := range c.Ports {
		if p.Name == nameOrNumber || fmt.Sprint(p.ContainerPort) == nameOrNumber {
			return p.ContainerPort
		}
	}
	t.Fatalf("container %s has no port %s", c.Name, nameOrNumber)
	return 0
}

func portOf(t *testing.T, addr string) int32 {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	var n int32
	fmt.Sscan(port, &n)
	return n
}

func checkDockerfile(t *testing.T, ds *appsv1.DaemonSet) {
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	plugin := container(t, ds, "sparsevol")
	for _, want := range []string{
		"./cmd/sparsevol-csi",
		"COPY --from=build /out/sparsevol-csi " + plugin.Command[0],
		`ENTRYPOINT ["` + plugin.Command[0] + `"]`,
		"e2fsprogs", "xfsprogs", "util-linux",
	} {
		if !bytes.Contains(data, []byte(want)) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	if !strings.HasPrefix(plugin.Image, "ghcr.io/sparsevol/sparsevol:") || !bytes.Contains(data, []byte(strings.Split(plugin.Image, ":")[0])) {
		t.Errorf("plugin image %q is not the one the Dockerfile documents", plugin.Image)
	}
}
