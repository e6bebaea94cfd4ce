package csi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/sparsevol/sparsevol/internal/iolimit"
	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/unixsock"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// testEnv is one plugin serving a store of its own on a real unix socket.
type testEnv struct {
	dir     string // everything of this env lives below
	kubelet string // the plugin's kubelet directory: node paths go below
	store   *volume.Store
	drv     *Driver
	socket  string
	conn    *grpc.ClientConn
	ctrl    csi.ControllerClient
	node    csi.NodeClient
	ident   csi.IdentityClient
	group   csi.GroupControllerClient
	metrics *Metrics

	tmpfs string // store mount point, if on its own tmpfs

	mu      sync.Mutex
	created map[string]bool // volume ids this env's plugin handed out
	reached int             // calls that reached the driver
}

const testNodeID = "node-under-test"

// envOptions tune newTestEnv.
type envOptions struct {
	// tmpfsBytes, if set, puts the store on a tmpfs of that size, so that
	// capacity tests see a filesystem nothing else writes to.
	tmpfsBytes int64
	// overcommit is the store's overcommit ratio (0: the default, 1).
	overcommit float64
	// limits says where I/O limits go (a test's own cgroup; the zero
	// value is the node's pods' cgroup).
	limits iolimit.Config
	// log, if set, receives the plugin's log from level Info on, instead
	// of stderr.
	log io.Writer
}

// newTestEnv starts a plugin for t. At cleanup it checks that no loop
// device of the env's volumes is left, then removes whatever is.
func newTestEnv(t testing.TB, opts ...envOptions) *testEnv {
	t.Helper()
	testutil.RequireRoot(t)
	var o envOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	dir := t.TempDir()
	e := &testEnv{dir: dir, kubelet: filepath.Join(dir, "kubelet"), created: map[string]bool{}}
	if err := os.Mkdir(e.kubelet, 0o750); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "store")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	if o.tmpfsBytes > 0 {
		if err := unix.Mount("tmpfs", root, "tmpfs", 0, fmt.Sprintf("size=%d,mode=0700", o.tmpfsBytes)); err != nil {
			t.Fatalf("mount tmpfs store: %v", err)
		}
		e.tmpfs = root
	}
	// The plugin's log goes to stderr with -v (SPARSEVOL_TEST_LOG=debug
	// for everything); otherwise only errors.
	level := slog.LevelError
	if testing.Verbose() {
		level = slog.LevelWarn
	}
	if os.Getenv("SPARSEVOL_TEST_LOG") == "debug" {
		level = slog.LevelDebug
	}
	var logTo io.Writer = os.Stderr
	if o.log != nil {
		logTo, level = o.log, slog.LevelInfo
	}
	log := slog.New(slog.NewTextHandler(logTo, &slog.HandlerOptions{Level: level}))
	off := false
	store, err := volume.Open(root, volume.Options{Logger: log, DirectIO: &off, OvercommitRatio: o.overcommit, IOLimits: o.limits})
	if err != nil {
		t.Fatal(err)
	}
	e.store = store
	e.metrics = NewMetrics(store)
	drv, err := New(Config{NodeID: testNodeID, Store: store, Logger: log, Metrics: e.metrics, MaxVolumes: 100, KubeletDir: e.kubelet})
	if err != nil {
		t.Fatal(err)
	}
	e.drv = drv
	// Socket paths are limited to 108 bytes; keep this one short.
	sockDir, err := os.MkdirTemp("", "svcsi")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	e.socket = filepath.Join(sockDir, "csi.sock")
	l, err := Listen(e.socket, unixsock.NoGroup)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(append(serverOptions(), grpc.ChainUnaryInterceptor(e.record, drv.intercept))...)
	csi.RegisterIdentityServer(srv, drv)
	csi.RegisterControllerServer(srv, drv)
	csi.RegisterNodeServer(srv, drv)
	csi.RegisterGroupControllerServer(srv, drv)
	go srv.Serve(l)
	conn, err := grpc.NewClient("unix://"+e.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	e.conn = conn
	e.ctrl, e.node, e.ident = csi.NewControllerClient(conn), csi.NewNodeClient(conn), csi.NewIdentityClient(conn)
	e.group = csi.NewGroupControllerClient(conn)
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
		e.cleanup(t)
	})
	return e
}

// record counts the calls that reach the driver and notes every volume
// id CreateVolume returns, for the leak check.
func (e *testEnv) record(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	resp, err := h(ctx, req)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.reached++
	if r, ok := resp.(*csi.CreateVolumeResponse); ok && err == nil {
		e.created[r.GetVolume().GetVolumeId()] = true
	}
	return resp, err
}

// calls is how many calls reached the driver (record saw them).
func (e *testEnv) calls() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.reached
}

// leakedDevices lists loop devices still bound to volumes of this env.
func (e *testEnv) leakedDevices() ([]string, error) {
	devs, err := loop.List()
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []string
	for _, d := range devs {
		if id, ok := strings.CutPrefix(d.Tag, "sparsevol:"); ok && e.created[id] {
			out = append(out, d.Path+" ("+id+")")
		}
	}
	return out, nil
}

// cleanup reports leaked loop devices as a test error, then unmounts
// everything below the env's directory and deletes every volume, so a
// failed test does not leave kernel state behind for the next.
func (e *testEnv) cleanup(t testing.TB) {
	t.Helper()
	vols, _ := e.store.List()
	leaked, err := e.leakedDevices()
	if err != nil {
		t.Errorf("list loop devices: %v", err)
	}
	if len(leaked) > 0 && !t.Failed() {
		t.Errorf("loop devices left attached after the test: %v", leaked)
	}
	unmountBelow(t, e.dir, e.tmpfs)
	for _, v := range vols {
		if err := e.store.Delete(context.Background(), v.UUID, volume.DetachOptions{}); err != nil && !errors.Is(err, volume.ErrNotFound) {
			t.Errorf("cleanup: delete %s: %v", v.Name, err)
		}
	}
	if e.tmpfs != "" {
		if err := unix.Unmount(e.tmpfs, 0); err != nil {
			t.Errorf("cleanup: unmount store tmpfs: %v", err)
		}
	}
}

// unmountBelow unmounts every mount point under dir but keep, deepest first.
func unmountBelow(t testing.TB, dir, keep string) {
	t.Helper()
	for range 10 {
		data, err := os.ReadFile("/proc/self/mountinfo")
		if err != nil {
			t.Errorf("read mountinfo: %v", err)
			return
		}
		var points []string
		for _, line := range strings.Split(string(data), "\n") {
			f := strings.Fields(line)
			if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") && f[4] != keep {
				points = append(points, f[4])
			}
		}
		if len(points) == 0 {
			return
		}
		for i := len(points) - 1; i >= 0; i-- {
			if err := unix.Unmount(points[i], 0); err != nil && !errors.Is(err, unix.EINVAL) {
				t.Logf("cleanup: unmount %s: %v", points[i], err)
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// mustExist fails unless path exists.
func mustExist(t testing.TB, path string) {
	t.Helper()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
