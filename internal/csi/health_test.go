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
