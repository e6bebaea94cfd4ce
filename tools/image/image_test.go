package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// The tests build the real image: the packages come from the host's apt
// (cached in SPARSEVOL_IMAGE_CACHE, default /var/cache/sparsevol-image,
// as `make image` does), the binary from this checkout.

// testEpoch is every build's SOURCE_DATE_EPOCH here.
const testEpoch = "1700000000"

func TestMain(m *testing.M) {
	os.Setenv("SOURCE_DATE_EPOCH", testEpoch)
	code := m.Run()
	if binPath != "" && binErr == nil {
		os.RemoveAll(filepath.Dir(binPath))
	}
	if sharedPath != "" {
		os.RemoveAll(filepath.Dir(sharedPath))
	}
	os.Exit(code)
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("needs root (chroot into the image, the shared package cache)")
	}
}

func cacheDir() string {
	if d := os.Getenv("SPARSEVOL_IMAGE_CACHE"); d != "" {
		return d
	}
	return "/var/cache/sparsevol-image"
}

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// staticBinary builds ./cmd/sparsevol-csi of this checkout as make build does
// (CGO_ENABLED=0), once per test binary.
func staticBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "sparsevol-image-test")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "sparsevol-csi")
		cmd := exec.Command("go", "build", "-trimpath", "-o", binPath, "./cmd/sparsevol-csi")
		cmd.Dir = "../.."
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = err
			binPath = string(out)
		}
	})
	if binErr != nil {
		t.Fatalf("build sparsevol-csi: %v: %s", binErr, binPath)
	}
	return binPath
}

var (
	sharedOnce sync.Once
	shared     []byte
	sharedPath string
	sharedErr  error
)

// sharedArchive is one build with the default options and version
// "v1-test", made once for the tests that only read it.
func sharedArchive(t *testing.T) ([]byte, string) {
	t.Helper()
	bin := staticBinary(t)
	sharedOnce.Do(func() {
		dir, err := os.MkdirTemp("", "sparsevol-image-test")
		if err != nil {
			sharedErr = err
			return
		}
		sharedPath = filepath.Join(dir, "image.tar")
		if sharedErr = run(options{bin: bin, name: DefaultName, version: "v1-test", cache: cacheDir(), out: sharedPath}); sharedErr == nil {
			shared, sharedErr = os.ReadFile(sharedPath)
		}
	})
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return shared, sharedPath
}

// buildArchive runs the command as `make image` does.
func buildArchive(t *testing.T, o options) []byte {
	t.Helper()
	if o.bin == "" {
		o.bin = staticBinary(t)
	}
	if o.name == "" {
		o.name = DefaultName
	}
	o.cache = cacheDir()
	if o.out == "" {
		o.out = filepath.Join(t.TempDir(), "image.tar")
	}
	if err := run(o); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(o.out)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// ociImage reads the archive's OCI layout (as ctr images import does).
func ociImage(t *testing.T, archive []byte) (layout.Path, string) {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("tar", "-x", "-C", dir)
	cmd.Stdin = bytes.NewReader(archive)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("untar: %v: %s", err, out)
	}
	p, err := layout.FromPath(dir)
	if err != nil {
		t.Fatalf("OCI layout: %v", err)
	}
	return p, dir
}

func TestReproducible(t *testing.T) {
	requireRoot(t)
	a, _ := sharedArchive(t)
	b := buildArchive(t, options{version: "v1-test"})
	if !bytes.Equal(a, b) {
		t.Fatal("two builds from the same inputs differ")
	}
	// Another plugin version: another image, the same tools layer.
	c := buildArchive(t, options{version: "v2-test"})
	pa, _ := ociImage(t, a)
	pc, _ := ociImage(t, c)
	ia, ic := onlyImage(t, pa), onlyImage(t, pc)
	da, _ := ia.Digest()
	dc, _ := ic.Digest()
	if da == dc {
		t.Error("a different version string gives the same digest")
	}
	la, _ := ia.Layers()
	lc, _ := ic.Layers()
	if len(la) != 2 || len(lc) != 2 {
		t.Fatalf("layers: %d and %d, want tools and binary", len(la), len(lc))
	}
	ta, _ := la[0].Digest()
	tc, _ := lc[0].Digest()
	if ta != tc {
		t.Errorf("the tools layer differs between plugin versions: %s, %s", ta, tc)
	}
	cfg, err := ic.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.Config.Labels["org.opencontainers.image.version"]; got != "v2-test" {
		t.Errorf("version label %q", got)
	}
	if fmt.Sprint(cfg.Created.Unix()) != testEpoch {
		t.Errorf("created %s, want SOURCE_DATE_EPOCH", cfg.Created)
	}
}

// onlyImage is the one image of an OCI layout, checked to carry the name
// annotations ctr, docker and podman read.
func onlyImage(t *testing.T, p layout.Path) v1.Image {
	t.Helper()
	idx, err := p.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Manifests) != 1 {
		t.Fatalf("index has %d manifests, want 1", len(m.Manifests))
	}
	d := m.Manifests[0]
	for _, a := range []string{annotationContainerdName, annotationRefName} {
		if d.Annotations[a] != DefaultName {
			t.Errorf("index annotation %s = %q, want %s", a, d.Annotations[a], DefaultName)
		}
	}
	img, err := idx.Image(d.Digest)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// TestArchiveFormats: the one archive is an OCI layout and a docker save
// archive of the same image; skopeo (the library podman loads with) reads
// it as both.
func TestArchiveFormats(t *testing.T) {
	requireRoot(t)
	archive, out := sharedArchive(t)
	p, _ := ociImage(t, archive)
	img := onlyImage(t, p)
	digest, _ := img.Digest()

	// docker load reads manifest.json.
	dimg, err := tarball.ImageFromPath(out, nil)
	if err != nil {
		t.Fatalf("docker archive: %v", err)
	}
	ol, _ := img.Layers()
	dl, err := dimg.Layers()
	if err != nil || len(dl) != len(ol) {
		t.Fatalf("docker archive layers: %d, %v; the OCI image has %d", len(dl), err, len(ol))
	}
	for i := range ol {
		a, _ := ol[i].DiffID()
		b, _ := dl[i].DiffID()
		if a != b {
			t.Errorf("layer %d: OCI %s, docker archive %s", i, a, b)
		}
	}
	dcfg, _ := dimg.ConfigName()
	ocfg, _ := img.ConfigName()
	if dcfg != ocfg {
		t.Errorf("docker archive config %s, OCI %s", dcfg, ocfg)
	}
	tags, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(out) })
	if err != nil || len(tags) != 1 || len(tags[0].RepoTags) != 1 || tags[0].RepoTags[0] != DefaultName {
		t.Errorf("docker manifest.json: %+v, %v; want RepoTags [%s]", tags, err, DefaultName)
	}

	for _, transport := range []string{"oci-archive", "docker-archive"} {
		b, err := exec.Command("skopeo", "inspect", "--raw", transport+":"+out).Output()
		if err != nil {
			t.Errorf("skopeo inspect %s: %v", transport, err)
			continue
		}
		if transport == "oci-archive" && sha(b) != digest.Hex {
			t.Errorf("skopeo reads manifest %s from the OCI layout, the image is %s", sha(b), digest)
		}
	}
}

func sha(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// TestToolsRun unpacks the image and runs what the plugin runs, chrooted:
// every library each tool needs is in it, and the tools work.
func TestToolsRun(t *testing.T) {
	requireRoot(t)
	archive, _ := sharedArchive(t)
	p, _ := ociImage(t, archive)
	img := onlyImage(t, p)
	root := t.TempDir()
	cmd := exec.Command("tar", "-x", "-C", root)
	cmd.Stdin = mutate.Extract(img)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("unpack: %v: %s", err, out)
	}
	chroot := func(args ...string) (string, error) {
		out, err := exec.Command("chroot", append([]string{root}, args...)...).CombinedOutput()
		return string(out), err
	}
	runs := [][]string{
		{"/usr/local/bin/sparsevol-csi", "--version"},
		{"mkfs.ext4", "-V"}, {"e2fsck", "-V"}, {"resize2fs", "-P", "/nonexistent"},
		{"mkfs.xfs", "-V"},
		{"blkid", "-V"}, {"partx", "-V"}, {"sfdisk", "-v"}, {"sgdisk", "--version"},
		{"sh", "-c", "exit 0"}, {"fsfreeze", "-V"}, {"rm", "-f", "--", "/tmp/frozen-note"},
		{"tune2fs", "-l", "/nonexistent"}, {"xfs_db", "-V"},
	}
	// The thaw guard's rm removes its freeze note.
	if err := os.WriteFile(filepath.Join(root, "tmp/frozen-note"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	ran := map[string]bool{}
	for _, c := range runs {
		ran[c[0]] = true
		out, err := chroot(c...)
		// resize2fs and tune2fs of a missing device fail, but only after
		// they loaded.
		if (err != nil && c[0] != "resize2fs" && c[0] != "tune2fs") || strings.Contains(out, "error while loading shared libraries") || strings.Contains(out, "not found") {
			t.Errorf("%s in the image: %v: %s", strings.Join(c, " "), err, out)
		}
	}
	for _, prog := range programs(tools) {
		if !ran[prog] {
			t.Errorf("the image carries %s and nothing here runs it", prog)
		}
	}
	if _, err := os.Lstat(filepath.Join(root, "tmp/frozen-note")); !os.IsNotExist(err) {
		t.Errorf("rm in the image left the freeze note: %v", err)
	}
	// The filesystems, as the plugin makes and checks them.
	for _, fs := range []struct{ mkfs, size string }{{"mkfs.ext4", "64M"}, {"mkfs.xfs", "320M"}} {
		img := "/tmp/" + fs.mkfs + ".img"
		if err := os.Truncate(filepath.Join(root, img), 0); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		if out, err := exec.Command("truncate", "-s", fs.size, filepath.Join(root, img)).CombinedOutput(); err != nil {
			t.Fatalf("truncate: %v: %s", err, out)
		}
		if out, err := chroot(fs.mkfs, "-q", img); err != nil {
			t.Errorf("%s in the image: %v: %s", fs.mkfs, err, out)
			continue
		}
		out, err := chroot("blkid", "-o", "value", "-s", "TYPE", img)
		if want := strings.TrimPrefix(fs.mkfs, "mkfs."); err != nil || strings.TrimSpace(out) != want {
			t.Errorf("blkid in the image says %q (%v) of a fresh %s", out, err, want)
		}
	}
}

// TestPush pushes to a registry (in-process) and reads back the digest
// the archive has.
func TestPush(t *testing.T) {
	requireRoot(t)
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	ref := u.Host + "/sparsevol/sparsevol:test"
	archive, _ := sharedArchive(t)
	p, _ := ociImage(t, archive)
	want, _ := onlyImage(t, p).Digest()
	// A build of its own, pushed only: equal inputs, equal digest.
	if err := run(options{bin: staticBinary(t), name: DefaultName, version: "v1-test", cache: cacheDir(), push: ref}); err != nil {
		t.Fatal(err)
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Get(r)
	if err != nil {
		t.Fatalf("the pushed image: %v", err)
	}
	if desc.Digest != want {
		t.Errorf("registry has %s, the archive %s", desc.Digest, want)
	}
}

// TestRefusesDynamicBinary: the image has no glibc for the binary's own
// use; a cgo build is refused, and so is what is no program at all.
func TestRefusesDynamicBinary(t *testing.T) {
	dynamic, err := os.ReadFile("/bin/true")
	if err != nil {
		t.Fatal(err)
	}
	for what, data := range map[string][]byte{"a dynamic binary": dynamic, "not an ELF file": []byte("#!/bin/sh\n")} {
		if err := checkStatic(data); err == nil {
			t.Errorf("%s is accepted", what)
		}
	}
	if err := checkStatic(mustRead(t, staticBinary(t))); err != nil {
		t.Errorf("the static build is refused: %v", err)
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestToolsCoverExecs reads the plugin's source for the programs it runs
// by name and checks that the image has each: a tool added there and
// forgotten here would fail in the cluster only.
func TestToolsCoverExecs(t *testing.T) {
	// Node mode only: the plugin never manages systemd units.
	notInPlugin := map[string]bool{"systemctl": true}
	call := regexp.MustCompile(`(?:\.run\(ctx, |prog(?:, \w+)* = |exec\.Command(?:Context)?\((?:ctx, )?|LookPath\()"([a-zA-Z0-9_.-]+)"`)
	found := map[string]string{}
	err := filepath.WalkDir("../../internal", func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "testutil" {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range call.FindAllSubmatch(src, -1) {
			found[string(m[1])] = p
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(found) < 5 {
		t.Fatalf("found only %v: the pattern no longer matches how internal/ runs programs", found)
	}
	// What internal/ runs inside a shell script, which the pattern misses.
	for prog, where := range map[string]string{
		"fsfreeze": "internal/volume/freeze.go (guardScript)",
		"rm":       "internal/volume/freeze.go (guardScript)",
	} {
		found[prog] = where
	}
	have := map[string]bool{}
	for _, p := range tools {
		have[filepath.Base(p)] = true
	}
	for prog, where := range found {
		if !have[prog] && !notInPlugin[prog] {
			t.Errorf("%s runs %s; the image's tools lack it", where, prog)
		}
	}
	// And the image carries only what the plugin runs.
	for _, prog := range programs(tools) {
		if _, ok := found[prog]; !ok {
			t.Errorf("the image carries %s, which nothing in internal/ runs: drop it from tools", prog)
		}
	}
}

// programs are the names of the executables among paths (image paths):
// those under a bin or sbin directory.
func programs(paths []string) []string {
	var out []string
	for _, p := range paths {
		if d := filepath.Base(filepath.Dir(p)); d == "bin" || d == "sbin" {
			out = append(out, filepath.Base(p))
		}
	}
	return out
}
