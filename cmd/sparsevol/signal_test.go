package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// signalled runs the CLI against store root, sends it sig once ready
// reports that the operation is under way, and returns how it ended. A
// command that ends before ready does fails the test.
func signalled(t *testing.T, root string, sig syscall.Signal, ready func() bool, args ...string) result {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"--root", root, "--unit-dir", t.TempDir()}, args...)...)
	cmd.Env = append(os.Environ(), asCLI+"=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.Now().Add(time.Minute)
	for !ready() {
		select {
		case err := <-exited:
			t.Fatalf("sparsevol %v ended before it was signalled: %v: %s", args, err, stderr.String())
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			cmd.Process.Kill()
			<-exited
			t.Fatalf("sparsevol %v: never got under way: %s", args, stderr.String())
		}
	}
	if err := cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	err := <-exited
	r := result{stdout: stdout.String(), stderr: stderr.String()}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
		r.signaled = ee.Sys().(syscall.WaitStatus).Signaled()
	} else if err != nil {
		t.Fatal(err)
	}
	return r
}

// exists is a ready func for signalled: the glob pattern matches a file.
func exists(pattern string) func() bool {
	return func() bool {
		m, _ := filepath.Glob(pattern)
		return len(m) > 0
	}
}

// TestSignalledRecover stops a recover in the middle of its copy and
// checks that the orphan and its device are as they were, and that a
// rerun or a delete --force leaves no copy behind.
func TestSignalledRecover(t *testing.T) {
	const offset = 2 << 30 // in a volume whose copy lasts seconds
	marker := []byte("only on the device now\n")
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGKILL} {
		for _, then := range []string{"rerun", "delete"} {
			t.Run(sig.String()+"/"+then, func(t *testing.T) {
				root := newRoot(t)
				mustRun(t, root, "--overcommit-ratio", "1000", "create", "gone", "--size", "4G", "--mode", "block", "--no-partition")
				st := statuses(t, root)[0]
				dev, err := os.OpenFile(st.DataDevice, os.O_WRONLY, 0)
				if err != nil {
					t.Fatal(err)
				}
				_, err = dev.WriteAt(marker, offset)
				if cerr := dev.Close(); err != nil || cerr != nil {
					t.Fatal(err, cerr)
				}
				if err := os.Remove(st.BackingFile); err != nil {
					t.Fatal(err)
				}

				r := signalled(t, root, sig, exists(filepath.Join(root, ".recover-*")), "recover", "gone")
				if r.code == 0 && !r.signaled {
					t.Fatalf("recover ended well though signalled: %s", r.stderr)
				}
				got := statuses(t, root)[0]
				if got.State != volume.StateOrphaned || got.Device != st.Device {
					t.Fatalf("after %s: state %s device %q, want orphaned on %s", sig, got.State, got.Device, st.Device)
				}

				if then == "delete" {
					mustRun(t, root, "delete", "--force", "gone")
					assertEmptyStore(t, root)
					return
				}
				mustRun(t, root, "recover", "gone")
				if m, _ := filepath.Glob(filepath.Join(root, ".recover-*")); len(m) > 0 {
					t.Errorf("left after the rerun: %v", m)
				}
				back := make([]byte, len(marker))
				f, err := os.Open(st.BackingFile)
				if err != nil {
					t.Fatal(err)
				}
				_, err = f.ReadAt(back, offset)
				f.Close()
				if err != nil || !bytes.Equal(back, marker) {
					t.Fatalf("recovered data = %q, %v", back, err)
				}
				mustRun(t, root, "delete", "gone")
			})
		}
	}
}
