package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// `sparsevol-csi --kubelet-registration-path DIR/` serves kubelet's
// plugin-registration API next to CSI in the same process: GetInfo names
// the CSI socket, kubelet's verdict is logged, and both sockets go away on
// SIGTERM (which makes kubelet unregister the plugin).
func TestCSIKubeletRegistration(t *testing.T) {
	dir := t.TempDir()
	root := filepath.Join(dir, "store")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	csiSock := filepath.Join(dir, "plugins", "sparsevol", "csi.sock")
	regDir := filepath.Join(dir, "plugins_registry")
	cmd := exec.Command(os.Args[0], "--root", root,
		"--endpoint", "unix://"+csiSock, "--node-id", "node-1",
		"--driver-name", "sparsevol.test.example",
		"--kubelet-registration-path", regDir+"/")
	cmd.Env = append(os.Environ(), asCLI+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		cmd.Process.Kill()
		if t.Failed() {
			t.Logf("plugin log:\n%s", stderr.String())
		}
	}()

	regSock := filepath.Join(regDir, "sparsevol.test.example-reg.sock")
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(regSock); err == nil {
			break
		}
		select {
		case err := <-exited:
			t.Fatalf("plugin exited before serving: %v\n%s", err, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no registration socket %s after 20s", regSock)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := os.Stat(csiSock); err != nil {
		t.Errorf("CSI socket missing while registration is served: %v", err)
	}

	conn, err := grpc.NewClient("unix://"+regSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := registerapi.NewRegistrationClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := client.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	if info.Type != "CSIPlugin" || info.Name != "sparsevol.test.example" || info.Endpoint != csiSock {
		t.Errorf("GetInfo = %+v, want CSIPlugin sparsevol.test.example at %s", info, csiSock)
	}
	if _, err := client.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}

	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("plugin exit after SIGTERM: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("plugin did not exit on SIGTERM")
	}
	if !strings.Contains(stderr.String(), "registered with kubelet") {
		t.Errorf("kubelet's verdict not logged:\n%s", stderr.String())
	}
	for _, s := range []string{regSock, csiSock} {
		if _, err := os.Lstat(s); !os.IsNotExist(err) {
			t.Errorf("%s left after exit (%v)", s, err)
		}
	}
}

// The registrar's flag of the same name takes the CSI socket; given that
// here, the plugin refuses (exit 2) instead of replacing its own socket.
func TestCSIKubeletRegistrationRefusesCSISocket(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	r := plugin(t, dir, "--endpoint", "unix://"+sock, "--node-id", "n",
		"--kubelet-registration-path", sock)
	if r.code != 2 || !strings.Contains(r.stderr, "plugins_registry") {
		t.Fatalf("exit %d, stderr %q; want exit 2 naming kubelet's plugin registry", r.code, r.stderr)
	}
}
