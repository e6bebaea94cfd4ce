package attack

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/moby/sys/mountinfo"
)

// innerEnv marks the test binary re-executed inside its private mount
// namespace.
const innerEnv = "SPARSEVOL_ATTACK_INNER"

// dialEnv makes the test binary a client that only connects to the unix
// socket it names (run as another user by the socket cases): exit 0 when
// it connects, 3 when it may not.
const dialEnv = "SPARSEVOL_ATTACK_DIAL"

func dial(sock string) int {
	conn, err := net.Dial("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	conn.Close()
	return 0
}

// bin is the sparsevol CLI built from this checkout by TestMain, and
// pluginBin the CSI plugin (sparsevol-csi).
var bin, pluginBin string

func TestMain(m *testing.M) {
	if sock := os.Getenv(dialEnv); sock != "" {
		os.Exit(dial(sock))
	}
	if os.Geteuid() == 0 && os.Getenv(innerEnv) != "1" {
		os.Exit(reexec())
	}
	if err := releaseCopiedLoopMounts(); err != nil {
		fmt.Fprintln(os.Stderr, "attack:", err)
		os.Exit(1)
	}
	if err := hideSystemd(); err != nil {
		fmt.Fprintln(os.Stderr, "attack:", err)
		os.Exit(1)
	}
	dir, err := os.MkdirTemp("", "sparsevol-attack-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "attack:", err)
		os.Exit(1)
	}
	bin, err = build(dir, "sparsevol")
	if err == nil {
		pluginBin, err = build(dir, "sparsevol-csi")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "attack:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// reexec runs the tests again in a new mount namespace; Go makes its mounts
// recursively private before the binary starts, so neither the tests nor
// the plugin they start can change the host's mount table.
func reexec() int {
	cmd := exec.Command(os.Args[0], os.Args[1:]...)
	cmd.Env = append(os.Environ(), innerEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Run(); err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode()
		}
		fmt.Fprintln(os.Stderr, "attack: re-exec in a private mount namespace:", err)
		return 1
	}
	return 0
}

// releaseCopiedLoopMounts lazily unmounts, in this private namespace
// only, every mount of a loop device the namespace copied from the host
// when it was made: other packages' tests running at the same time own
// those, and a copy here would keep their devices busy until this suite
// ends (their unmount on the host succeeds, their detach then fails).
func releaseCopiedLoopMounts() error {
	mounts, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) {
		return m.Major != 7 && !strings.HasPrefix(m.Source, "/dev/loop"), false
	})
	if err != nil {
		return err
	}
	// Deepest first, so no unmount finds its mount point covered.
	slices.SortFunc(mounts, func(a, b *mountinfo.Info) int { return len(b.Mountpoint) - len(a.Mountpoint) })
	for _, m := range mounts {
		if err := syscall.Unmount(m.Mountpoint, syscall.MNT_DETACH); err != nil && err != syscall.EINVAL && err != syscall.ENOENT {
			return fmt.Errorf("release the copy of %s: %w", m.Mountpoint, err)
		}
	}
	return nil
}

// build compiles ./cmd/<name> of the module this package belongs to
// into dir.
func build(dir, name string) (string, error) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		gobin = filepath.Join(runtime.GOROOT(), "bin", "go") // sudo resets PATH
	}
	out, err := exec.Command(gobin, "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	root := filepath.Dir(strings.TrimSpace(string(out)))
	path := filepath.Join(dir, name)
	cmd := exec.Command(gobin, "build", "-tags", buildTags, "-o", path, "./cmd/"+name)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build %s: %w: %s", name, err, out)
	}
	return path, nil
}

// hideSystemd covers /run/systemd with an empty tmpfs in the private mount
// namespace, so that the CLI under test never enables or starts units of
// the host's systemd.
func hideSystemd() error {
	if os.Getenv(innerEnv) != "1" {
		return nil // not root: the tests fail (or skip) before any CLI runs
	}
	if _, err := os.Stat("/run/systemd/system"); err != nil {
		return nil
	}
	if err := syscall.Mount("tmpfs", "/run/systemd", "tmpfs", 0, "size=1m,mode=0755"); err != nil {
		return fmt.Errorf("hide systemd from the CLI under test: %w", err)
	}
	return nil
}
