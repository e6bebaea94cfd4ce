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

// The suite's guest side: step bodies (steps.sh), their helpers (lib.sh),
// and the node's units (units/).
//
//go:embed guest
var guestFiles embed.FS

// The boots: b1 sets every scenario up, b2 checks them after a clean reboot.
var plan = func() []vmrun.BootSpec {
	const (
		short = 600 * time.Second
		long  = 900 * time.Second
	)
	steps := func(names ...string) []vmrun.Step {
		s := []vmrun.Step{{Name: "cluster", Timeout: long}}
		for _, n := range names {
			s = append(s, vmrun.Step{Name: n, Timeout: short})
		}
		return s
	}
	return []vmrun.BootSpec{
		{Name: "b1-setup", Next: vmrun.Reboot, Steps: steps("s1-setup", "s2-setup", "s3-setup", "s4-capacity")},
		{Name: "b2-after-reboot", Next: vmrun.Poweroff, Steps: steps("s2-check", "s3-check", "s1-check", "s3-expand", "s5-cleanup")},
	}
}

func TestKubernetes(t *testing.T) {
	vmrun.RequireHost(t)
	total := time.Now()
	cfg := vmrun.LoadConfig(t, 4096)
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
	// 3. This run's root disk.
	r := vmrun.NewRun(t, cfg, img, suite(cfg, res))
	defer r.Close(t)

	for _, b := range plan() {
		if br := r.Boot(t, b); br.Err != nil {
			break
		}
	}

	b1, b2 := r.Results["b1-setup"], r.Results["b2-after-reboot"]
	for _, b := range []*vmrun.Result{b1, b2} {
		if b == nil || b.Err != nil {
			continue
		}
		f := b.Step("cluster").Facts
		fig("%s: apiserver ready at %ss, node Ready at %ss, plugin registered (CSINode) at %ss after boot; qemu run %s",
			b.Spec.Name, f["apiserver_ready_uptime"], f["node_ready_uptime"], f["csinode_registered_uptime"], b.Wall.Round(time.Second))
	}

	// Each scenario: its steps ran to their end without a failure, then
	// the facts that make its verdict.
	t.Run("0-cluster", func(t *testing.T) {
		for _, b := range []*vmrun.Result{b1, b2} {
			if vmrun.NeedStep(t, b, "cluster") {
				vmrun.Expect(t, b, "cluster", "plugin_registered", "yes")
			}
		}
	})
	t.Run("1-seed-failure-reproduced", func(t *testing.T) {
		if !vmrun.NeedStep(t, b1, "s1-setup") || !vmrun.NeedStep(t, b2, "s1-check") {
			return
		}
		vmrun.Expect(t, b1, "s1-setup", "unit_enabled", "disabled", "pod_ready", "yes", "data", "same")
		// After the reboot the volume is not back, and kubelet says why.
		vmrun.Expect(t, b2, "s1-check", "stable_path_exists", "no", "pod_ready", "no", "event_found", "yes")
		f := b2.Step("s1-check").Facts
		vmrun.Logf(t, "scenario 1: unit %s; after the reboot pod-s1 is %s/%s; kubelet at %ss: %s",
			b1.Step("s1-setup").Facts["unit_enabled"], f["phase"], f["waiting_reason"], f["event_uptime"], f["event"])
	})
	t.Run("2-node-mode-fix", func(t *testing.T) {
		if !vmrun.NeedStep(t, b1, "s2-setup") || !vmrun.NeedStep(t, b2, "s2-check") {
			return
		}
		vmrun.Expect(t, b1, "s2-setup", "unit_enabled", "enabled", "pod_ready", "yes", "data", "same")
		if vmrun.Expect(t, b2, "s2-check", "pod_ready", "yes", "data", "same") {
			f := b2.Step("s2-check").Facts
			fig("scenario 2 (node mode, unit enabled): pod Ready %ss after boot (container started at %ss), data %s; unit %s",
				f["pod_ready_uptime"], f["started_uptime"], f["data"], f["unit_state"])
		}
	})
	t.Run("3-csi-mode", func(t *testing.T) {
		if !vmrun.NeedStep(t, b1, "s3-setup") || !vmrun.NeedStep(t, b2, "s3-check") {
			return
		}
		vmrun.Expect(t, b1, "s3-setup", "fs_ready", "yes", "fs_data", "same", "block_ready", "yes", "block_data", "same")
		if vmrun.Expect(t, b2, "s3-check", "fs_ready", "yes", "fs_data", "same", "block_ready", "yes", "block_data", "same") {
			f := b2.Step("s3-check").Facts
			fig("scenario 3 (CSI): filesystem pod Ready %ss after boot (data %s), block pod Ready %ss (data %s)",
				f["fs_ready_uptime"], f["fs_data"], f["block_ready_uptime"], f["block_data"])
		}
	})
	t.Run("3b-csi-node-expansion", func(t *testing.T) {
		if !vmrun.NeedStep(t, b2, "s3-expand") {
			return
		}
		if vmrun.Expect(t, b2, "s3-expand", "grown", "yes") {
			f := b2.Step("s3-expand").Facts
			fig("scenario 3b (NodeExpandVolume, the test as resizer): ext4 %s KiB -> %s KiB, PVC capacity %s",
				f["size_before_kib"], f["size_after_kib"], f["pvc_capacity"])
		}
	})
	t.Run("4-capacity", func(t *testing.T) {
		if !vmrun.NeedStep(t, b1, "s4-capacity") {
			return
		}
		f := b1.Step("s4-capacity").Facts
		if f["capacity_objects"] == "" || f["capacity_objects"] == "0" {
			vmrun.Expect(t, b1, "s4-capacity", "capacity_objects", "1 or more")
		}
		if vmrun.Expect(t, b1, "s4-capacity", "event_found", "yes", "pvc_phase", "Pending", "store_unchanged", "yes") {
			fig("scenario 4 (capacity): %s CSIStorageCapacity object(s), capacity %s, topology %s; 100Ti claim %s, pod %s: %q; store unchanged: %s",
				f["capacity_objects"], f["capacity"], f["capacity_topology"], f["pvc_phase"], f["pod_phase"], f["event"], f["store_unchanged"])
		}
	})
	t.Run("5-cleanup", func(t *testing.T) {
		if vmrun.NeedStep(t, b2, "s5-cleanup") {
			vmrun.Expect(t, b2, "s5-cleanup", "pvs_left", "none", "loops_left", "none", "files_left", "none",
				"units_loaded", "none", "units_enabled", "none")
		}
	})
	fig("total: %s", time.Since(total).Round(time.Second))
	for _, f := range figures {
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
			// The project's own CSIDriver and StorageClasses.
			for _, m := range []string{"csidriver.yaml", "storageclasses.yaml"} {
				if err := vmrun.CopyFile(cfg.Repo+"/deploy/kubernetes/"+m, root+"/"+libDir+"/deploy/"+m, 0o644); err != nil {
					return err
				}
			}
			return nil
		},
		Journals: []string{"sparsevol-csi", "csi-provisioner", "kubelet", "containerd", "kube-apiserver",
			"kube-controller-manager", "kube-scheduler", "etcd", "k8s-images", "k8s-net", "sparsevol@*"},
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	vmrun.Logf(w.t, "%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
