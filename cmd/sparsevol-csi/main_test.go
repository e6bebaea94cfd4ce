package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// The test binary doubles as the plugin: with asCLI set it runs main, so
// the tests drive real processes without a separate build step.
const asCLI = "SPARSEVOL_TEST_AS_CLI"

func TestMain(m *testing.M) {
	if os.Getenv(asCLI) == "1" {
		main()
	}
	os.Exit(m.Run())
}

type result struct {
	code           int
	stdout, stderr string
}

// plugin runs the plugin against store root, in root's parent directory
// (where relative paths land), until it exits, or kills it after a while:
// a plugin that serves where it should refuse exits -1.
func plugin(t *testing.T, root string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	cmd := exec.CommandContext(ctx, os.Args[0], append([]string{"--root", root}, args...)...)
	cmd.Dir = filepath.Dir(root)
	cmd.Env = append(os.Environ(), asCLI+"=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	r := result{stdout: stdout.String(), stderr: stderr.String()}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run sparsevol-csi %v: %v", args, err)
	}
	return r
}

// TestUsage: the plugin's own usage errors exit 2, say what is wrong and
// make nothing (neither the store nor a socket), and so does a start that
// cannot serve (exit 1); --version names the build like sparsevol's.
func TestUsage(t *testing.T) {
	dir := t.TempDir()
	root := filepath.Join(dir, "store")
	endpoint := "unix://" + filepath.Join(dir, "plugin", "csi.sock")
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { busy.Close() })
	tests := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"no node id", []string{"--endpoint", endpoint}, 2, "--node-id is required"},
		{"tcp endpoint", []string{"--node-id", "n", "--endpoint", "tcp://127.0.0.1:1"}, 2, "unix"},
		{"bad log level", []string{"--node-id", "n", "--log-level", "loud"}, 2, "want debug, info, warn or error"},
		{"argument", []string{"--node-id", "n", "csi"}, 2, "takes 0 argument(s)"},
		{"unknown flag", []string{"--node-id", "n", "--nope"}, 2, "unknown flag"},
		{"node id with a newline", []string{"--node-id", "node\nx", "--endpoint", endpoint, "--kubelet-dir", dir}, 2, "node id"},
		{"node id too long for a label", []string{"--node-id", strings.Repeat("a", 64), "--endpoint", endpoint, "--kubelet-dir", dir}, 2, "node id"},
		{"metrics address without a port", []string{"--node-id", "n", "--endpoint", endpoint, "--kubelet-dir", dir, "--metrics-address", "9809"}, 2, "metrics address"},
		{"metrics port not a number", []string{"--node-id", "n", "--endpoint", endpoint, "--kubelet-dir", dir, "--metrics-address", ":metrics"}, 2, "metrics address"},
		{"relative registration path", []string{"--node-id", "n", "--endpoint", endpoint, "--kubelet-dir", dir, "--kubelet-registration-path", "plugins_registry/"}, 2, "not an absolute, clean path"},
		{"registration path with ..", []string{"--node-id", "n", "--endpoint", endpoint, "--kubelet-dir", dir, "--kubelet-registration-path", dir + "/x/../reg/"}, 2, "not an absolute, clean path"},
		{"unclean kubelet CSI endpoint", []string{"--node-id", "n", "--endpoint", endpoint, "--kubelet-dir", dir, "--kubelet-registration-path", dir + "/reg/",
			"--kubelet-csi-endpoint", "/var/lib/kubelet/plugins/../x/csi.sock"}, 2, "absolute, clean socket path"},
		{"metrics address in use", []string{"--node-id", "n", "--endpoint", endpoint, "--kubelet-dir", dir, "--metrics-address", busy.Addr().String()}, 1, "choose a free address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := plugin(t, root, tt.args...)
			if r.code != tt.code || !strings.Contains(r.stderr, tt.want) || !strings.HasPrefix(r.stderr, "sparsevol-csi: ") {
				t.Errorf("exit %d, stderr %q; want exit %d, %q", r.code, r.stderr, tt.code, tt.want)
			}
			made, _ := os.ReadDir(dir)
			for _, e := range made {
				t.Errorf("a refused start made %s in %s", e.Name(), dir)
				os.RemoveAll(filepath.Join(dir, e.Name())) // not blamed on the next case
			}
		})
	}
	if r := plugin(t, root, "--version"); r.code != 0 || !strings.HasPrefix(r.stdout, "sparsevol ") {
		t.Errorf("--version: exit %d, %q", r.code, r.stdout)
	}
}

// TestCSIStoreRules: the plugin's store is checked by Open like every
// command's: a lax one is made private and the change logged, a symbolic
// link is refused and its target left alone.
func TestCSIStoreRules(t *testing.T) {
	testutil.RequireRoot(t)
	tests := []struct {
		name     string
		symlink  bool
		wantCode int // -1: serves until stopped
	}{
		{"lax store", false, -1},
		{"symlinked store", true, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "store")
			if err := os.Mkdir(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			os.Chmod(dir, 0o755)
			root := dir
			if tt.symlink {
				root = dir + "-link"
				if err := os.Symlink(dir, root); err != nil {
					t.Fatal(err)
				}
			}
			sock := filepath.Join(t.TempDir(), "csi.sock")
			cmd := exec.Command(os.Args[0], "--root", root, "--node-id", "node-1",
				"--endpoint", "unix://"+sock, "--kubelet-dir", t.TempDir())
			cmd.Env = append(os.Environ(), asCLI+"=1")
			var stderr strings.Builder
			cmd.Stderr = &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			// Wait for the plugin to exit, or to serve (its socket exists).
			var err error
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				select {
				case err = <-done:
				default:
					if _, serr := os.Stat(sock); serr != nil && time.Now().Before(deadline) {
						continue
					}
					cmd.Process.Signal(unix.SIGTERM)
					err = <-done
					if tt.wantCode != -1 {
						t.Fatalf("plugin serves on a store it should refuse; stderr: %s", stderr.String())
					}
				}
				break
			}
			code := cmd.ProcessState.ExitCode()
			if tt.wantCode == -1 && code != 0 || tt.wantCode != -1 && code != tt.wantCode {
				t.Fatalf("plugin: %v (exit %d), want exit %d; stderr: %s", err, code, tt.wantCode, stderr.String())
			}
			fi, _ := os.Stat(dir)
			switch {
			case tt.symlink && fi.Mode().Perm() != 0o755:
				t.Errorf("the link's target was changed to %04o", fi.Mode().Perm())
			case !tt.symlink && (fi.Mode().Perm() != 0o700 || !strings.Contains(stderr.String(), "made it private")):
				t.Errorf("store mode %04o, stderr %q: want 0700 and the change said", fi.Mode().Perm(), stderr.String())
			}
		})
	}
}
