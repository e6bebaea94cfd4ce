package attack

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// plugin is sparsevol-csi serving one case's store on a socket of its
// own, with a client connected to it.
type plugin struct {
	c       *kase
	store   string
	kubelet string // --kubelet-dir
	sockDir string
	sock    string
	cmd     *exec.Cmd
	stderr  *testutil.SyncBuffer
	conn    *grpc.ClientConn
	ctrl    csi.ControllerClient
	node    csi.NodeClient
}

var (
	kubeletDirOnce sync.Once
	kubeletDirOK   bool
)

// hasKubeletDir reports whether the plugin knows --kubelet-dir. The code
// before it had no notion of a kubelet directory; the plugin is then
// started without it, and the path cases show what it did.
func hasKubeletDir(t *testing.T) bool {
	kubeletDirOnce.Do(func() {
		out, _ := exec.Command(pluginBin, "--help").CombinedOutput()
		kubeletDirOK = strings.Contains(string(out), "--kubelet-dir")
		if !kubeletDirOK {
			t.Log("this sparsevol has no --kubelet-dir; the plugin runs without it")
		}
	})
	return kubeletDirOK
}

// startPlugin runs the plugin on a fresh store of the case under umask,
// with extra flags, and connects a client. Cleanup stops it (before the
// case's own cleanup unmounts and detaches what is left).
func (c *kase) startPlugin(umask string, extra ...string) *plugin {
	c.t.Helper()
	p := &plugin{c: c, store: c.store("csi-store"), kubelet: c.mkdir("kubelet")}
	// Socket paths are limited to 108 bytes: a short directory of its own.
	dir, err := os.MkdirTemp("/tmp", "atk-")
	if err != nil {
		c.t.Fatal(err)
	}
	p.sockDir, p.sock = dir, filepath.Join(dir, "csi.sock")
	c.t.Cleanup(func() { os.RemoveAll(dir) })
	args := []string{"--root", p.store, "--unit-dir", c.path("units"),
		"--endpoint", "unix://" + p.sock, "--node-id", "n", "--log-level", "debug"}
	if hasKubeletDir(c.t) {
		args = append(args, "--kubelet-dir", p.kubelet)
	}
	args = append(args, extra...)
	p.cmd = exec.Command("/bin/sh", append([]string{"-c", `umask "$0"; exec "$@"`, umask, pluginBin}, args...)...)
	// Relative paths resolve in a directory of the case, watched.
	p.cmd.Dir = c.mkdir("cwd")
	c.watch(p.cmd.Dir)
	p.stderr = &testutil.SyncBuffer{}
	p.cmd.Stdout, p.cmd.Stderr = p.stderr, p.stderr
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { p.cmd.Wait(); close(exited) }()
	c.t.Cleanup(func() {
		if p.conn != nil {
			p.conn.Close()
		}
		p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			p.cmd.Process.Kill()
			<-exited
		}
		if c.t.Failed() {
			c.t.Logf("plugin log:\n%s", p.stderr.String())
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(p.sock); err == nil {
			break
		}
		select {
		case <-exited:
			c.t.Fatalf("plugin exited: %s", p.stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("plugin socket %s did not appear: %s", p.sock, p.stderr.String())
		}
	}
	// The socket file exists from bind(2), a moment before listen(2):
	// calls wait for the connection instead of failing Unavailable.
	p.conn, err = grpc.NewClient("unix://"+p.sock, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		c.t.Fatal(err)
	}
	p.ctrl, p.node = csi.NewControllerClient(p.conn), csi.NewNodeClient(p.conn)
	return p
}

func ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func mountCap(fsType string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// createVolume asks for a volume over CSI and returns its id (the UUID).
func (p *plugin) createVolume(name string, size int64, params map[string]string) string {
	p.c.t.Helper()
	resp, err := p.ctrl.CreateVolume(ctx(p.c.t), &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap(params["fsType"])},
		Parameters:         params,
	})
	if err != nil {
		p.c.t.Fatalf("setup: CreateVolume %s: %v", name, err)
	}
	return resp.GetVolume().GetVolumeId()
}

// stagingPath and targetPath are where kubelet would stage and publish.
func (p *plugin) stagingPath(id string) string {
	return filepath.Join(p.kubelet, "plugins/kubernetes.io/csi/sparsevol.csi.io", id[:8], "globalmount")
}

func (p *plugin) targetPath(id string) string {
	return filepath.Join(p.kubelet, "pods/pod-"+id[:8]+"/volumes/kubernetes.io~csi/pv-"+id[:8]+"/mount")
}

func (p *plugin) stage(id, staging string) error { return p.stageAs(id, staging, "ext4") }

// stageAs stages a mount volume of filesystem fsType.
func (p *plugin) stageAs(id, staging, fsType string) error {
	_, err := p.node.NodeStageVolume(ctx(p.c.t), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap(fsType),
	})
	return err
}

func (p *plugin) mustStage(id string) string {
	p.c.t.Helper()
	staging := p.stagingPath(id)
	if err := p.stage(id, staging); err != nil {
		p.c.t.Fatalf("setup: NodeStageVolume %s: %v", id, err)
	}
	return staging
}

func (p *plugin) unstage(id, staging string) error {
	_, err := p.node.NodeUnstageVolume(ctx(p.c.t), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
	return err
}

func (p *plugin) publish(id, staging, target string) error {
	_, err := p.node.NodePublishVolume(ctx(p.c.t), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: mountCap("ext4"),
	})
	return err
}

func (p *plugin) unpublish(id, target string) error {
	_, err := p.node.NodeUnpublishVolume(ctx(p.c.t), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
	return err
}

// backingFile is the path sparsevol keeps a volume's data in.
func (p *plugin) backingFile(id string) string { return filepath.Join(p.store, id) }

// expectGRPC fails the case unless err carries one of codes.
func (c *kase) expectGRPC(err error, want ...codes.Code) {
	c.t.Helper()
	got := status.Code(err)
	for _, w := range want {
		if got == w {
			return
		}
	}
	c.t.Errorf("want gRPC %v, got %v: %v", want, got, err)
}
