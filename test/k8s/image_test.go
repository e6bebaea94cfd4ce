//go:build e2e

package k8s

import (
	"bufio"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// nodeLayer makes the node image: the shared base image (Debian, systemd,
// udev, Debian's kernel) plus what a Kubernetes node needs from Debian,
// installed with apt, and containerd configured for the node. vmrun caches
// it as node-<key>; bump Recipe when configureContainerd changes.
var nodeLayer = vmrun.Layer{
	Name:   "node",
	Recipe: "v1",
	Packages: []string{
		"containerd", "runc", "containernetworking-plugins", "iptables", "conntrack",
		"ca-certificates", "busybox-static", "procps", "iproute2", "curl", "dbus",
	},
	Customize: configureContainerd,
}

// configureContainerd writes Debian's containerd defaults with the local
// pause image, systemd cgroups and Debian's CNI plugin directory.
func configureContainerd(root string, log io.Writer) error {
	conf, err := vmrun.ChrootOutput(root, log, "containerd", "config", "default")
	if err != nil {
		return err
	}
	edited, err := editContainerdConfig(string(conf))
	if err != nil {
		return err
	}
	return vmrun.WriteFile(filepath.Join(root, "etc/containerd/config.toml"), []byte(edited), 0o644)
}

// editContainerdConfig changes the three settings of a `containerd config
// default` that the node needs, and fails if one is not found.
func editContainerdConfig(conf string) (string, error) {
	edits := []struct {
		prefix, line string
		done         bool
	}{
		{prefix: "sandbox_image =", line: `sandbox_image = "localhost/pause:1"`},
		{prefix: "SystemdCgroup =", line: "SystemdCgroup = true"},
		{prefix: "bin_dir =", line: `bin_dir = "/usr/lib/cni"`},
	}
	var out strings.Builder
	sc := bufio.NewScanner(strings.NewReader(conf))
	for sc.Scan() {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		for i := range edits {
			if strings.HasPrefix(trimmed, edits[i].prefix) {
				line = line[:len(line)-len(strings.TrimLeft(line, " \t"))] + edits[i].line
				edits[i].done = true
			}
		}
		out.WriteString(line + "\n")
	}
	for _, e := range edits {
		if !e.done {
			return "", fmt.Errorf("containerd config: no %q line", e.prefix)
		}
	}
	return out.String(), nil
}
