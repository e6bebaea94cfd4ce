// Package plugincli is the command line of sparsevol-csi, the CSI plugin's
// binary: its flags, handed to csi.Run. The flags every sparsevol binary
// takes (--root, --overcommit-ratio, ...), the exit codes and the version
// are package cli's; the plugin is a binary of its own so that what it
// links (gRPC, protobuf, Prometheus) stays out of the node commands.
package plugincli

import (
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	udevrules "github.com/sparsevol/sparsevol/deploy/udev"
	"github.com/sparsevol/sparsevol/internal/cli"
	"github.com/sparsevol/sparsevol/internal/csi"
	"github.com/sparsevol/sparsevol/internal/kubelet"
	"github.com/sparsevol/sparsevol/internal/systemd"
	"github.com/sparsevol/sparsevol/internal/udev"
	"github.com/sparsevol/sparsevol/internal/unixsock"
)

// CSI flag names; deploy/kubernetes is tested against them.
const (
	CSIFlagEndpoint   = "endpoint"
	CSIFlagNodeID     = "node-id"
	CSIFlagDriverName = "driver-name"
	CSIFlagMetrics    = "metrics-address"
	CSIFlagMaxVolumes = "max-volumes"
	CSIFlagLogLevel   = "log-level"
	// Node RPCs act on paths below the kubelet directory only.
	CSIFlagKubeletDir = "kubelet-dir"
	// Both sockets are 0600, or 0660 owned by this group.
	CSIFlagSocketGroup = "socket-group"
	// Native kubelet registration (internal/kubelet), instead of the
	// node-driver-registrar sidecar.
	CSIFlagKubeletRegistration = "kubelet-registration-path"
	CSIFlagKubeletEndpoint     = "kubelet-csi-endpoint"
	// The node's udev runtime directory (/run/udev) where the container
	// mounts it: never at /run/udev, where the plugin would take udev
	// for running in its container. Where udev runs, the plugin installs
	// sparsevol's rule there and attach checks udev's records.
	CSIFlagUdevDir = "udev-dir"
	// The node's directory of identity files, mounted at the node's path
	// (the rule names the node's path).
	CSIFlagUdevIdentityDir = "udev-identity-dir"
)

// Name is the plugin binary's name.
const Name = "sparsevol-csi"

// Main runs the plugin's command line and returns the process exit code.
func Main(args []string, stdout, stderr io.Writer) int {
	return cli.Execute(NewCommand(stdout, stderr), args, stderr)
}

// NewCommand builds the plugin's command: the shared store flags and the
// CSI flags below, serving until SIGINT or SIGTERM.
func NewCommand(stdout, stderr io.Writer) *cobra.Command {
	var (
		endpoint, nodeID, driverName, metricsAddr, logLevel  string
		registration, kubeletEndpoint, kubeletDir, sockGroup string
		udevDir, identityDir                                 string
		maxVolumes                                           int64
	)
	cmd := cli.NewStoreCommand(stdout, stderr, func(cmd *cobra.Command, s cli.StoreFlags) error {
		if nodeID == "" {
			return cli.Usagef("--%s is required", CSIFlagNodeID)
		}
		socket, err := csi.ParseEndpoint(endpoint)
		if err != nil {
			return cli.Usagef("%w", err)
		}
		var level slog.Level
		if err := level.UnmarshalText([]byte(logLevel)); err != nil {
			return cli.Usagef("--%s %q: want debug, info, warn or error", CSIFlagLogLevel, logLevel)
		}
		gid := unixsock.NoGroup
		if sockGroup != "" {
			if gid, err = unixsock.LookupGroup(sockGroup); err != nil {
				return cli.Usagef("--%s: %v", CSIFlagSocketGroup, err)
			}
		}
		for _, d := range []struct{ flag, dir string }{{CSIFlagUdevDir, udevDir}, {CSIFlagUdevIdentityDir, identityDir}} {
			if d.dir == "" {
				continue
			}
			if err := csi.CheckDir(d.dir); err != nil {
				return cli.Usagef("--%s: %w", d.flag, err)
			}
		}
		log := slog.New(slog.NewTextHandler(s.Stderr, &slog.HandlerOptions{Level: level}))
		s.Options.Udev, s.Options.UdevIdentityDir = udevOptions(log, udev.Dir(udevDir), identityDir)
		s.Options.UdevRuleName, s.Options.UdevRule = udevrules.RuleName, udevrules.Rule
		ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
		defer stop()
		err = csi.Run(ctx, csi.PluginConfig{
			Driver: csi.Config{
				DriverName: driverName,
				Version:    cli.Version(),
				NodeID:     nodeID,
				MaxVolumes: maxVolumes,
				KubeletDir: kubeletDir,
			},
			StoreRoot:       s.Root,
			StoreOptions:    s.Options,
			Socket:          socket,
			SocketGID:       gid,
			Registration:    registration,
			KubeletEndpoint: kubeletEndpoint,
			MetricsAddress:  metricsAddr,
			Logger:          log,
		})
		if err != nil {
			return fmt.Errorf("csi: %w", err)
		}
		return nil
	})
	cmd.Use = Name + " --endpoint unix:///csi/csi.sock --node-id NODE"
	cmd.Example = `  sparsevol-csi --root /var/lib/sparsevol --endpoint unix:///csi/csi.sock --node-id "$NODE_NAME" \
      --kubelet-registration-path /var/lib/kubelet/plugins_registry/ --metrics-address :9808

  # In a container that mounts the node's /run/udev at /host/run/udev and its
  # /run/sparsevol/udev at /run/sparsevol/udev (deploy/kubernetes):
  sparsevol-csi --node-id "$NODE_NAME" --udev-dir /host/run/udev --udev-identity-dir /run/sparsevol/udev`
	cmd.Short = "Serve the sparsevol CSI plugin (Identity, Controller and Node) for this node"
	cmd.Long = `Serve the Container Storage Interface on a unix socket: volumes of the store
(--root) are created, staged and published for Kubernetes. Run one per node,
next to csi-provisioner --node-deployment (see deploy/kubernetes). The node's
volumes are managed with the sparsevol command.`
	f := cmd.Flags()
	f.StringVar(&endpoint, CSIFlagEndpoint, "unix:///csi/csi.sock", "CSI endpoint (unix socket)")
	f.StringVar(&nodeID, CSIFlagNodeID, "", "this node's name, as Kubernetes knows it (required)")
	f.StringVar(&driverName, CSIFlagDriverName, csi.DefaultDriverName, "CSI driver name")
	f.StringVar(&metricsAddr, CSIFlagMetrics, "", "serve Prometheus metrics (/metrics) and health (/healthz: a Probe through the CSI socket) on this address (e.g. :9808); empty: off")
	f.Int64Var(&maxVolumes, CSIFlagMaxVolumes, 0, "volumes this node may hold, reported to the scheduler; 0: no limit")
	f.StringVar(&logLevel, CSIFlagLogLevel, "info", "log level: debug, info, warn, error")
	f.StringVar(&sockGroup, CSIFlagSocketGroup, "",
		"make the CSI and registration sockets 0660 owned by this group (name or gid); empty: 0600, root only")
	f.StringVar(&kubeletDir, CSIFlagKubeletDir, csi.DefaultKubeletDir,
		"kubelet's root directory (absolute, no symbolic links): staging, target and volume paths outside it are refused")
	f.StringVar(&registration, CSIFlagKubeletRegistration, "",
		"register with kubelet directly (no node-driver-registrar): serve kubelet's plugin-registration API on this socket,\n"+
			"or on <driver-name>-reg.sock in this directory (kubelet's is "+kubelet.DefaultRegistrationDir+"/); empty: off")
	f.StringVar(&kubeletEndpoint, CSIFlagKubeletEndpoint, "",
		"the CSI socket path as kubelet sees it, announced at registration; default: the --"+CSIFlagEndpoint+" path")
	f.StringVar(&udevDir, CSIFlagUdevDir, "",
		"the node's udev runtime directory ("+string(udev.Host)+") as this process sees it (a container mounts it elsewhere than "+string(udev.Host)+"):\n"+
			"whenever udev runs there (at start or later), sparsevol's udev rule is installed in its rules.d and attach checks udev's records; empty: none")
	f.StringVar(&identityDir, CSIFlagUdevIdentityDir, "",
		"where attach leaves volumes' identities for udev's rule: the node's "+systemd.Manager{}.UdevIdentityDir()+",\n"+
			"mounted at that same path; empty: none (udev probes the volumes' content)")
	return cmd
}

// udevOptions are the store's Udev and UdevIdentityDir from the checked
// --udev-dir and --udev-identity-dir, as given: whether udev runs in dir
// is the store's to look at where it asks udev (volume.Options.Udev), so
// that a udevd started after the plugin is found.
func udevOptions(log *slog.Logger, dir udev.Dir, identityDir string) (udev.Dir, string) {
	if node := (systemd.Manager{}).UdevIdentityDir(); identityDir != "" && identityDir != node {
		log.Warn("--"+CSIFlagUdevIdentityDir+" is not "+node+", the directory sparsevol's udev rule reads: mount the node's "+node+" there", "dir", identityDir)
	}
	return dir, identityDir
}
