package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
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

// healthInFlight is how many /healthz requests wait at once for a check
// under way; one more is answered 503 at once. A request that a fresh
// result answers does not wait and takes no place.
const healthInFlight = 8

// healthFresh is how long a finished check answers the requests that
// come after it: a flood of /healthz makes one check in this time.
const healthFresh = time.Second

// healthGate shares checks among /healthz requests: at most one check
// runs at a time, every request that comes while it runs or within
// healthFresh after it ends is answered with its result, and at most
// healthInFlight requests wait for one.
type healthGate struct {
	check HealthCheck
	log   *slog.Logger
	slots chan struct{} // a place for each waiting request

	mu   sync.Mutex
	last *healthRun // the check under way or the last one; guarded by mu
}

// healthRun is one check: err and ended are set before done closes.
type healthRun struct {
	done  chan struct{}
	err   error
	ended time.Time
}

// run returns the check that answers a request now: the last one if it
// is under way or fresh, else a new one it starts. The check runs under
// its own HealthTimeout, not under a request's context, so a client that
// goes away fails no other request.
func (g *healthGate) run() *healthRun {
	g.mu.Lock()
	defer g.mu.Unlock()
	if r := g.last; r != nil {
		select {
		case <-r.done:
			if time.Since(r.ended) < healthFresh {
				return r
			}
		default:
			return r
		}
	}
	r := &healthRun{done: make(chan struct{})}
	g.last = r
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), HealthTimeout)
		defer cancel()
		r.err = g.check(ctx)
		if r.err != nil {
			g.log.Warn("health check failed", "error", r.err)
		}
		r.ended = time.Now()
		close(r.done)
	}()
	return r
}

var errHealthBusy = errors.New("too many health checks wait already; ask again")

// wait returns the result of r, taking a place among the waiting
// requests unless r has ended; errHealthBusy if every place is taken,
// ctx's error if it ends first.
func (g *healthGate) wait(ctx context.Context, r *healthRun) error {
	select {
	case <-r.done:
		return r.err
	default:
	}
	select {
	case g.slots <- struct{}{}:
		defer func() { <-g.slots }()
	default:
		return errHealthBusy
	}
	select {
	case <-r.done:
		return r.err
	case <-ctx.Done():
		return fmt.Errorf("health check: %w", ctx.Err())
	}
}

// healthHandler answers /healthz: 200 "ok" when check passes within
// HealthTimeout, 503 with the reason when it does not, or at once when
// healthInFlight requests wait already. Checks are shared (healthGate):
// however many ask, check runs at most once at a time and once per
// healthFresh.
func healthHandler(check HealthCheck, log *slog.Logger) *healthGate {
	return &healthGate{check: check, log: log, slots: make(chan struct{}, healthInFlight)}
}

func (g *healthGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), HealthTimeout)
	defer cancel()
	if err := g.wait(ctx, g.run()); err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintln(w, "ok")
}
