package plugincli

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	udevrules "github.com/sparsevol/sparsevol/deploy/udev"
	"github.com/sparsevol/sparsevol/internal/cli"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/udev"
)

// TestMainRefusesAtStart runs the plugin's command line with a driver
// name that would lead the registration socket out of its directory, and
// with sockets another plugin listens on: each is refused with its exit
// code before anything is made (the store directory stays missing) and
// the other plugin's socket keeps answering.
func TestMainRefusesAtStart(t *testing.T) {
	tests := []struct {
		name string
		// args get --root (DIR/store, or DIR/root when given), --node-id
		// and --endpoint (DIR is the test's directory); live are paths
		// below DIR another plugin listens on.
		root string
		args []string
		live []string
		code int
		says string
	}{
		{"driver name escapes the registration directory", "",
			[]string{"--driver-name", "../escaped", "--kubelet-registration-path", "DIR/reg/"},
			[]string{"escaped-reg.sock"}, cli.ExitInvalid, "driver name"},
		{"driver name with a slash", "", []string{"--driver-name", "a/b"}, nil, cli.ExitInvalid, "driver name"},
		{"driver name too long", "", []string{"--driver-name", strings.Repeat("d", 64)}, nil, cli.ExitInvalid, "driver name"},
		{"CSI socket in use", "", nil, []string{"csi.sock"}, cli.ExitFailure, "another plugin is listening"},
		{"registration socket in use", "",
			[]string{"--kubelet-registration-path", "DIR/reg/"},
			[]string{"reg/sparsevol.csi.io-reg.sock"}, cli.ExitFailure, "another plugin is listening"},
		{"store root units cannot name", "st ore", nil, nil, cli.ExitInvalid, "U+0020"},
		{"store root with a specifier", "st%Hore", nil, nil, cli.ExitInvalid, "%"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := shortTempDir(t)
			for _, p := range tc.live {
				testutil.LiveSocket(t, filepath.Join(dir, p))
			}
			root := filepath.Join(dir, "store")
			if tc.root != "" {
				root = filepath.Join(dir, tc.root)
			}
			args := []string{"--root", root, "--node-id", "n", "--endpoint", "unix://" + filepath.Join(dir, "csi.sock")}
			for _, a := range tc.args {
				args = append(args, strings.ReplaceAll(a, "DIR", dir))
			}
			var stderr bytes.Buffer
			if code := Main(args, &bytes.Buffer{}, &stderr); code != tc.code {
				t.Errorf("exit %d, want %d; stderr: %s", code, tc.code, &stderr)
			}
			if !strings.Contains(stderr.String(), tc.says) {
				t.Errorf("stderr %q does not say %q", &stderr, tc.says)
			}
			if _, err := os.Lstat(root); !os.IsNotExist(err) {
				t.Errorf("the store directory was made: %v", err)
			}
		})
	}
}

// udevDir makes a directory for --udev-dir below dir, with udevd's
// control socket's name in it when running.
func udevDir(t *testing.T, dir string, running bool) string {
	t.Helper()
	d := filepath.Join(dir, "udev")
	if err := os.Mkdir(d, 0o755); err != nil {
		t.Fatal(err)
	}
	if running {
		if err := os.WriteFile(filepath.Join(d, "control"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

// TestUdevFlagsRefused: a --udev-dir or --udev-identity-dir that is not an
// absolute, clean path without symbolic links is a usage error, and the
// start makes nothing: no store, no rule in the (running) udev directory.
// Another plugin listens on the CSI socket, so that a start that let the
// flag through fails (exit 1) instead of serving.
func TestUdevFlagsRefused(t *testing.T) {
	const unclean, link = "not an absolute, clean path", "symbolic link"
	tests := []struct {
		name string
		// args get --root, --node-id and --endpoint as in
		// TestMainRefusesAtStart; DIR is the test's directory, UDEV a
		// udev directory in it where udev runs, LINK a link to UDEV.
		args []string
		// the error names flag and says why.
		flag, why string
	}{
		{"relative udev dir", []string{"--udev-dir", "run/udev"}, "--udev-dir: ", unclean},
		{"udev dir with a trailing slash", []string{"--udev-dir", "UDEV/"}, "--udev-dir: ", unclean},
		{"udev dir with ..", []string{"--udev-dir", "UDEV/../udev"}, "--udev-dir: ", unclean},
		{"udev dir through a link", []string{"--udev-dir", "LINK"}, "--udev-dir: ", link},
		{"udev dir below a link", []string{"--udev-dir", "LINK/x"}, "--udev-dir: ", link},
		{"relative identity dir", []string{"--udev-dir", "UDEV", "--udev-identity-dir", "run/sparsevol/udev"}, "--udev-identity-dir: ", unclean},
		{"identity dir with ..", []string{"--udev-dir", "UDEV", "--udev-identity-dir", "DIR/x/../id"}, "--udev-identity-dir: ", unclean},
		{"identity dir through a link", []string{"--udev-dir", "UDEV", "--udev-identity-dir", "LINK/id"}, "--udev-identity-dir: ", link},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := shortTempDir(t)
			testutil.LiveSocket(t, filepath.Join(dir, "csi.sock"))
			udev := udevDir(t, dir, true)
			link := filepath.Join(dir, "link")
			if err := os.Symlink(udev, link); err != nil {
				t.Fatal(err)
			}
			root := filepath.Join(dir, "store")
			args := []string{"--root", root, "--node-id", "n", "--endpoint", "unix://" + filepath.Join(dir, "csi.sock")}
			r := strings.NewReplacer("UDEV", udev, "LINK", link, "DIR", dir)
			for _, a := range tc.args {
				args = append(args, r.Replace(a))
			}
			var stderr bytes.Buffer
			if code := Main(args, &bytes.Buffer{}, &stderr); code != cli.ExitInvalid {
				t.Errorf("exit %d, want %d; stderr: %s", code, cli.ExitInvalid, &stderr)
			}
			if !strings.Contains(stderr.String(), tc.flag) || !strings.Contains(stderr.String(), tc.why) {
				t.Errorf("stderr %q does not say %q and %q", &stderr, tc.flag, tc.why)
			}
			if _, err := os.Lstat(root); !os.IsNotExist(err) {
				t.Errorf("the store directory was made: %v", err)
			}
			if _, err := os.Lstat(filepath.Join(udev, "rules.d")); !os.IsNotExist(err) {
				t.Errorf("a refused start wrote udev's rules.d: %v", err)
			}
		})
	}
}

// TestUdevRuleAtStart starts the plugin with --udev-dir: where udev runs
// there (its control socket's name), sparsevol's rule is in its rules.d by
// the time the CSI socket answers; where it does not, nothing is written
// and the log says so.
func TestUdevRuleAtStart(t *testing.T) {
	for _, running := range []bool{true, false} {
		t.Run(fmt.Sprintf("udev running %v", running), func(t *testing.T) {
			dir := shortTempDir(t)
			udev := udevDir(t, dir, running)
			sock := filepath.Join(dir, "csi.sock")
			stderr := serve(t, "--root", filepath.Join(dir, "store"), "--node-id", "n", "--endpoint", "unix://"+sock,
				"--kubelet-dir", dir, "--udev-dir", udev, "--udev-identity-dir", filepath.Join(dir, "identity"))
			rule := filepath.Join(udev, "rules.d", udevrules.RuleName)
			got, err := os.ReadFile(rule)
			switch {
			case running && err != nil:
				t.Errorf("no rule at %s once the plugin serves: %v; log: %s", rule, err, stderr())
			case running && !bytes.Equal(got, udevrules.Rule):
				t.Errorf("%s holds %q, want the embedded rule", rule, got)
			case !running:
				if _, err := os.Lstat(filepath.Join(udev, "rules.d")); !os.IsNotExist(err) {
					t.Errorf("rules.d written where udev does not run: %v", err)
				}
				if !strings.Contains(stderr(), "udev does not run") {
					t.Errorf("log does not say udev does not run: %s", stderr())
				}
			}
		})
	}
}

// udevOptions keeps --udev-dir where udev does not run yet: the store
// looks whether it runs where it asks udev, so a udevd started after the
// plugin gets the rule and its records are checked.
func TestUdevOptionsKeepsDir(t *testing.T) {
	for _, running := range []bool{true, false} {
		t.Run(fmt.Sprintf("udev running %v", running), func(t *testing.T) {
			dir := udev.Dir(udevDir(t, t.TempDir(), running))
			got, _ := udevOptions(slog.New(slog.DiscardHandler), dir, "")
			if got != dir {
				t.Errorf("udevOptions(%q) = %q; want the directory as given", dir, got)
			}
		})
	}
}

// serve runs the plugin's command with args until its CSI socket (the
// --endpoint) answers, and stops it when the test ends; the plugin's
// stderr so far is stderr().
func serve(t *testing.T, args ...string) (stderr func() string) {
	t.Helper()
	var (
		mu  sync.Mutex
		buf bytes.Buffer
	)
	stderr = func() string {
		mu.Lock()
		defer mu.Unlock()
		return buf.String()
	}
	var sock string
	for i, a := range args {
		if a == "--endpoint" {
			sock = strings.TrimPrefix(args[i+1], "unix://")
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cmd := NewCommand(io.Discard, writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return buf.Write(p)
	}))
	cmd.SetArgs(args)
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("plugin: %v; log: %s", err, stderr())
		}
	})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		select {
		case err := <-done:
			done <- nil // said here, not again at cleanup
			t.Fatalf("plugin exited before it served: %v; log: %s", err, stderr())
		default:
		}
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return stderr
		} else if time.Now().After(deadline) {
			t.Fatalf("the plugin's socket does not answer: %v; log: %s", err, stderr())
		}
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// shortTempDir is a temporary directory with a short path, removed at
// cleanup: a socket's path must fit sun_path (108 bytes), which
// t.TempDir's long names can overflow.
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "svcli")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
