package csi

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// idleRSSTarget is what the plugin may hold resident while idle.
const idleRSSTarget = 40 << 20

// BenchmarkPluginIdleRSS runs the real binary (sparsevol-csi, metrics
// on), serves a few calls of every service, lets it settle and prints its
// resident set size. The loop measures a Probe round trip.
func BenchmarkPluginIdleRSS(b *testing.B) {
	testutil.RequireRoot(b)
	dir := b.TempDir()
	bin := filepath.Join(dir, "sparsevol")
	if out, err := exec.Command("go", "build", "-trimpath", "-o", bin, "../../cmd/sparsevol-csi").CombinedOutput(); err != nil {
		b.Fatalf("build: %v: %s", err, out)
	}
	root := filepath.Join(dir, "store")
	if err := os.Mkdir(root, 0o700); err != nil {
		b.Fatal(err)
	}
	sockDir, err := os.MkdirTemp("", "svbench")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(sockDir) })
	sock := filepath.Join(sockDir, "csi.sock")
	cmd := exec.Command(bin, "--root", root, "--endpoint", "unix://"+sock, "--node-id", "bench",
		"--metrics-address", "127.0.0.1:0", "--log-level", "warn")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		cmd.Wait()
	})
	start := time.Now()
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Since(start) > 10*time.Second {
			b.Fatal("plugin did not create its socket within 10 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	startup := time.Since(start)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ctx := context.Background()
	ident, ctrl, node := csi.NewIdentityClient(conn), csi.NewControllerClient(conn), csi.NewNodeClient(conn)
	for range 10 {
		if _, err := ident.Probe(ctx, &csi.ProbeRequest{}); err != nil {
			b.Fatal(err)
		}
		if _, err := ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{}); err != nil {
			b.Fatal(err)
		}
		if _, err := ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{}); err != nil {
			b.Fatal(err)
		}
		if _, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{}); err != nil {
			b.Fatal(err)
		}
	}
	b.ResetTimer()
	for b.Loop() {
		if _, err := ident.Probe(ctx, &csi.ProbeRequest{}); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	time.Sleep(2 * time.Second) // idle
	rss, err := residentBytes(cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(rss)/(1<<20), "idle-RSS-MiB")
	fmt.Printf("sparsevol-csi: idle RSS %.1f MiB (target < %d MiB), socket after %s\n", float64(rss)/(1<<20), idleRSSTarget>>20, startup.Round(time.Millisecond))
	if rss > idleRSSTarget {
		b.Errorf("idle RSS %d bytes exceeds the %d MiB target", rss, idleRSSTarget>>20)
	}
}

// residentBytes reads VmRSS of a process.
func residentBytes(pid int) (int64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS for pid %d", pid)
}
