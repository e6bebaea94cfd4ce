package bins

import (
	"strings"
	"testing"
)

func TestWrapperGoModRewritesStaging(t *testing.T) {
	root := []byte(`module k8s.io/kubernetes

go 1.26.0

godebug default=go1.26

require (
	k8s.io/api v0.0.0
)

replace (
	k8s.io/api => ./staging/src/k8s.io/api // staging
	k8s.io/kubelet => ./staging/src/k8s.io/kubelet
)

replace example.com/x => example.com/y v1.2.3
`)
	out, err := WrapperGoMod("w", "k8s.io/kubernetes", "v1.37.2", root, func(m string) string { return m + " v0.37.2" })
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	for _, want := range []string{
		"module w\n", "go 1.26.0\n", "require k8s.io/kubernetes v1.37.2\n",
		"\tk8s.io/api => k8s.io/api v0.37.2\n",
		"\tk8s.io/kubelet => k8s.io/kubelet v0.37.2\n",
		"\texample.com/x => example.com/y v1.2.3\n",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("wrapper go.mod lacks %q:\n%s", want, s)
		}
	}
	if strings.Contains(s, "./staging") {
		t.Errorf("local path kept:\n%s", s)
	}
	// Without a staging rewrite, local replaces are dropped.
	out, err = WrapperGoMod("w", "r", "v1", root, nil)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), "k8s.io/api =>") || !strings.Contains(string(out), "example.com/x =>") {
		t.Errorf("nil staging:\n%s", out)
	}
}

func TestKeyIsStable(t *testing.T) {
	if Key() != Key() || len(Key()) != 16 {
		t.Errorf("key %q", Key())
	}
}

func TestBinaryName(t *testing.T) {
	for pkg, want := range map[string]string{
		"go.etcd.io/etcd/server/v3":                                             "server",
		"k8s.io/kubernetes/cmd/kubelet":                                         "kubelet",
		"github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner": "csi-provisioner",
		"example.com/v2ray":                                                     "v2ray",
	} {
		if got := BinaryName(pkg); got != want {
			t.Errorf("BinaryName(%s) = %s, want %s", pkg, got, want)
		}
	}
}
