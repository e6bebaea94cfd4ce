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
	"path/filepath"
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

// cluster: the cluster comes up (every boot): apiserver, node Ready, the
// plugin registered with kubelet (CSINode lists the driver), objects of
// the test.
var cluster = vmrun.Step{Name: "cluster", Timeout: long, Script: `
	retry 600 k get --raw /readyz || die "apiserver not ready"
	fact apiserver_ready_uptime "$(up)"
	retry 600 node_ready || { k describe node "$NODE"; die "node not Ready"; }
	fact node_ready_uptime "$(up)"
	# Native registration: kubelet lists the driver in CSINode.
	if retry 180 sh -c "kubectl get csinode $NODE -o jsonpath='{.spec.drivers[*].name}' | grep -qw $DRIVER"; then
		fact csinode_registered_uptime "$(up)"
		fact plugin_registered yes
		k get csinode "$NODE" -o jsonpath='{.spec.drivers}'; echo
	else
		journalctl -b --no-pager -u sparsevol-csi | tail -n 30
		journalctl -b --no-pager -u kubelet | grep -i plugin | tail -n 20
		fact plugin_registered no
	fi
	fact node_labels "$(k get node "$NODE" -o jsonpath='{.metadata.labels}')"
	# The project's own CSIDriver and StorageClasses (deploy/kubernetes).
	k apply -f "$DEPLOY/csidriver.yaml" -f "$DEPLOY/storageclasses.yaml" || die "apply deploy/kubernetes manifests"
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

// Scenario 0: the cluster came up and the plugin registered in every boot
// that ran.
var _ = scenarios.Add(vmrun.Scenario[*run]{
	ID: "0-cluster",
	Check: func(t *testing.T, r *run) {
		for _, name := range r.Order {
			if b := r.Results[name]; vmrun.NeedStep(t, b, "cluster") {
				vmrun.Expect(t, b, "cluster", "plugin_registered", "yes")
			}
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
	r := &run{Run: vmrun.NewRun(t, cfg, img, suite(cfg, res)), figures: figures}
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
func suite(cfg vmrun.Config, bin bins.Result) vmrun.Suite {
	return vmrun.Suite{
		Name:    "k8s",
		Guest:   guestFiles,
		Install: true,
		Prepare: func(t testing.TB, root string) error {
			if err := installNode(root, bin); err != nil {
				return err
			}
			// The project's own CSIDriver, StorageClasses and snapshot
			// classes.
			for _, m := range []string{"csidriver.yaml", "storageclasses.yaml", "snapshotclass.yaml"} {
				if err := vmrun.CopyFile(cfg.Repo+"/deploy/kubernetes/"+m, root+"/"+libDir+"/deploy/"+m, 0o644); err != nil {
					return err
				}
			}
			// The snapshot CRDs, from external-snapshotter's client module.
			crds, err := bin.Files("crd")
			if err != nil {
				return err
			}
			for _, c := range crds {
				if err := vmrun.CopyFile(c, filepath.Join(root, libDir, "crd", filepath.Base(c)), 0o644); err != nil {
					return err
				}
			}
			return nil
		},
		Journals: []string{"sparsevol-csi", "csi-provisioner", "csi-snapshotter", "snapshot-controller", "kubelet", "containerd", "kube-apiserver",
			"kube-controller-manager", "kube-scheduler", "etcd", "k8s-images", "k8s-net", "sparsevol@*"},
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	vmrun.Logf(w.t, "%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
