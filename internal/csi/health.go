package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// HealthTimeout bounds one health check: a probe that takes longer is a
// failed one (kubelet's probe would time out as well).
const HealthTimeout = 5 * time.Second

// HealthCheck reports whether the plugin serves: nil when it does.
type HealthCheck func(ctx context.Context) error

// SocketProbe returns a HealthCheck that calls Identity.Probe over a new
// connection to the CSI socket at path, the way kubelet and the sidecars
// reach the plugin: it fails when the socket is gone or replaced, the gRPC
// server does not answer, or the store fails its check. Each check dials
// and closes its own connection, so a connection kept open cannot hide a
// removed socket.
func SocketProbe(path string) HealthCheck {
	return func(ctx context.Context) error {
		conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return fmt.Errorf("probe %s: %w", path, err)
		}
		defer conn.Close()
		resp, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
		if err != nil {
			return fmt.Errorf("probe %s: %w", path, err)
		}
		if r := resp.GetReady(); r != nil && !r.GetValue() {
			return fmt.Errorf("probe %s: %w", path, errNotReady)
		}
		return nil
	}
}

var errNotReady = errors.New("plugin says it is not ready")

// healthHandler answers /healthz: 200 "ok" when check passes within
// HealthTimeout, 503 with the reason when it does not.
func healthHandler(check HealthCheck, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), HealthTimeout)
		defer cancel()
		if err := check(ctx); err != nil {
			log.Warn("health check failed", "error", err)
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	})
}
