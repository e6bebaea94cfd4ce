// Package bins builds, and caches, the Kubernetes binaries the one-node
// cluster of the k8s end-to-end test runs: kubelet, kube-apiserver,
// kube-controller-manager, kube-scheduler and kubectl from the
// k8s.io/kubernetes module, etcd from its own module, the CSI
// external-provisioner, and snapshot-controller and csi-snapshotter with the
// snapshot CRDs from external-snapshotter.
//
// Each group is built in a throwaway wrapper module, because the Go module
// proxy serves sources, not binaries, and because a module's replace
// directives only apply when it is the main module: the wrapper requires the
// root module and carries over its replace directives (for k8s.io/kubernetes
// the staging modules `=> ./staging/src/k8s.io/X` become `=> k8s.io/X
// v0.<minor>.<patch>`). etcd lives in a wrapper of its own; in one module
// with Kubernetes, minimal version selection breaks one or the other.
//
// Each group is cached on its own: its outputs land in <cache>/<group>-<key>/
// (binaries under bin/, files taken from modules under files/), key = hash
// of the group (modules, versions, packages, flags) and of this recipe, so a
// new or changed group builds only itself. A build goes to <dir>.partial and
// is renamed when complete, under an flock of <cache>/.lock, so concurrent
// runs build once.
package bins

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/sparsevol/sparsevol/test/e2e/vmrun"
)

// Versions of everything built. Changing any of them, the build flags or
// the recipe version changes the cache key.
const (
	KubernetesVersion  = "v1.37.2"
	EtcdVersion        = "v3.6.5"
	ProvisionerVersion = "v6.4.0"
	SnapshotterVersion = "v8.7.0"
	recipe             = "v1"
)

// Names of all binaries Ensure provides.
var Names = []string{
	"kubelet", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
	"kubectl", "etcd", "csi-provisioner", "snapshot-controller", "csi-snapshotter",
}

// buildFlags and buildEnv are part of the recipe.
var (
	buildFlags = []string{"-trimpath"}
	buildEnv   = []string{"CGO_ENABLED=0", "GOFLAGS=-mod=mod", "GOWORK=off", "GOTOOLCHAIN=local"}
)

// group is one wrapper module and the packages built from it.
type group struct {
	name    string // directory of the wrapper under the work dir
	root    string // module whose go.mod supplies the replace directives
	version string
	pkgs    map[string]string // output name -> package path
	ldflags string
	// staging rewrites a replace target that is a path inside root (the
	// Kubernetes staging modules) into a module version; nil keeps only
	// versioned replaces.
	staging func(mod string) string
	// files are copied out of a module of the build list: output name
	// under files/ -> module@version and a glob inside it.
	files []moduleFiles
}

// moduleFiles names files to take from a module's source, e.g. CRDs.
type moduleFiles struct {
	dir     string // output directory under files/
	module  string // module path
	version string
	glob    string // inside the module
}

func groups() []group {
	kv := strings.TrimPrefix(KubernetesVersion, "v")
	parts := strings.SplitN(kv, ".", 3)
	var ld []string
	for _, p := range []string{"k8s.io/component-base/version", "k8s.io/client-go/pkg/version"} {
		ld = append(ld,
			"-X", p+".gitVersion="+KubernetesVersion,
			"-X", p+".gitMajor="+parts[0],
			"-X", p+".gitMinor="+parts[1],
			"-X", p+".gitTreeState=clean",
			"-X", p+".buildDate=1970-01-01T00:00:00Z")
	}
	return []group{
		{
			name:    "kubernetes",
			root:    "k8s.io/kubernetes",
			version: KubernetesVersion,
			pkgs: map[string]string{
				"kubelet":                 "k8s.io/kubernetes/cmd/kubelet",
				"kube-apiserver":          "k8s.io/kubernetes/cmd/kube-apiserver",
				"kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
				"kube-scheduler":          "k8s.io/kubernetes/cmd/kube-scheduler",
				"kubectl":                 "k8s.io/kubernetes/cmd/kubectl",
			},
			ldflags: strings.Join(ld, " "),
			staging: func(mod string) string { return mod + " v0." + parts[1] + "." + parts[2] },
		},
		{
			name:    "etcd",
			root:    "go.etcd.io/etcd/server/v3",
			version: EtcdVersion,
			pkgs:    map[string]string{"etcd": "go.etcd.io/etcd/server/v3"},
		},
		{
			name:    "provisioner",
			root:    "github.com/kubernetes-csi/external-provisioner/v6",
			version: ProvisionerVersion,
			pkgs: map[string]string{
				"csi-provisioner": "github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner",
			},
			ldflags: "-X main.version=" + ProvisionerVersion,
		},
		{
			name:    "snapshotter",
			root:    "github.com/kubernetes-csi/external-snapshotter/v8",
			version: SnapshotterVersion,
			pkgs: map[string]string{
				"snapshot-controller": "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller",
				"csi-snapshotter":     "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter",
			},
			ldflags: "-X main.version=" + SnapshotterVersion,
			// The root replaces its client module with ./client; the
			// client is its own module, released with the same version.
			staging: func(mod string) string { return mod + " " + SnapshotterVersion },
			files: []moduleFiles{{
				dir:     "crd",
				module:  "github.com/kubernetes-csi/external-snapshotter/client/v8",
				version: SnapshotterVersion,
				glob:    "config/crd/*.storage.k8s.io_*.yaml",
			}},
		},
	}
}

// Key names a group's cache directory: a hash of the recipe version, the Go
// toolchain, the build flags and the group (modules, versions, packages,
// linker flags, files). Bump recipe when the build changes in another way.
func (g group) Key() string {
	h := sha256.New()
	fmt.Fprintf(h, "recipe %s\ngo %s %s/%s\nflags %s\nenv %s\n", recipe, runtime.Version(), runtime.GOOS, runtime.GOARCH,
		strings.Join(buildFlags, " "), strings.Join(buildEnv, " "))
	fmt.Fprintf(h, "group %s %s@%s ldflags %q staging %v\n", g.name, g.root, g.version, g.ldflags, g.staging != nil)
	for _, n := range sortedKeys(g.pkgs) {
		fmt.Fprintf(h, "  %s %s\n", n, g.pkgs[n])
	}
	for _, f := range g.files {
		fmt.Fprintf(h, "  files %s %s@%s %s\n", f.dir, f.module, f.version, f.glob)
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// Dirs maps each group to its cache directory name, <group>-<key>.
func Dirs() map[string]string {
	m := map[string]string{}
	for _, g := range groups() {
		m[g.name] = g.name + "-" + g.Key()
	}
	return m
}

// DefaultCache is k8s-bins under the end-to-end cache root
// ($SPARSEVOL_E2E_CACHE, see vmrun.DefaultCache).
func DefaultCache() string { return filepath.Join(vmrun.DefaultCache(), "k8s-bins") }

// Options of a build.
type Options struct {
	Cache string    // cache root; DefaultCache() when empty
	Go    string    // go command; "go" from PATH, else /usr/local/go/bin/go
	Log   io.Writer // progress lines; build output goes to <dir>/build.log
	Nice  int       // niceness of the go commands (0: not reniced)
}

// Result of Ensure.
type Result struct {
	Dirs    map[string]string        // group -> its cache directory
	Cached  bool                     // every group was complete already
	Elapsed time.Duration            // total time of this call
	Steps   map[string]time.Duration // per step, of the groups built
	paths   map[string]string        // binary name -> path
}

// Path of one binary (one of Names); "" for an unknown name.
func (r Result) Path(name string) string { return r.paths[name] }

// Files taken from modules into directory dir (as "crd"), sorted by name.
func (r Result) Files(dir string) ([]string, error) {
	var out []string
	for _, g := range groups() {
		for _, f := range g.files {
			if f.dir != dir {
				continue
			}
			m, err := filepath.Glob(filepath.Join(r.Dirs[g.name], "files", dir, "*"))
			if err != nil {
				return nil, err
			}
			out = append(out, m...)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("bins: no files under %q", dir)
	}
	sort.Strings(out)
	return out, nil
}

// Ensure returns the cache directories of every group, building whatever
// group is missing first.
func Ensure(ctx context.Context, o Options) (Result, error) {
	start := time.Now()
	if o.Cache == "" {
		o.Cache = DefaultCache()
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
	if o.Go == "" {
		o.Go = "go"
		if _, err := exec.LookPath("go"); err != nil {
			o.Go = "/usr/local/go/bin/go"
		}
	}
	res := Result{Dirs: map[string]string{}, Steps: map[string]time.Duration{}, paths: map[string]string{}, Cached: true}
	if err := os.MkdirAll(o.Cache, 0o755); err != nil {
		return res, err
	}
	lock, err := os.OpenFile(filepath.Join(o.Cache, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return res, err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return res, err
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)

	for _, g := range groups() {
		dir := filepath.Join(o.Cache, Dirs()[g.name])
		res.Dirs[g.name] = dir
		for n := range g.pkgs {
			res.paths[n] = filepath.Join(dir, "bin", n)
		}
		if complete(dir, g) {
			continue
		}
		res.Cached = false
		if err := ensureGroup(ctx, o, g, dir, res.Steps); err != nil {
			res.Elapsed = time.Since(start)
			return res, fmt.Errorf("bins: %s: %w", g.name, err)
		}
	}
	res.Elapsed = time.Since(start)
	return res, nil
}

// ensureGroup builds one group into dir.partial and renames it to dir when
// complete. A partial directory keeps finished binaries (and the module
// cache keeps downloads), so an interrupted build resumes.
func ensureGroup(ctx context.Context, o Options, g group, dir string, steps map[string]time.Duration) error {
	start := time.Now()
	tmp := dir + ".partial"
	if err := os.MkdirAll(filepath.Join(tmp, "bin"), 0o755); err != nil {
		return err
	}
	logPath := filepath.Join(tmp, "build.log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logFile.Close()

	b := &builder{o: o, tmp: tmp, log: logFile, logPath: logPath, steps: map[string]time.Duration{}}
	if err := b.build(ctx, g); err != nil {
		return err
	}
	if err := b.copyFiles(ctx, g); err != nil {
		return err
	}
	manifest := fmt.Sprintf("key %s\ngroup %s %s@%s\ngo %s\nbuilt %s in %s\n",
		g.Key(), g.name, g.root, g.version, runtime.Version(),
		time.Now().UTC().Format(time.RFC3339), time.Since(start).Round(time.Second))
	for _, s := range sortedKeys(b.steps) {
		manifest += fmt.Sprintf("step %s %s\n", s, b.steps[s].Round(time.Second))
		steps[s] = b.steps[s]
	}
	if err := os.WriteFile(filepath.Join(tmp, "complete"), []byte(manifest), 0o644); err != nil {
		return err
	}
	os.RemoveAll(filepath.Join(tmp, "work"))
	os.RemoveAll(dir)
	return os.Rename(tmp, dir)
}

// complete: dir holds the group's manifest, every binary under bin/ and
// every files directory under files/.
func complete(dir string, g group) bool {
	if _, err := os.Stat(filepath.Join(dir, "complete")); err != nil {
		return false
	}
	for n := range g.pkgs {
		if _, err := os.Stat(filepath.Join(dir, "bin", n)); err != nil {
			return false
		}
	}
	for _, f := range g.files {
		if m, _ := filepath.Glob(filepath.Join(dir, "files", f.dir, "*")); len(m) == 0 {
			return false
		}
	}
	return true
}

type builder struct {
	o       Options
	tmp     string
	log     io.Writer
	logPath string
	steps   map[string]time.Duration
}

func (b *builder) build(ctx context.Context, g group) error {
	done := true
	for out := range g.pkgs {
		if _, err := os.Stat(filepath.Join(b.tmp, "bin", out)); err != nil {
			done = false
		}
	}
	if done {
		fmt.Fprintf(b.o.Log, "bins: %s: already built\n", g.name)
		return nil
	}
	work := filepath.Join(b.tmp, "work", g.name)
	if err := os.MkdirAll(work, 0o755); err != nil {
		return err
	}
	// 1. The root module's go.mod, for its replace directives.
	t0 := time.Now()
	out, err := b.goOut(ctx, work, "mod", "download", "-json", g.root+"@"+g.version)
	if err != nil {
		return err
	}
	gomod := jsonField(out, "GoMod")
	if gomod == "" {
		return fmt.Errorf("go mod download printed no GoMod: %s", out)
	}
	src, err := os.ReadFile(gomod)
	if err != nil {
		return err
	}
	wrapper, err := WrapperGoMod("sparsevol.test/wrapper/"+g.name, g.root, g.version, src, g.staging)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(work, "go.mod"), wrapper, 0o644); err != nil {
		return err
	}
	os.Remove(filepath.Join(work, "go.sum"))
	// A package to anchor the requirements in (go build of a dependency's
	// main package needs the module in the build list).
	var imports strings.Builder
	imports.WriteString("//go:build tools\n\npackage wrapper\n")
	if err := os.WriteFile(filepath.Join(work, "tools.go"), []byte(imports.String()), 0o644); err != nil {
		return err
	}
	// 2. Resolve the packages (downloads what the module cache lacks).
	pkgs := make([]string, 0, len(g.pkgs))
	for _, n := range sortedKeys(g.pkgs) {
		pkgs = append(pkgs, g.pkgs[n])
	}
	get := append([]string{"get"}, withVersion(pkgs, g.version)...)
	if _, err := b.goOut(ctx, work, get...); err != nil {
		return err
	}
	b.steps[g.name+" resolve"] = time.Since(t0)
	fmt.Fprintf(b.o.Log, "bins: %s: modules resolved in %s\n", g.name, time.Since(t0).Round(time.Second))

	// 3. Build all packages of the group in one go command, so shared
	// packages compile once. Static, stripped binaries.
	t1 := time.Now()
	outDir := filepath.Join(work, "out")
	os.RemoveAll(outDir)
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return err
	}
	args := append([]string{"build"}, buildFlags...)
	args = append(args, "-o", outDir+"/", "-ldflags", strings.TrimSpace("-s -w "+g.ldflags))
	args = append(args, pkgs...)
	fmt.Fprintf(b.o.Log, "bins: %s: building %s\n", g.name, strings.Join(sortedKeys(g.pkgs), " "))
	if _, err := b.goOut(ctx, work, args...); err != nil {
		return err
	}
	for _, n := range sortedKeys(g.pkgs) {
		built := filepath.Join(outDir, BinaryName(g.pkgs[n]))
		if err := os.Rename(built, filepath.Join(b.tmp, "bin", n)); err != nil {
			return err
		}
	}
	b.steps[g.name+" build"] = time.Since(t1)
	fmt.Fprintf(b.o.Log, "bins: %s: built in %s\n", g.name, time.Since(t1).Round(time.Second))
	return nil
}

// copyFiles copies the group's files out of their modules' sources into
// files/<dir>/ (read-only in the module cache, 0644 here).
func (b *builder) copyFiles(ctx context.Context, g group) error {
	for _, f := range g.files {
		out, err := b.goOut(ctx, b.tmp, "mod", "download", "-json", f.module+"@"+f.version)
		if err != nil {
			return err
		}
		src := jsonField(out, "Dir")
		if src == "" {
			return fmt.Errorf("go mod download printed no Dir: %s", out)
		}
		m, err := filepath.Glob(filepath.Join(src, f.glob))
		if err != nil {
			return err
		}
		if len(m) == 0 {
			return fmt.Errorf("no %s in %s@%s", f.glob, f.module, f.version)
		}
		dst := filepath.Join(b.tmp, "files", f.dir)
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return err
		}
		for _, p := range m {
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dst, filepath.Base(p)), data, 0o644); err != nil {
				return err
			}
		}
		fmt.Fprintf(b.o.Log, "bins: %s: %d file(s) from %s@%s into files/%s\n", g.name, len(m), f.module, f.version, f.dir)
	}
	return nil
}

func (b *builder) goOut(ctx context.Context, dir string, args ...string) (string, error) {
	name, argv := b.o.Go, args
	if b.o.Nice != 0 {
		if nice, err := exec.LookPath("nice"); err == nil {
			name, argv = nice, append([]string{"-n", fmt.Sprint(b.o.Nice), b.o.Go}, args...)
		}
	}
	cmd := exec.CommandContext(ctx, name, argv...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), buildEnv...)
	var stdout bytes.Buffer
	cmd.Stdout = io.MultiWriter(&stdout, b.log)
	cmd.Stderr = b.log
	fmt.Fprintf(b.log, "+ (cd %s && %s %s)\n", dir, name, strings.Join(argv, " "))
	t0 := time.Now()
	err := cmd.Run()
	fmt.Fprintf(b.log, "  (%s, %v)\n", time.Since(t0).Round(100*time.Millisecond), err)
	if err != nil {
		return stdout.String(), fmt.Errorf("go %s: %v; see %s:\n%s", args[0], err, b.logPath, vmrun.TailFile(b.logPath, 25))
	}
	return stdout.String(), nil
}

// WrapperGoMod writes the go.mod of a wrapper module that requires root at
// version and carries over root's replace directives. A replace whose target
// is a local path is rewritten by staging (which returns "module version"),
// or dropped when staging is nil.
func WrapperGoMod(module, root, version string, rootGoMod []byte, staging func(string) string) ([]byte, error) {
	goVersion := ""
	var replaces []string
	inBlock := false
	sc := bufio.NewScanner(bytes.NewReader(rootGoMod))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if i := strings.Index(line, "//"); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		switch {
		case line == "":
			continue
		case strings.HasPrefix(line, "go "):
			goVersion = strings.TrimSpace(strings.TrimPrefix(line, "go "))
			continue
		case line == "replace (":
			inBlock = true
			continue
		case inBlock && line == ")":
			inBlock = false
			continue
		}
		var spec string
		if inBlock {
			spec = line
		} else if strings.HasPrefix(line, "replace ") {
			spec = strings.TrimSpace(strings.TrimPrefix(line, "replace "))
		} else {
			continue
		}
		lhs, rhs, ok := strings.Cut(spec, "=>")
		if !ok {
			return nil, fmt.Errorf("replace directive without =>: %q", spec)
		}
		lhs, rhs = strings.TrimSpace(lhs), strings.TrimSpace(rhs)
		target := strings.Fields(rhs)
		if len(target) == 0 {
			return nil, fmt.Errorf("empty replace target: %q", spec)
		}
		if strings.HasPrefix(target[0], "./") || strings.HasPrefix(target[0], "../") || strings.HasPrefix(target[0], "/") {
			if staging == nil {
				continue
			}
			mod := strings.Fields(lhs)[0]
			rhs = staging(mod)
		}
		replaces = append(replaces, lhs+" => "+rhs)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if goVersion == "" {
		return nil, errors.New("no go directive in " + root + "'s go.mod")
	}
	var w bytes.Buffer
	fmt.Fprintf(&w, "module %s\n\ngo %s\n\nrequire %s %s\n", module, goVersion, root, version)
	if len(replaces) > 0 {
		w.WriteString("\nreplace (\n")
		for _, r := range replaces {
			fmt.Fprintf(&w, "\t%s\n", r)
		}
		w.WriteString(")\n")
	}
	return w.Bytes(), nil
}

// BinaryName is the file name go build -o DIR/ gives a main package: the
// last path element, or the one before a major-version suffix (/v3).
func BinaryName(pkg string) string {
	base := path.Base(pkg)
	if len(base) > 1 && base[0] == 'v' && strings.Trim(base[1:], "0123456789") == "" {
		return path.Base(path.Dir(pkg))
	}
	return base
}

func withVersion(pkgs []string, v string) []string {
	out := make([]string, len(pkgs))
	for i, p := range pkgs {
		out[i] = p + "@" + v
	}
	return out
}

// jsonField picks "Key": "value" out of go mod download -json output without
// a JSON dependency on the output shape.
func jsonField(s, key string) string {
	needle := `"` + key + `": "`
	i := strings.Index(s, needle)
	if i < 0 {
		return ""
	}
	rest := s[i+len(needle):]
	j := strings.Index(rest, `"`)
	if j < 0 {
		return ""
	}
	return rest[:j]
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
