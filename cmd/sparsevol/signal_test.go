package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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
// checks that the orphan and its device are as they were, that SIGINT and
// SIGTERM remove the copy at once, and that a rerun or a delete --force
// leaves no copy behind after any signal.
func TestSignalledRecover(t *testing.T) {
	const offset = 2 << 30 // in a volume whose scan lasts seconds
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
				// Data for the copy to take a while over: recover reads the
				// device for its data before it makes the copy.
				_, err = dev.WriteAt(bytes.Repeat([]byte{0x5a}, 256<<20), 0)
				if err == nil {
					_, err = dev.WriteAt(marker, offset)
				}
				if cerr := dev.Close(); err != nil || cerr != nil {
					t.Fatal(err, cerr)
				}
				if err := os.Remove(st.BackingFile); err != nil {
					t.Fatal(err)
				}

				r := signalled(t, root, sig, exists(filepath.Join(root, ".recover-*")), "recover", "gone")
				if sig == syscall.SIGKILL {
					if !r.signaled {
						t.Fatalf("recover survived SIGKILL: exit %d %s", r.code, r.stderr)
					}
				} else {
					checkStopped(t, r, sig)
					if m, _ := filepath.Glob(filepath.Join(root, ".recover-*")); len(m) > 0 {
						t.Errorf("left after %s: %v", sig, m)
					}
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

// checkStopped fails the test unless r is the end of a command that sig
// stopped: exit 1, not killed, with the signal named.
func checkStopped(t *testing.T, r result, sig syscall.Signal) {
	t.Helper()
	if r.signaled || r.code != 1 || !strings.Contains(r.stderr, "stopped by "+unix.SignalName(sig)) {
		t.Fatalf("after %s: exit %d, killed %v, %q; want exit 1 naming the signal", sig, r.code, r.signaled, r.stderr)
	}
}

// TestSignalUndoes stops each long operation on a copy store (no
// reflink) with SIGINT or SIGTERM while it works, and checks that it
// exits 1 having undone everything it began: the store and its devices
// are as before, and the mounted source is thawed.
func TestSignalUndoes(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "src", "--size", "2G")
	st := statuses(t, root)[0]
	mnt := t.TempDir()
	if err := unix.Mount(st.DataDevice, mnt, "ext4", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err == nil {
			mustRun(t, root, "delete", "src")
		}
	})
	// Data for copies that last a second or so.
	if out, err := exec.Command("dd", "if=/dev/zero", "of="+filepath.Join(mnt, "data"), "bs=1M", "count=1024", "conv=fsync").CombinedOutput(); err != nil {
		t.Fatalf("dd: %v: %s", err, out)
	}
	mustRun(t, root, "snapshot", "create", "src", "snap")

	// A new record of a volume or snapshot: the operation is under way.
	records := func() int {
		vols, _ := filepath.Glob(filepath.Join(root, "*.json"))
		snaps, _ := filepath.Glob(filepath.Join(root, ".snapshots", "*.json"))
		return len(vols) + len(snaps)
	}
	before := records()
	begun := func() bool { return records() > before }

	tests := []struct {
		name string
		args []string
	}{
		{"create", []string{"--overcommit-ratio", "1000", "create", "new", "--size", "200G"}},
		{"restore", []string{"create", "new", "--from-snapshot", "snap"}},
		{"clone of a mounted volume", []string{"create", "new", "--clone-of", "src"}},
		{"snapshot of a mounted volume", []string{"snapshot", "create", "src", "snap2"}},
	}
	for _, tt := range tests {
		for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
			t.Run(tt.name+"/"+sig.String(), func(t *testing.T) {
				want := snapshot(t, root)
				checkStopped(t, signalled(t, root, sig, begun, tt.args...), sig)
				if got := snapshot(t, root); got != want {
					t.Errorf("store after %s:\n%s\nwant:\n%s", sig, got, want)
				}
				if notes, _ := filepath.Glob(filepath.Join(root, ".locks", "frozen-*")); len(notes) > 0 {
					t.Errorf("freeze notes left: %v", notes)
				}
				wrote := make(chan error, 1)
				go func() { wrote <- os.WriteFile(filepath.Join(mnt, "probe"), []byte("x"), 0o600) }()
				select {
				case err := <-wrote:
					if err != nil {
						t.Fatal(err)
					}
				case <-time.After(10 * time.Second):
					t.Fatal("the source's filesystem is still frozen")
				}
			})
		}
	}
}
