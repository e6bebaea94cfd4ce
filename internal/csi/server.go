package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/unixsock"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// ParseEndpoint turns unix:///path, unix:/path or a bare absolute path
// into a socket path. Only unix sockets are served: the CSI socket is a
// node-local API and must not be reachable over the network.
func ParseEndpoint(endpoint string) (string, error) {
	if strings.HasPrefix(endpoint, "/") {
		return filepath.Clean(endpoint), nil
	}
	u, err := url.Parse(endpoint)
	if err != nil {
		return "", fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	if u.Scheme != "unix" {
		return "", fmt.Errorf("endpoint %q: only unix sockets are supported (unix:///path/csi.sock)", endpoint)
	}
	path := u.Path
	if path == "" {
		path = u.Opaque
	}
	if !strings.HasPrefix(path, "/") {
		return "", fmt.Errorf("endpoint %q: the socket path must be absolute", endpoint)
	}
	return filepath.Clean(path), nil
}

// Listen makes the CSI endpoint socket (replacing a stale one, never one
// another plugin listens on: unixsock.ErrInUse): 0600, or 0660 with group
// gid unless gid is unixsock.NoGroup. Closing it removes it.
func Listen(path string, gid int) (net.Listener, error) {
	return unixsock.Listen(path, gid)
}

// Bounds of what one client of the CSI socket may ask of the server
// (docs/design.md, "Bounds of the gRPC servers"): the bytes of a request
// message and of its headers, and the calls one connection has running
// at once (a client's further calls wait for one to end).
const (
	maxRequestBytes = 4 << 20
	maxHeaderBytes  = 64 << 10
	maxStreams      = 128
)

// serverOptions are the bounds every CSI gRPC server is made with.
func serverOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.MaxRecvMsgSize(maxRequestBytes),
		grpc.MaxHeaderListSize(maxHeaderBytes),
		grpc.MaxConcurrentStreams(maxStreams),
	}
}

// NewGRPCServer returns a gRPC server with the driver's four services,
// the logging and metrics interceptor and the bounds of serverOptions.
func (d *Driver) NewGRPCServer() *grpc.Server {
	srv := grpc.NewServer(append(serverOptions(), grpc.UnaryInterceptor(d.intercept))...)
	csi.RegisterIdentityServer(srv, d)
	csi.RegisterControllerServer(srv, d)
	csi.RegisterNodeServer(srv, d)
	csi.RegisterGroupControllerServer(srv, d)
	return srv
}

// Serve serves CSI on l until ctx ends, then stops gracefully (bounded);
// stopping closes l, which removes a socket made by Listen.
func (d *Driver) Serve(ctx context.Context, l net.Listener) error {
	srv := d.NewGRPCServer()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	d.log.Info("serving CSI", "driver", d.name, "version", d.version, "node_id", d.nodeID, "endpoint", l.Addr().String())
	select {
	case err := <-errc:
		return fmt.Errorf("serve CSI: %w", err)
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		srv.Stop()
	}
	return nil
}

// ListenMetrics opens the metrics address addr, host:port with a numeric
// port (the host may be empty: every address). An address of another form
// is refused with volume.ErrInvalid before anything is opened.
func ListenMetrics(addr string) (net.Listener, error) {
	_, port, err := net.SplitHostPort(addr)
	if err == nil {
		_, err = strconv.ParseUint(port, 10, 16)
	}
	if err != nil {
		return nil, fmt.Errorf("metrics address %s: want host:port with a numeric port, e.g. :9809: %w", volume.Quote(addr), volume.ErrInvalid)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen %s (choose a free address): %w", volume.Quote(addr), err)
	}
	return l, nil
}

// metricsInFlight is how many scrapes of /metrics are served at once
// (two: a pair of Prometheus replicas); one more is answered 503 at once.
// Anyone who reaches the port may ask, and each scrape looks at every
// volume of the store.
const metricsInFlight = 2

// ServeMetrics serves /metrics, and /healthz (health, if not nil) on l, a
// listener of ListenMetrics, until ctx ends; it closes l. At most
// metricsInFlight scrapes run at once, and a client gets bounded time to
// send its request and take the answer.
func ServeMetrics(ctx context.Context, l net.Listener, m *Metrics, health HealthCheck, log *slog.Logger) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{MaxRequestsInFlight: metricsInFlight}))
	if health != nil {
		mux.Handle("/healthz", healthHandler(health, log))
	}
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      time.Minute,
		IdleTimeout:       time.Minute,
		MaxHeaderBytes:    16 << 10,
	}
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(shut)
	}()
	log.Info("serving metrics", "address", l.Addr().String())
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics: %w", err)
	}
	return nil
}

// Request fields worth logging. Secrets, parameters, contexts and mount
// flags are deliberately absent: only these getters are ever called.
type (
	withVolumeID interface{ GetVolumeId() string }
	withName     interface{ GetName() string }
	withTarget   interface{ GetTargetPath() string }
	withStaging  interface{ GetStagingTargetPath() string }
	withPath     interface{ GetVolumePath() string }
	withSnapshot interface{ GetSnapshotId() string }
	withSource   interface{ GetSourceVolumeId() string }
	withGroup    interface{ GetGroupSnapshotId() string }
)

// logAttrs picks the identifying fields of a request, each one bounded by
// volume.Clip: a client's ids, names and paths are logged ASCII-escaped
// and cut, never whole.
func logAttrs(req any) []any {
	var attrs []any
	if r, ok := req.(withVolumeID); ok && r.GetVolumeId() != "" {
		attrs = append(attrs, "volume_id", volume.Clip(r.GetVolumeId()))
	}
	if r, ok := req.(withName); ok && r.GetName() != "" {
		attrs = append(attrs, "name", volume.Clip(r.GetName()))
	}
	if r, ok := req.(withStaging); ok && r.GetStagingTargetPath() != "" {
		attrs = append(attrs, "staging_target_path", volume.Clip(r.GetStagingTargetPath()))
	}
	if r, ok := req.(withTarget); ok && r.GetTargetPath() != "" {
		attrs = append(attrs, "target_path", volume.Clip(r.GetTargetPath()))
	}
	if r, ok := req.(withPath); ok && r.GetVolumePath() != "" {
		attrs = append(attrs, "volume_path", volume.Clip(r.GetVolumePath()))
	}
	if r, ok := req.(withSnapshot); ok && r.GetSnapshotId() != "" {
		attrs = append(attrs, "snapshot_id", volume.Clip(r.GetSnapshotId()))
	}
	if r, ok := req.(withSource); ok && r.GetSourceVolumeId() != "" {
		attrs = append(attrs, "source_volume_id", volume.Clip(r.GetSourceVolumeId()))
	}
	if r, ok := req.(withGroup); ok && r.GetGroupSnapshotId() != "" {
		attrs = append(attrs, "group_snapshot_id", volume.Clip(r.GetGroupSnapshotId()))
	}
	return attrs
}

// quietMethods are polled constantly by sidecars; they log at debug level.
var quietMethods = map[string]bool{
	"Probe": true, "GetCapacity": true, "NodeGetVolumeStats": true, "NodeGetCapabilities": true,
	"ControllerGetCapabilities": true, "GetPluginInfo": true, "GetPluginCapabilities": true,
	"GroupControllerGetCapabilities": true,
}

// intercept logs every call (without secrets) and records its metrics.
func (d *Driver) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	method := info.FullMethod[strings.LastIndex(info.FullMethod, "/")+1:]
	start := time.Now()
	resp, err := handler(ctx, req)
	elapsed := time.Since(start)
	st := status.Convert(err)
	d.metrics.observe(method, st.Code().String(), elapsed)
	attrs := append([]any{"method", method, "code", st.Code().String(), "duration", elapsed.Round(time.Microsecond)}, logAttrs(req)...)
	switch {
	case err != nil:
		d.log.Warn("CSI call failed", append(attrs, "error", st.Message())...)
	case quietMethods[method]:
		d.log.Debug("CSI call", attrs...)
	default:
		d.log.Info("CSI call", attrs...)
	}
	return resp, err
}
