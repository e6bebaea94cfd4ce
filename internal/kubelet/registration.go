// Package kubelet registers the CSI plugin with kubelet natively: it serves
// kubelet's plugin-registration API (k8s.io/kubelet/pkg/apis/pluginregistration/v1)
// on a socket in kubelet's plugins_registry directory, the job the
// node-driver-registrar sidecar does otherwise. Kubelet's plugin watcher
// finds the socket (at its start, or when the socket appears), calls GetInfo,
// connects to the CSI endpoint it names, and reports the outcome with
// NotifyRegistrationStatus. Removing the socket unregisters the plugin.
package kubelet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/sparsevol/sparsevol/internal/unixsock"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// DefaultRegistrationDir is where kubelet watches for plugin sockets.
const DefaultRegistrationDir = "/var/lib/kubelet/plugins_registry"

// SupportedVersions are the CSI spec versions announced to kubelet.
var SupportedVersions = []string{"1.0.0"}

// SocketPath turns the --kubelet-registration-path value into the path of
// the registration socket: a directory (an existing one, or a path ending in
// "/") gets "<driver>-reg.sock" in it, the name node-driver-registrar uses;
// anything else is the socket path itself. driverName is a CSI driver
// name package csi has checked, so the socket stays in the directory.
// The value must be absolute and clean (but for the one trailing "/"):
// a relative one would put the socket wherever the plugin was started.
func SocketPath(path, driverName string) (string, error) {
	dir := strings.HasSuffix(path, "/")
	bare := path
	if dir && path != "/" {
		bare = strings.TrimSuffix(path, "/")
	}
	if !filepath.IsAbs(bare) || filepath.Clean(bare) != bare {
		return "", fmt.Errorf("kubelet registration path %q is not an absolute, clean path; give kubelet's plugin registry (%s/) or a socket in it",
			path, DefaultRegistrationDir)
	}
	if !dir {
		if fi, err := os.Stat(bare); err == nil && fi.IsDir() {
			dir = true
		}
	}
	if dir {
		return filepath.Join(bare, driverName+"-reg.sock"), nil
	}
	return bare, nil
}

// Config of a registration server.
type Config struct {
	DriverName string // CSI driver name, checked by package csi
	// Endpoint is the CSI socket path as kubelet sees it (kubelet connects
	// to it after GetInfo). Required: absolute and clean.
	Endpoint string
	Versions []string // CSI versions; SupportedVersions when empty
	Logger   *slog.Logger
}

// Status is the outcome kubelet last reported.
type Status struct {
	Notified   bool // kubelet called NotifyRegistrationStatus at least once
	Registered bool
	// Error is kubelet's message for a refusal as volume.ClipMessage
	// shows it: ASCII-escaped and cut, safe to print. The peer on the
	// socket wrote it.
	Error string
	At    time.Time
}

// Server answers kubelet's registration calls.
type Server struct {
	registerapi.UnimplementedRegistrationServer
	cfg Config
	log *slog.Logger

	mu       sync.Mutex
	status   Status
	notified chan struct{} // closed at the first notification
}

// New validates cfg and returns a server.
func New(cfg Config) (*Server, error) {
	if cfg.DriverName == "" {
		return nil, errors.New("kubelet registration: driver name is required")
	}
	if !filepath.IsAbs(cfg.Endpoint) || filepath.Clean(cfg.Endpoint) != cfg.Endpoint {
		return nil, fmt.Errorf("kubelet registration: CSI endpoint %q must be an absolute, clean socket path", cfg.Endpoint)
	}
	if len(cfg.Versions) == 0 {
		cfg.Versions = SupportedVersions
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{cfg: cfg, log: log.With("component", "kubelet-registration"), notified: make(chan struct{})}, nil
}

// GetInfo tells kubelet what this socket registers: a CSI plugin, its name,
// its endpoint and the CSI versions it speaks.
func (s *Server) GetInfo(ctx context.Context, _ *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	s.log.Info("kubelet asked for plugin info", "driver", s.cfg.DriverName, "endpoint", s.cfg.Endpoint)
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              s.cfg.DriverName,
		Endpoint:          s.cfg.Endpoint,
		SupportedVersions: append([]string(nil), s.cfg.Versions...),
	}, nil
}

// NotifyRegistrationStatus records and logs kubelet's verdict; its error
// message, which whoever reaches the socket chose, only as
// volume.ClipMessage shows it.
func (s *Server) NotifyRegistrationStatus(ctx context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	msg := volume.ClipMessage(st.GetError())
	s.mu.Lock()
	first := !s.status.Notified
	s.status = Status{Notified: true, Registered: st.GetPluginRegistered(), Error: msg, At: time.Now()}
	s.mu.Unlock()
	if first {
		close(s.notified)
	}
	if st.GetPluginRegistered() {
		s.log.Info("registered with kubelet", "driver", s.cfg.DriverName)
	} else {
		s.log.Error("kubelet refused the registration", "driver", s.cfg.DriverName, "error", msg)
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// Status returns the last status kubelet reported.
func (s *Server) Status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.status
}

// Notified is closed when kubelet reports a status for the first time.
func (s *Server) Notified() <-chan struct{} { return s.notified }

// Listen makes the registration socket (unixsock.Listen: 0600, or 0660
// with group gid): a stale socket from an earlier run is replaced, never
// one another plugin listens on (unixsock.ErrInUse) nor a file of another
// kind; the directory is created. Kubelet's watcher may
// dial the socket the moment it appears; the connection waits in the
// listen backlog until Serve answers it. Closing the listener removes the
// socket while it is still this one: a newer process may have replaced it.
func Listen(path string, gid int) (net.Listener, error) {
	l, err := unixsock.Listen(path, gid)
	if err != nil {
		return nil, fmt.Errorf("registration socket: %w", err)
	}
	return l, nil
}

// Bounds of what a client of the registration socket may ask of the
// server (docs/design.md, "Bounds of the gRPC servers"): kubelet's
// messages are an empty request and a status with a message of a few
// lines, and its calls come one at a time.
const (
	maxRequestBytes = 64 << 10
	maxHeaderBytes  = 64 << 10
	maxStreams      = 8
)

// Serve answers on l until ctx ends, then stops and removes the socket, so
// kubelet unregisters the plugin.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	srv := grpc.NewServer(
		grpc.MaxRecvMsgSize(maxRequestBytes),
		grpc.MaxHeaderListSize(maxHeaderBytes),
		grpc.MaxConcurrentStreams(maxStreams),
	)
	registerapi.RegisterRegistrationServer(srv, s)
	path := l.Addr().String()
	s.log.Info("serving kubelet plugin registration", "socket", path, "driver", s.cfg.DriverName, "endpoint", s.cfg.Endpoint)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	var err error
	select {
	case <-ctx.Done():
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(5 * time.Second):
			srv.Stop()
		}
		<-errc
	case err = <-errc:
	}
	// Removes the socket, so kubelet unregisters the plugin.
	if cerr := l.Close(); cerr != nil && !errors.Is(cerr, net.ErrClosed) {
		s.log.Warn("close registration socket", "socket", path, "error", cerr)
	}
	if err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("kubelet registration: %w", err)
	}
	return nil
}
