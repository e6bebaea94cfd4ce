package csi

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TestHealthz serves /metrics and /healthz as Run does and checks that
// /healthz follows the plugin's socket: ok while it answers, 503 once the
// socket is gone.
func TestHealthz(t *testing.T) {
	e := newTestEnv(t)
	addr := serveHealth(t, e.metrics, SocketProbe(e.socket))
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}

	if code, body := get("/healthz"); code != http.StatusOK || strings.TrimSpace(body) != "ok" {
		t.Errorf("/healthz of a serving plugin: %d %q, want 200 ok", code, body)
	}
	if code, body := get("/metrics"); code != http.StatusOK || !strings.Contains(body, "sparsevol_store_capacity_bytes") {
		t.Errorf("/metrics: %d, lacks the store gauges", code)
	}
	// The socket gone (a removed plugin directory): kubelet could not
	// reach the plugin, so it is not healthy once the last result is
	// no longer fresh.
	if err := os.Remove(e.socket); err != nil {
		t.Fatal(err)
	}
	time.Sleep(healthFresh)
	if code, body := get("/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, e.socket) {
		t.Errorf("/healthz without the socket: %d %q, want 503 naming the socket", code, body)
	}
}

// serveHealth serves m and health as Run does on a loopback port until
// the test ends, and returns the address.
func serveHealth(t *testing.T, m *Metrics, health HealthCheck) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeMetrics(ctx, l, m, health, slog.New(slog.DiscardHandler)) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ServeMetrics: %v", err)
		}
	})
	return l.Addr().String()
}

// TestHealthzShared floods /healthz of a real plugin, as anyone on the
// pod network can: the probes share checks, so the store is looked at a
// bounded number of times, and no request waits long.
func TestHealthzShared(t *testing.T) {
	e := newTestEnv(t)
	var checks atomic.Int64
	probe := SocketProbe(e.socket)
	addr := serveHealth(t, e.metrics, func(ctx context.Context) error {
		checks.Add(1)
		return probe(ctx)
	})
	const clients, each = 50, 4
	client := &http.Client{Timeout: 10 * time.Second}
	start := time.Now()
	var wg sync.WaitGroup
	var ok, slowest atomic.Int64
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				began := time.Now()
				resp, err := client.Get("http://" + addr + "/healthz")
				if err != nil {
					t.Errorf("/healthz: %v", err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					ok.Add(1)
				}
				d := int64(time.Since(began))
				for s := slowest.Load(); d > s && !slowest.CompareAndSwap(s, d); s = slowest.Load() {
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	// One check per healthFresh, and one more at the start.
	if n, most := checks.Load(), int64(elapsed/healthFresh)+2; n > most {
		t.Errorf("%d /healthz in %v ran %d checks, want at most %d", clients*each, elapsed, n, most)
	}
	if ok.Load() == 0 {
		t.Errorf("none of %d /healthz of a serving plugin answered 200", clients*each)
	}
	if s := time.Duration(slowest.Load()); s > 2*time.Second {
		t.Errorf("the slowest /healthz took %v, want well under kubelet's probe timeout", s)
	}
}

// TestHealthzWaitersBounded: while healthInFlight requests wait for a
// check that hangs, one more is answered 503 at once; the waiting ones
// get the check's one result.
func TestHealthzWaitersBounded(t *testing.T) {
	var checks atomic.Int64
	entered, release := make(chan struct{}, 1), make(chan struct{})
	g := healthHandler(func(ctx context.Context) error {
		checks.Add(1)
		entered <- struct{}{}
		<-release
		return nil
	}, slog.New(slog.DiscardHandler))
	released := false
	t.Cleanup(func() {
		if !released {
			close(release)
		}
	})
	get := func() int {
		w := httptest.NewRecorder()
		g.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/healthz", nil))
		return w.Code
	}
	codes := make(chan int, healthInFlight)
	for range healthInFlight {
		go func() { codes <- get() }()
	}
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no request started a check")
	}
	for deadline := time.Now().Add(10 * time.Second); len(g.slots) < healthInFlight; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests wait, want %d", len(g.slots), healthInFlight)
		}
	}
	began := time.Now()
	if code := get(); code != http.StatusServiceUnavailable {
		t.Errorf("/healthz while %d wait: %d, want 503", healthInFlight, code)
	}
	if d := time.Since(began); d > time.Second {
		t.Errorf("/healthz while %d wait took %v, want an answer at once", healthInFlight, d)
	}
	close(release)
	released = true
	for range healthInFlight {
		if code := <-codes; code != http.StatusOK {
			t.Errorf("a waiting /healthz: %d, want 200", code)
		}
	}
	if n := checks.Load(); n != 1 {
		t.Errorf("%d waiting requests ran %d checks, want one shared", healthInFlight, n)
	}
}

// blockingCollector holds every scrape in Collect until release closes,
// after telling entered.
type blockingCollector struct {
	entered chan struct{}
	release chan struct{}
}

var blockingDesc = prometheus.NewDesc("sparsevol_test_blocking", "A scrape held by the test.", nil, nil)

func (c blockingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- blockingDesc }

func (c blockingCollector) Collect(ch chan<- prometheus.Metric) {
	c.entered <- struct{}{}
	<-c.release
	ch <- prometheus.MustNewConstMetric(blockingDesc, prometheus.GaugeValue, 1)
}

// TestMetricsScrapesBounded: while metricsInFlight scrapes are being
// served, one more is answered 503 at once instead of making the plugin
// look at every volume once more; the held ones are then served.
func TestMetricsScrapesBounded(t *testing.T) {
	m := NewMetrics(nil)
	c := blockingCollector{entered: make(chan struct{}, 2*metricsInFlight), release: make(chan struct{})}
	m.Registry.MustRegister(c)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeMetrics(ctx, l, m, nil, slog.New(slog.DiscardHandler)) }()
	released := false
	t.Cleanup(func() {
		if !released {
			close(c.release)
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ServeMetrics: %v", err)
		}
	})
	url := "http://" + l.Addr().String() + "/metrics"
	codes := make(chan int, metricsInFlight)
	for range metricsInFlight {
		go func() {
			resp, err := http.Get(url)
			if err != nil {
				codes <- 0
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes <- resp.StatusCode
		}()
	}
	for range metricsInFlight {
		select {
		case <-c.entered:
		case <-time.After(10 * time.Second):
			t.Fatal("the held scrapes never reached the collector")
		}
	}
	client := &http.Client{Timeout: 5 * time.Second}
	if resp, err := client.Get(url); err != nil {
		t.Errorf("scrape %d while %d are served: %v, want 503 at once", metricsInFlight+1, metricsInFlight, err)
	} else {
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("scrape %d while %d are served: %d, want 503", metricsInFlight+1, metricsInFlight, resp.StatusCode)
		}
	}
	close(c.release)
	released = true
	for range metricsInFlight {
		if code := <-codes; code != http.StatusOK {
			t.Errorf("a held scrape: %d, want 200", code)
		}
	}
}
