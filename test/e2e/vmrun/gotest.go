package vmrun

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"strings"
)

// BuildTests compiles the tests of each package of repo (a path such as
// ./internal/volume) into dir as <last element>.test, statically linked,
// so that a guest step runs them against the guest's kernel: what the
// host cannot give a test (cgroup v2's io controller, capabilities) the
// guest can. It returns the binaries' names in pkgs' order.
func BuildTests(repo, dir string, pkgs ...string) ([]string, error) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		gobin = filepath.Join(runtime.GOROOT(), "bin", "go") // sudo resets PATH
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var names []string
	for _, pkg := range pkgs {
		name := path.Base(pkg) + ".test"
		cmd := exec.Command(gobin, "test", "-c", "-trimpath", "-o", filepath.Join(dir, name), pkg)
		cmd.Dir = repo
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("go test -c %s: %v\n%s", pkg, err, Tail(strings.TrimSpace(string(out)), 30))
		}
		names = append(names, name)
	}
	return names, nil
}
