//go:build e2e

// Package k8s proves sparsevol with a real Kubernetes node: kubelet,
// kube-apiserver, controller-manager, scheduler and etcd (built from their Go
// modules, see bins), containerd from Debian, in a qemu VM made from the
// shared base image (test/e2e/vmrun). The node reboots; pods must come back
// with their data. Run it with `make e2e-k8s`; see README.md here.
package k8s

import (
	"context"
	"embed"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
	"github.com/sparsevol/sparsevol/test/k8s/bins"
)

// The suite's guest side: the Kubernetes helpers its steps share (lib.sh)
// and the node's units (units/).
//
//go:embed guest
var guestFiles embed.FS

// Step limits.
const (
	short = 600 * time.Second
	long  = 900 * time.Second
)

// The boots, in order; a scenario places its steps in them by name. The
// cluster comes up first in every boot.
var timeline = vmrun.Timeline{
	Boots: []string{
		"b1-setup",        // every scenario sets up
		"b2-after-reboot", // and checks after a clean reboot
	},
	Every: []vmrun.Step{cluster},
}

// scenarios: each scenario file adds itself (var _ = scenarios.Add(...)).
var scenarios vmrun.Scenarios[*run]

// run is one execution of the suite; figures are printed at its end.
type run struct {
	*vmrun.Run
	figures []string
}

// fig records a figure of the run.
func (r *run) fig(format string, args ...any) {
	r.figures = append(r.figures, fmt.Sprintf(format, args...))
}

// step returns the result of the boot that ran step and whether the step
// ran to its end without recording a failure (t fails when not).
func (r *run) step(t *testing.T, step string) (*vmrun.Result, bool) {
	t.Helper()
	res := r.Ran(step)
	return res, vmrun.NeedStep(t, res, step)
}

// cluster: the cluster comes up (every boot): apiserver, node Ready; in
// the first boot the plugin is installed as shipped (kubectl apply -k of
// test/k8s's overlay of deploy/kubernetes); in every boot its DaemonSet pod
// runs and registers with kubelet (CSINode lists the driver).
var cluster = vmrun.Step{Name: "cluster", Timeout: long, Script: `
	retry 600 k get --raw /readyz || die "apiserver not ready"
	fact apiserver_ready_uptime "$(up)"
	retry 600 node_ready || { k describe node "$NODE"; die "node not Ready"; }
	fact node_ready_uptime "$(up)"
	# The snapshot CRDs (external-snapshotter's): the kustomization's
	# snapshot classes need them.
	k apply --server-side -f "$LIB/crd/" >/dev/null || die "apply snapshot CRDs"
	k wait --for condition=established --timeout=120s crd/volumesnapshotclasses.snapshot.storage.k8s.io crd/volumegroupsnapshotclasses.groupsnapshot.storage.k8s.io >/dev/null || die "snapshot CRDs not established"
	if k -n "$PLUGIN_NS" get ds sparsevol-csi >/dev/null 2>&1; then
		fact applied no
	else
		k apply -k "$OVERLAY" || die "kubectl apply -k the overlay"
		fact applied yes
	fi
	if wait_plugin 600; then
		fact csinode_registered_uptime "$(up)"
		fact plugin_registered yes
		k get csinode "$NODE" -o jsonpath='{.spec.drivers}'; echo
	else
		k -n "$PLUGIN_NS" get pods -o wide
		k -n "$PLUGIN_NS" describe pod -l "$PLUGIN_SELECTOR" | tail -n 30
		plugin_log sparsevol 40
		journalctl -b --no-pager -u kubelet | grep -i plugin | tail -n 20
		fact plugin_registered no
	fi
	# The plugin's pod started during this boot: it came back by itself.
	fact plugin_pod_this_boot "$(yesno pod_ready_this_boot "$(plugin_pod)" "$PLUGIN_NS")"
	fact plugin_image "$(k -n "$PLUGIN_NS" get ds sparsevol-csi -o jsonpath='{.spec.template.spec.containers[0].image}')"
	fact plugin_containers "$(k -n "$PLUGIN_NS" get ds sparsevol-csi -o jsonpath='{.spec.template.spec.containers[*].name}')"
	fact plugin_healthz "$(curl -fsS --max-time 10 "http://$(k -n "$PLUGIN_NS" get pod "$(plugin_pod)" -o jsonpath='{.status.podIP}'):9809/healthz" 2>&1)"
	fact node_labels "$(k get node "$NODE" -o jsonpath='{.metadata.labels}')"
	k apply -f - <<'YAML' || die "apply test objects"
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: local-static
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
YAML
	retry 120 k get serviceaccount default || die "no default service account"
`}

// Scenario 0: the cluster came up and the plugin, installed once with
// kubectl apply -k, runs as the DaemonSet's pod (the shipped containers
// less csi-resizer), registered and healthy in every boot that ran; after
// a reboot its pod is back by itself (started this boot, not re-applied).
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "0-cluster",
	Check: func(t *testing.T, r *run) {
		for i, name := range r.Order {
			b := r.Results[name]
			if !vmrun.NeedStep(t, b, "cluster") {
				continue
			}
			applied := "no"
			if i == 0 {
				applied = "yes"
			}
			vmrun.Expect(t, b, "cluster", "applied", applied, "plugin_registered", "yes", "plugin_pod_this_boot", "yes",
				"plugin_containers", "sparsevol csi-provisioner csi-snapshotter", "plugin_healthz", "ok")
		}
	},
})

func TestKubernetes(t *testing.T) {
	vmrun.RequireHost(t)
	total := time.Now()
	cfg := vmrun.LoadConfig(t, 4096)
	selected := scenarios.Selected(t)
	plan, err := vmrun.Plan(timeline, selected)
	if err != nil {
		t.Fatal(err)
	}
	var figures []string
	fig := func(format string, args ...any) { figures = append(figures, fmt.Sprintf(format, args...)) }

	// 1. Node image: the base image plus the node layer (both cached).
	img := vmrun.BaseImage(t, cfg).Layer(t, cfg, nodeLayer)
	if img.Built > 0 {
		fig("node image: built in %s", img.Built.Round(time.Second))
	}
	// 2. Binaries (cached).
	goCmd := "go"
	if _, err := exec.LookPath("go"); err != nil {
		goCmd = "/usr/local/go/bin/go"
	}
	res, err := bins.Ensure(context.Background(), bins.Options{Go: goCmd, Nice: 19, Log: testWriter{t}})
	if err != nil {
		t.Fatalf("binaries: %v", err)
	}
	if res.Cached {
		fig("binaries: cached")
	} else {
		fig("binaries: built in %s", res.Elapsed.Round(time.Second))
	}
	// 3. This run's root disk, its boots, then each scenario's verdict.
	r := &run{Run: vmrun.NewRun(t, cfg, img, suite(cfg, res, goCmd)), figures: figures}
	defer r.Close(t)
	vmrun.Play(t, r, plan, selected, func(spec vmrun.BootSpec) *vmrun.Result {
		b := r.Boot(t, spec)
		if b.Err == nil {
			f := b.Step("cluster").Facts
			r.fig("%s: apiserver ready at %ss, node Ready at %ss, plugin registered (CSINode) at %ss after boot; qemu run %s",
				b.Spec.Name, f["apiserver_ready_uptime"], f["node_ready_uptime"], f["csinode_registered_uptime"], b.Wall.Round(time.Second))
		}
		return b
	})
	r.fig("total: %s", time.Since(total).Round(time.Second))
	for _, f := range r.figures {
		vmrun.Logf(t, "figure: %s", f)
	}
}

// suite is what test/k8s adds to a run: sparsevol and the node (binaries,
// PKI, configuration, images, units) installed, and the journals of the
// node's services saved at the end of every boot, the plugin's first.
func suite(cfg vmrun.Config, bin bins.Result, goCmd string) vmrun.Suite {
	return vmrun.Suite{
		Name:    "k8s",
		Guest:   guestFiles,
		Install: true,
		Prepare: func(t testing.TB, root string) error {
			if err := installNode(root, bin); err != nil {
				return err
			}
			// The plugin as shipped: its images, the kustomization.
			start := time.Now()
			if err := installPlugin(root, cfg.Repo, goCmd); err != nil {
				return err
			}
			vmrun.Logf(t, "plugin images built in %s", time.Since(start).Round(time.Second))
			return nil
		},
		Journals: []string{"snapshot-controller", "kubelet", "containerd", "kube-apiserver",
			"kube-controller-manager", "kube-scheduler", "etcd", "k8s-images", "k8s-net", "sparsevol@*"},
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	vmrun.Logf(w.t, "%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
