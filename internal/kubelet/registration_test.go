package kubelet

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/unixsock"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// serve starts a registration server on a real unix socket in a fresh
// plugins_registry-like directory and returns a client of kubelet's side.
func serve(t *testing.T, cfg Config) (*Server, string, registerapi.RegistrationClient, context.CancelFunc, <-chan error) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "plugins_registry")
	sock, err := SocketPath(dir+"/", cfg.DriverName)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	l, err := Listen(sock, unixsock.NoGroup)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(); cancel() })
	return srv, sock, registerapi.NewRegistrationClient(conn), cancel, done
}

func TestGetInfoAndStatus(t *testing.T) {
	srv, sock, client, cancel, done := serve(t, Config{DriverName: "sparsevol.example.com", Endpoint: "/var/lib/kubelet/plugins/sparsevol/csi.sock"})
	if filepath.Base(sock) != "sparsevol.example.com-reg.sock" {
		t.Errorf("socket name %s, want <driver>-reg.sock", sock)
	}
	ctx, c := context.WithTimeout(context.Background(), 10*time.Second)
	defer c()

	info, err := client.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	if info.Type != "CSIPlugin" {
		t.Errorf("type %q, want CSIPlugin", info.Type)
	}
	if info.Name != "sparsevol.example.com" {
		t.Errorf("name %q", info.Name)
	}
	if info.Endpoint != "/var/lib/kubelet/plugins/sparsevol/csi.sock" {
		t.Errorf("endpoint %q", info.Endpoint)
	}
	if len(info.SupportedVersions) != 1 || info.SupportedVersions[0] != "1.0.0" {
		t.Errorf("versions %v, want [1.0.0]", info.SupportedVersions)
	}

	select {
	case <-srv.Notified():
		t.Fatal("notified before kubelet reported")
	default:
	}
	if _, err := client.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: false, Error: "driver name taken"}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
	<-srv.Notified()
	if st := srv.Status(); !st.Notified || st.Registered || st.Error != "driver name taken" {
		t.Errorf("status after refusal: %+v", st)
	}
	if _, err := client.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
	if st := srv.Status(); !st.Registered || st.Error != "" {
		t.Errorf("status after registration: %+v", st)
	}

	// Stopping removes the socket: kubelet unregisters the plugin.
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after cancel")
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("socket still there after stop: %v", err)
	}
}

// TestRefusalMessageClipped: the error message of a refusal comes from
// whoever reaches the socket; it is logged and kept in Status only as
// volume.ClipMessage shows it: no terminal escapes, no newlines, and a
// few hundred bytes of however many were sent.
func TestRefusalMessageClipped(t *testing.T) {
	var logs testutil.SyncBuffer
	srv, _, client, _, _ := serve(t, Config{DriverName: "sparsevol.example.com", Endpoint: "/var/lib/kubelet/plugins/sparsevol/csi.sock",
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	ctx, c := context.WithTimeout(context.Background(), 10*time.Second)
	defer c()
	hostile := "\x1b]0;owned\a\x1b[2J\nlevel=INFO msg=forged\n" + strings.Repeat("x", 32<<10)
	if _, err := client.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{Error: hostile}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
	printable := func(s string) bool {
		for i := 0; i < len(s); i++ {
			if s[i] < 0x20 || s[i] >= 0x7f {
				return false
			}
		}
		return true
	}
	st := srv.Status()
	if st.Error != volume.ClipMessage(hostile) || len(st.Error) > 600 || !printable(st.Error) {
		t.Errorf("status error = %.100q (%d bytes); want volume.ClipMessage of it", st.Error, len(st.Error))
	}
	// The serving line comes first; the refusal is all that follows it.
	_, line, _ := strings.Cut(strings.TrimSuffix(logs.String(), "\n"), "\n")
	if strings.Contains(line, "\n") || !printable(line) || len(line) > 1024 || !strings.Contains(line, "kubelet refused the registration") {
		t.Errorf("log of the refusal = %.200q (%d bytes); want one printable line of a few hundred bytes", line, len(line))
	}
}

// TestServerBounds: a status message beyond maxRequestBytes is refused
// with ResourceExhausted and never recorded; kubelet's own fits.
func TestServerBounds(t *testing.T) {
	srv, _, client, _, _ := serve(t, Config{DriverName: "sparsevol.example.com", Endpoint: "/var/lib/kubelet/plugins/sparsevol/csi.sock"})
	ctx, c := context.WithTimeout(context.Background(), 10*time.Second)
	defer c()
	_, err := client.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{Error: strings.Repeat("x", maxRequestBytes)})
	if status.Code(err) != codes.ResourceExhausted {
		t.Errorf("status of %d bytes: %v; want ResourceExhausted", maxRequestBytes, err)
	}
	if st := srv.Status(); st.Notified {
		t.Errorf("a refused status was recorded: %+v", st)
	}
	msg := "RegisterPlugin error -- plugin registration failed with err: " + strings.Repeat("x", 4<<10)
	if _, err := client.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{Error: msg}); err != nil {
		t.Errorf("status of %d bytes: %v", len(msg), err)
	}
}

func TestCustomVersions(t *testing.T) {
	_, _, client, _, _ := serve(t, Config{DriverName: "d", Endpoint: "/csi/csi.sock", Versions: []string{"1.5.0", "1.0.0"}})
	info, err := client.GetInfo(context.Background(), &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.SupportedVersions) != 2 || info.SupportedVersions[0] != "1.5.0" {
		t.Errorf("versions %v", info.SupportedVersions)
	}
}

func TestNewValidates(t *testing.T) {
	for _, cfg := range []Config{
		{Endpoint: "/csi/csi.sock"},
		{DriverName: "d"},
		{DriverName: "d", Endpoint: "csi.sock"},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v) accepted", cfg)
		}
	}
}

// TestSocketPath: a directory gets the driver's socket name in it, a file
// path is the socket; a relative or unclean path is refused (want "").
func TestSocketPath(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct{ in, want string }{
		{dir, filepath.Join(dir, "drv-reg.sock")},
		{dir + "/", filepath.Join(dir, "drv-reg.sock")},
		{"/var/lib/kubelet/plugins_registry/", "/var/lib/kubelet/plugins_registry/drv-reg.sock"},
		{"/var/lib/kubelet/plugins_registry/x.sock", "/var/lib/kubelet/plugins_registry/x.sock"},
		{"plugins_registry/", ""},
		{"x.sock", ""},
		{"", ""},
		{"/var/lib/kubelet/../plugins_registry/", ""},
		{"/var/lib/kubelet//plugins_registry/x.sock", ""},
		{"/var/lib/kubelet/plugins_registry//", ""},
		{"/var/lib/kubelet/./x.sock", ""},
	} {
		got, err := SocketPath(c.in, "drv")
		if got != c.want || (c.want == "") != (err != nil) {
			t.Errorf("SocketPath(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
}

func TestListenReplacesStaleSocketOnly(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "reg.sock")
	// A socket left by a killed process.
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	l2, err := Listen(sock, unixsock.NoGroup)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	l2.Close()

	file := filepath.Join(dir, "not-a-socket")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(file, unixsock.NoGroup); err == nil {
		t.Fatal("Listen replaced a regular file")
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "x" {
		t.Fatalf("regular file changed: %q %v", b, err)
	}
}

// A newer process that took over the socket path keeps its socket when the
// older one stops.
func TestStopKeepsReplacedSocket(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "reg.sock")
	srv, err := New(Config{DriverName: "d", Endpoint: "/csi/csi.sock"})
	if err != nil {
		t.Fatal(err)
	}
	l, err := Listen(sock, unixsock.NoGroup)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	// Listen refuses a live socket: the newer process finds the path
	// free, as after a removal by hand.
	if _, err := Listen(sock, unixsock.NoGroup); !errors.Is(err, unixsock.ErrInUse) {
		t.Fatalf("listen on a live socket: %v, want ErrInUse", err)
	}
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	l2, err := Listen(sock, unixsock.NoGroup) // the newer process
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(sock); err != nil {
		t.Fatalf("the newer process's socket was removed: %v", err)
	}
}
