package csi

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TestHealthz serves /metrics and /healthz as Run does and checks that
// /healthz follows the plugin's socket: ok while it answers, 503 once the
// socket is gone.
func TestHealthz(t *testing.T) {
	e := newTestEnv(t)
	check := SocketProbe(e.socket)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeMetrics(ctx, l, e.metrics, check, slog.New(slog.DiscardHandler)) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ServeMetrics: %v", err)
		}
	})
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + l.Addr().String() + path)
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
	// reach the plugin, so it is not healthy.
	if err := os.Remove(e.socket); err != nil {
		t.Fatal(err)
	}
	if code, body := get("/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, e.socket) {
		t.Errorf("/healthz without the socket: %d %q, want 503 naming the socket", code, body)
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
