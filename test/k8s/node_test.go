//go:build e2e

package k8s

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
	"github.com/sparsevol/sparsevol/test/k8s/bins"
	"github.com/sparsevol/sparsevol/test/k8s/oci"
)

const (
	nodeIP   = "192.168.77.10"
	nodeName = vmrun.Hostname
	libDir   = "usr/local/lib/sparsevol-k8s"
)

// The node's services, installed and enabled in every run's root image.
var nodeUnits = []string{
	"k8s-net.service", "etcd.service", "kube-apiserver.service", "kube-controller-manager.service",
	"kube-scheduler.service", "k8s-images.service", "kubelet.service", "snapshot-controller.service",
}

// installNode writes into the mounted root image everything that makes it a
// one-node cluster: binaries, PKI, kubeconfig, kubelet and CNI config,
// images, units.
func installNode(mnt string, bin bins.Result) error {
	// Binaries.
	for _, b := range bins.Names {
		if err := vmrun.CopyFile(bin.Path(b), filepath.Join(mnt, "usr/local/bin", b), 0o755); err != nil {
			return err
		}
	}
	// Units, and their helper scripts beside the suite's other files.
	unitFiles, err := fs.Glob(guestFiles, "guest/units/*")
	if err != nil {
		return err
	}
	var files []vmrun.File
	for _, f := range unitFiles {
		name := filepath.Base(f)
		if strings.HasSuffix(name, ".sh") {
			files = append(files, vmrun.File{Src: f, Dst: filepath.Join(libDir, name), Mode: 0o755})
		} else {
			files = append(files, vmrun.File{Src: f, Dst: filepath.Join("etc/systemd/system", name), Mode: 0o644})
		}
	}
	if err := vmrun.InstallFiles(guestFiles, mnt, files...); err != nil {
		return err
	}
	if err := vmrun.EnableUnits(mnt, nodeUnits...); err != nil {
		return err
	}
	// Every stop is bounded (a container ignoring SIGTERM would hold a
	// reboot for 90 s).
	if err := vmrun.WriteFile(filepath.Join(mnt, "etc/systemd/system.conf.d/e2e-k8s.conf"),
		[]byte("[Manager]\nDefaultTimeoutStopSec=15s\n"), 0o644); err != nil {
		return err
	}

	// PKI and credentials.
	pki, err := newPKI()
	if err != nil {
		return err
	}
	for name, data := range pki.files {
		if err := vmrun.WriteFile(filepath.Join(mnt, "etc/kubernetes/pki", name), data, 0o600); err != nil {
			return err
		}
	}
	token := pki.token
	if err := vmrun.WriteFile(filepath.Join(mnt, "etc/kubernetes/tokens.csv"),
		[]byte(token+",admin,admin,\"system:masters\"\n"), 0o600); err != nil {
		return err
	}
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority: /etc/kubernetes/pki/ca.crt
users:
- name: admin
  user:
    token: %s
contexts:
- name: e2e
  context:
    cluster: e2e
    user: admin
current-context: e2e
`, token)
	if err := vmrun.WriteFile(filepath.Join(mnt, "etc/kubernetes/admin.kubeconfig"), []byte(kubeconfig), 0o600); err != nil {
		return err
	}
	kubelet := `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: systemd
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
failSwapOn: false
resolvConf: /etc/resolv.conf
# The image is small and lives a few minutes: no disk-pressure evictions,
# no image garbage collection of the locally imported images.
evictionHard:
  memory.available: "50Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
  nodefs.inodesFree: "1%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
`
	if err := vmrun.WriteFile(filepath.Join(mnt, "etc/kubernetes/kubelet.yaml"), []byte(kubelet), 0o644); err != nil {
		return err
	}
	cni := `{
  "cniVersion": "1.0.0",
  "name": "e2e",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "10.244.0.0/24"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
`
	if err := vmrun.WriteFile(filepath.Join(mnt, "etc/cni/net.d/10-e2e.conflist"), []byte(cni), 0o644); err != nil {
		return err
	}
	// Images: pause (the pod sandbox) and busybox, from the image's own
	// busybox-static.
	busybox, err := os.ReadFile(filepath.Join(mnt, "bin/busybox"))
	if err != nil {
		return fmt.Errorf("busybox-static in the node image: %w", err)
	}
	applets := busyboxApplets(filepath.Join(mnt, "bin/busybox"))
	var archive bytes.Buffer
	if err := oci.WriteArchive(&archive, busybox, applets, []oci.Image{
		{Name: "localhost/pause:1", Entrypoint: oci.PauseCommand},
		{Name: "localhost/busybox:1", Cmd: []string{"sh"}},
	}); err != nil {
		return err
	}
	if err := vmrun.WriteFile(filepath.Join(mnt, libDir, "images.tar"), archive.Bytes(), 0o644); err != nil {
		return err
	}
	// The sidecars the DaemonSet runs, as images of their binaries.
	var sidecars []oci.Binary
	for _, s := range []struct{ name, version string }{
		{"csi-provisioner", bins.ProvisionerVersion}, {"csi-snapshotter", bins.SnapshotterVersion},
	} {
		data, err := os.ReadFile(bin.Path(s.name))
		if err != nil {
			return err
		}
		sidecars = append(sidecars, oci.Binary{Name: "localhost/" + s.name + ":" + s.version, Path: s.name, Data: data})
	}
	archive.Reset()
	if err := oci.WriteBinaries(&archive, sidecars); err != nil {
		return err
	}
	if err := vmrun.WriteFile(filepath.Join(mnt, libDir, "images/sidecars.tar"), archive.Bytes(), 0o644); err != nil {
		return err
	}
	// The snapshot CRDs: the kustomization's snapshot classes need them.
	crds, err := bin.Files("crd")
	if err != nil {
		return err
	}
	for _, f := range crds {
		if err := vmrun.CopyFile(f, filepath.Join(mnt, libDir, "crd", filepath.Base(f)), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// Plugin images: localhost/sparsevol:1 and :2, two builds of this checkout
// with the version strings pluginVersions (the second is the upgrade's).
var pluginVersions = []string{"e2e-1", "e2e-2"}

// installPlugin builds the plugin images as `make image` does (a static
// build, then tools/image) and installs what `kubectl apply -k` takes:
// deploy/kubernetes as the base and test/k8s's overlay (guest/overlay),
// which points the images at the ones built here.
func installPlugin(mnt, repo, goCmd string) error {
	work, err := os.MkdirTemp("", "sparsevol-k8s-images")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	for i, v := range pluginVersions {
		bin := filepath.Join(work, "sparsevol-csi-"+v)
		build := exec.Command(goCmd, "build", "-trimpath", "-o", bin,
			"-ldflags", "-s -w -X github.com/sparsevol/sparsevol/internal/cli.version="+v, "./cmd/sparsevol-csi")
		build.Dir = repo
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			return fmt.Errorf("build sparsevol-csi %s: %w: %s", v, err, out)
		}
		tar := filepath.Join(mnt, libDir, "images", fmt.Sprintf("sparsevol-%d.tar", i+1))
		if err := os.MkdirAll(filepath.Dir(tar), 0o755); err != nil {
			return err
		}
		img := exec.Command(goCmd, "-C", filepath.Join(repo, "tools/image"), "run", ".",
			"-bin", bin, "-name", fmt.Sprintf("localhost/sparsevol:%d", i+1), "-out", tar)
		if out, err := img.CombinedOutput(); err != nil {
			return fmt.Errorf("plugin image %s: %w: %s", v, err, out)
		}
	}
	base, err := filepath.Glob(filepath.Join(repo, "deploy/kubernetes/*.yaml"))
	if err != nil || len(base) == 0 {
		return fmt.Errorf("deploy/kubernetes: no manifests (%v)", err)
	}
	for _, f := range base {
		if err := vmrun.CopyFile(f, filepath.Join(mnt, libDir, "deploy/base", filepath.Base(f)), 0o644); err != nil {
			return err
		}
	}
	return vmrun.InstallFiles(guestFiles, mnt,
		vmrun.File{Src: "guest/overlay/kustomization.yaml", Dst: filepath.Join(libDir, "deploy/overlay/kustomization.yaml"), Mode: 0o644})
}

// busyboxApplets lists the applets of a static busybox (it runs on the host
// as well); a fixed list when it does not.
func busyboxApplets(path string) []string {
	out, err := exec.Command(path, "--list").Output()
	if err == nil && len(out) > 0 {
		return strings.Fields(string(out))
	}
	return strings.Fields("sh ash cat cp dd df echo env false grep head hexdump id ls mkdir mount mv od printf ps rm sed sh sleep stat sync tail tee test touch tr true umount wc [")
}

type pkiFiles struct {
	files map[string][]byte
	token string
}

// newPKI makes a CA, the apiserver's serving certificate (loopback, the
// node address, the first service IP, the kubernetes service names) and the
// service-account key pair.
func newPKI() (*pkiFiles, error) {
	p := &pkiFiles{files: map[string][]byte{}}
	tok := make([]byte, 24)
	rand.Read(tok)
	p.token = hex.EncodeToString(tok)

	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now().Add(-time.Hour)
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "sparsevol-e2e-ca"},
		NotBefore:             now,
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	caCert, _ := x509.ParseCertificate(caDER)
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	srvTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now,
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{"localhost", nodeName, "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(nodeIP), net.ParseIP("10.96.0.1")},
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, caCert, &srvKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	saPub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return nil, err
	}
	ecKey := func(k *ecdsa.PrivateKey) []byte {
		der, _ := x509.MarshalECPrivateKey(k)
		return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
	}
	p.files["ca.crt"] = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	p.files["apiserver.crt"] = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srvDER})
	p.files["apiserver.key"] = ecKey(srvKey)
	p.files["sa.key"] = pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(saKey)})
	p.files["sa.pub"] = pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: saPub})
	return p, nil
}
