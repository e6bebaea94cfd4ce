// Package bins builds, and caches, the Kubernetes binaries the one-node
// cluster of the k8s end-to-end test runs: kubelet, kube-apiserver,
// kube-controller-manager, kube-scheduler and kubectl from the
// k8s.io/kubernetes module, etcd from its own module, and the CSI
// external-provisioner.
//
// Each group is built in a throwaway wrapper module, because the Go module
// proxy serves sources, not binaries, and because a module's replace
// directives only apply when it is the main module: the wrapper requires the
// root module and carries over its replace directives (for k8s.io/kubernetes
// the staging modules `=> ./staging/src/k8s.io/X` become `=> k8s.io/X
// v0.<minor>.<patch>`). etcd lives in a wrapper of its own; in one module
// with Kubernetes, minimal version selection breaks one or the other.
//
// Outputs land in <cache>/<key>/, key = hash of the versions and of this
// recipe. A build goes to <key>.partial and is renamed when complete, under
// an flock of <cache>/.lock, so concurrent runs build once.
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
	recipe             = "v1"
)

// The binaries a complete cache directory holds.
var Names = []string{
	"kubelet", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
	"kubectl", "etcd", "csi-provisioner",
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
	}
}

// Key names the cache directory: a hash of the recipe version, the Go
// toolchain, the build flags and every group (module, version, packages,
// linker flags). Bump recipe when the build changes in another way.
func Key() string {
	h := sha256.New()
	fmt.Fprintf(h, "recipe %s\ngo %s %s/%s\nflags %s\nenv %s\n", recipe, runtime.Version(), runtime.GOOS, runtime.GOARCH,
		strings.Join(buildFlags, " "), strings.Join(buildEnv, " "))
	for _, g := range groups() {
		fmt.Fprintf(h, "group %s %s@%s ldflags %q staging %v\n", g.name, g.root, g.version, g.ldflags, g.staging != nil)
		for _, n := range sortedKeys(g.pkgs) {
			fmt.Fprintf(h, "  %s %s\n", n, g.pkgs[n])
		}
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
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
	Dir     string                   // directory holding the binaries
	Cached  bool                     // the cache was complete already
	Elapsed time.Duration            // total time of this call
	Steps   map[string]time.Duration // per step, when built
}

// Path of one binary in the result directory.
func (r Result) Path(name string) string { return filepath.Join(r.Dir, name) }

// Ensure returns the cache directory of the current key, building whatever is
// missing first.
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
	dir := filepath.Join(o.Cache, Key())
	res := Result{Dir: dir, Steps: map[string]time.Duration{}}
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

	if complete(dir) {
		res.Cached = true
		res.Elapsed = time.Since(start)
		return res, nil
	}
	tmp := dir + ".partial"
	// A partial directory keeps finished groups (and the module cache keeps
	// downloads), so an interrupted build resumes.
	if err := os.MkdirAll(filepath.Join(tmp, "bin"), 0o755); err != nil {
		return res, err
	}
	logPath := filepath.Join(tmp, "build.log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return res, err
	}
	defer logFile.Close()

	b := &builder{o: o, tmp: tmp, log: logFile, logPath: logPath, steps: res.Steps}
	for _, g := range groups() {
		if err := b.build(ctx, g); err != nil {
			res.Elapsed = time.Since(start)
			return res, err
		}
	}
	manifest := fmt.Sprintf("key %s\nkubernetes %s\netcd %s\nprovisioner %s\ngo %s\nbuilt %s in %s\n",
		Key(), KubernetesVersion, EtcdVersion, ProvisionerVersion, runtime.Version(),
		time.Now().UTC().Format(time.RFC3339), time.Since(start).Round(time.Second))
	for _, s := range sortedKeys(res.Steps) {
		manifest += fmt.Sprintf("step %s %s\n", s, res.Steps[s].Round(time.Second))
	}
	if err := os.WriteFile(filepath.Join(tmp, "complete"), []byte(manifest), 0o644); err != nil {
		return res, err
	}
	os.RemoveAll(filepath.Join(tmp, "work"))
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		return res, err
	}
	res.Elapsed = time.Since(start)
	return res, nil
}

// Dir of a complete cache directory holds the binaries under bin/.
func complete(dir string) bool {
	if _, err := os.Stat(filepath.Join(dir, "complete")); err != nil {
		return false
	}
	for _, n := range Names {
		if _, err := os.Stat(filepath.Join(dir, "bin", n)); err != nil {
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
		return fmt.Errorf("%s: %w", g.name, err)
	}
	gomod := jsonField(out, "GoMod")
	if gomod == "" {
		return fmt.Errorf("%s: go mod download printed no GoMod: %s", g.name, out)
	}
	src, err := os.ReadFile(gomod)
	if err != nil {
		return err
	}
	wrapper, err := WrapperGoMod("sparsevol.test/wrapper/"+g.name, g.root, g.version, src, g.staging)
	if err != nil {
		return fmt.Errorf("%s: %w", g.name, err)
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
		return fmt.Errorf("%s: %w", g.name, err)
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
		return fmt.Errorf("%s: %w", g.name, err)
	}
	for _, n := range sortedKeys(g.pkgs) {
		built := filepath.Join(outDir, BinaryName(g.pkgs[n]))
		if err := os.Rename(built, filepath.Join(b.tmp, "bin", n)); err != nil {
			return fmt.Errorf("%s: %w", g.name, err)
		}
	}
	b.steps[g.name+" build"] = time.Since(t1)
	fmt.Fprintf(b.o.Log, "bins: %s: built in %s\n", g.name, time.Since(t1).Round(time.Second))
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
	for i := 1; i < len(keys); i++ {
		for j := i; j > 0 && keys[j] < keys[j-1]; j-- {
			keys[j], keys[j-1] = keys[j-1], keys[j]
		}
	}
	return keys
}
