package csi

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"

	"github.com/sparsevol/sparsevol/internal/kubelet"
	"github.com/sparsevol/sparsevol/internal/unixsock"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// PluginConfig is what one plugin process serves.
type PluginConfig struct {
	// Driver configures the CSI servers; Run fills in its Store, Metrics
	// and Logger.
	Driver Config
	// StoreRoot is the store, created (0700) if missing; StoreOptions its
	// options (Run sets the Logger).
	StoreRoot    string
	StoreOptions volume.Options
	// Socket is the CSI endpoint's path; SocketGID its group, or
	// unixsock.NoGroup for a root-only socket.
	Socket    string
	SocketGID int
	// Registration, if set, is kubelet's plugin-registration socket to
	// serve (no node-driver-registrar); KubeletEndpoint is the CSI socket
	// as kubelet sees it (default: Socket).
	Registration    string
	KubeletEndpoint string
	// MetricsAddress, if set, serves Prometheus metrics (/metrics) and the
	// plugin's health (/healthz, a Probe through Socket) on it
	// (ListenMetrics' form).
	MetricsAddress string
	Logger         *slog.Logger
}

// Run opens the store (which installs StoreOptions.UdevRule where udev
// runs: volume.Options) and serves CSI on cfg.Socket, and kubelet's
// plugin registration and the metrics where asked, until ctx ends or one
// of the servers fails; the others are then stopped, and Run returns the
// first failure. Configuration errors wrap volume.ErrInvalid, and nothing
// is served then; so is a socket path another plugin listens on
// (unixsock.ErrInUse) or a metrics address that cannot be opened, refused
// before the store is made.
func Run(ctx context.Context, cfg PluginConfig) error {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// The driver's configuration first: the driver name names the
	// registration socket.
	drvCfg := cfg.Driver
	if err := drvCfg.normalize(); err != nil {
		return err
	}
	var reg *kubelet.Server
	regSocket := ""
	if cfg.Registration != "" {
		endpoint := cfg.KubeletEndpoint
		if endpoint == "" {
			endpoint = cfg.Socket
		}
		var err error
		if reg, err = kubelet.New(kubelet.Config{DriverName: drvCfg.DriverName, Endpoint: endpoint, Logger: log}); err != nil {
			return fmt.Errorf("%w: %w", err, volume.ErrInvalid)
		}
		if regSocket, err = kubelet.SocketPath(cfg.Registration, drvCfg.DriverName); err != nil {
			return fmt.Errorf("%w: %w", err, volume.ErrInvalid)
		}
		if regSocket == cfg.Socket {
			// node-driver-registrar's flag of this name is the CSI socket;
			// here it is kubelet's plugins_registry.
			return fmt.Errorf("registration socket %s is the CSI socket; give kubelet's plugin registry (%s/) or a socket in it: %w",
				cfg.Registration, kubelet.DefaultRegistrationDir, volume.ErrInvalid)
		}
	}
	// Refused before the store is touched: a socket another plugin
	// listens on (Listen checks again when it replaces a stale one).
	for _, p := range []string{cfg.Socket, regSocket} {
		if p == "" {
			continue
		}
		if err := unixsock.Vacant(p); err != nil {
			return err
		}
	}
	if _, err := volume.CheckRoot(cfg.StoreRoot); err != nil {
		return err
	}
	// The metrics address is opened before the store is made: a bad or
	// busy one is refused with nothing made.
	var ml net.Listener
	if cfg.MetricsAddress != "" {
		var err error
		if ml, err = ListenMetrics(cfg.MetricsAddress); err != nil {
			return err
		}
		defer func() {
			if ml != nil {
				ml.Close()
			}
		}()
	}
	// The plugin owns its store: make it if the host path is missing.
	// Open makes a lax one private (hostPath DirectoryOrCreate makes 0755
	// directories).
	if err := os.MkdirAll(cfg.StoreRoot, 0o700); err != nil {
		return fmt.Errorf("create store %s: %w", cfg.StoreRoot, err)
	}
	opts := cfg.StoreOptions
	opts.Logger = log
	store, err := volume.Open(cfg.StoreRoot, opts)
	if err != nil {
		return err
	}
	// A plugin killed during a snapshot took its thaw guard along (the
	// first process of the container's PID namespace): thaw what it left.
	if err := store.ThawLeftovers(); err != nil {
		log.Warn("could not thaw every filesystem a killed snapshot left frozen", "error", err)
	}
	drvCfg.Store, drvCfg.Logger, drvCfg.Metrics = store, log, NewMetrics(store)
	drv, err := New(drvCfg)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var servers []func() error
	l, err := Listen(cfg.Socket, cfg.SocketGID)
	if err != nil {
		return err
	}
	servers = append(servers, func() error { return drv.Serve(ctx, l) })
	if reg != nil {
		rl, err := kubelet.Listen(regSocket, cfg.SocketGID)
		if err != nil {
			l.Close()
			return err
		}
		servers = append(servers, func() error { return reg.Serve(ctx, rl) })
	}
	if ml != nil {
		// /healthz asks the plugin through its own socket, as the
		// livenessprobe sidecar would. ServeMetrics closes its listener.
		health, l := SocketProbe(cfg.Socket), ml
		ml = nil
		servers = append(servers, func() error { return ServeMetrics(ctx, l, drvCfg.Metrics, health, log) })
	}
	errc := make(chan error, len(servers))
	for _, serve := range servers {
		go func() { errc <- serve() }()
	}
	var first error
	for range servers {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
		cancel() // one server ending stops the others
	}
	return first
}
