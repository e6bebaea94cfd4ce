package bins

import (
	"context"
	"os"
	"path/filepath"
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

func TestGroupKeys(t *testing.T) {
	gs := groups()
	seen := map[string]string{}
	for _, g := range gs {
		k := g.Key()
		if k != g.Key() || len(k) != 16 {
			t.Errorf("%s: key %q", g.name, k)
		}
		if other, ok := seen[k]; ok {
			t.Errorf("%s and %s share key %s", g.name, other, k)
		}
		seen[k] = g.name
	}
	// A group's key depends on that group alone: changing one group's
	// version changes its key and no other.
	changed := gs[len(gs)-1]
	changed.version = "v0.0.0-other"
	if changed.Key() == gs[len(gs)-1].Key() {
		t.Errorf("%s: key unchanged by its version", changed.name)
	}
	for _, g := range gs {
		if Dirs()[g.name] != g.name+"-"+g.Key() {
			t.Errorf("Dirs()[%s] = %s", g.name, Dirs()[g.name])
		}
	}
	// Every binary comes from exactly one group.
	from := map[string]string{}
	for _, g := range gs {
		for n := range g.pkgs {
			if from[n] != "" {
				t.Errorf("%s built by %s and %s", n, from[n], g.name)
			}
			from[n] = g.name
		}
	}
	for _, n := range Names {
		if from[n] == "" {
			t.Errorf("%s in Names but built by no group", n)
		}
	}
	if len(from) != len(Names) {
		t.Errorf("groups build %d binaries, Names lists %d", len(from), len(Names))
	}
}

// fillGroup makes dir a complete cache directory of g, with fake binaries.
func fillGroup(t *testing.T, dir string, g group) {
	t.Helper()
	for n := range g.pkgs {
		writeFile(t, filepath.Join(dir, "bin", n), "binary "+n)
	}
	for _, f := range g.files {
		writeFile(t, filepath.Join(dir, "files", f.dir, "b.yaml"), "b")
		writeFile(t, filepath.Join(dir, "files", f.dir, "a.yaml"), "a")
	}
	writeFile(t, filepath.Join(dir, "complete"), "key "+g.Key()+"\n")
}

func writeFile(t *testing.T, p, s string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

// A group missing from the cache is built alone: the complete groups are
// found as they are, and the go command runs only for the missing one.
func TestEnsureBuildsOnlyMissingGroups(t *testing.T) {
	cache := t.TempDir()
	gs := groups()
	missing := gs[len(gs)-1]
	for _, g := range gs[:len(gs)-1] {
		fillGroup(t, filepath.Join(cache, Dirs()[g.name]), g)
	}
	// A go command that records its calls and fails.
	calls := filepath.Join(t.TempDir(), "calls")
	fakeGo := filepath.Join(t.TempDir(), "go")
	writeFile(t, fakeGo, "#!/bin/sh\necho \"$PWD $*\" >> "+calls+"\nexit 3\n")
	if err := os.Chmod(fakeGo, 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := Ensure(context.Background(), Options{Cache: cache, Go: fakeGo})
	if err == nil || !strings.Contains(err.Error(), missing.name) {
		t.Fatalf("Ensure with %s missing: %v, want an error naming it", missing.name, err)
	}
	log, rerr := os.ReadFile(calls)
	if rerr != nil {
		t.Fatal(rerr)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(log)), "\n") {
		if !strings.Contains(line, Dirs()[missing.name]+".partial") {
			t.Errorf("go ran outside %s's build: %s", missing.name, line)
		}
	}
	for _, g := range gs[:len(gs)-1] {
		if !complete(filepath.Join(cache, Dirs()[g.name]), g) {
			t.Errorf("%s: complete cache directory disturbed", g.name)
		}
	}

	// With every group complete, nothing runs and every path resolves.
	fillGroup(t, filepath.Join(cache, Dirs()[missing.name]), missing)
	if err := os.Remove(calls); err != nil {
		t.Fatal(err)
	}
	res, err := Ensure(context.Background(), Options{Cache: cache, Go: fakeGo})
	if err != nil || !res.Cached {
		t.Fatalf("Ensure on a complete cache: cached %v, %v", res.Cached, err)
	}
	if _, err := os.Stat(calls); err == nil {
		t.Errorf("go ran on a complete cache")
	}
	for _, n := range Names {
		if b, err := os.ReadFile(res.Path(n)); err != nil || string(b) != "binary "+n {
			t.Errorf("Path(%s) = %s: %q, %v", n, res.Path(n), b, err)
		}
	}
	crds, err := res.Files("crd")
	if err != nil || len(crds) != 2 || filepath.Base(crds[0]) != "a.yaml" {
		t.Errorf("Files(crd) = %v, %v", crds, err)
	}
	if _, err := res.Files("nothing"); err == nil {
		t.Errorf("Files of an unknown directory: no error")
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
