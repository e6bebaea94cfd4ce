//go:build crashtest

package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// The crash-safety tests need crash points compiled into the binary: run
// them with -tags crashtest (make test does).

// TestCrashSafety kills the CLI with SIGKILL at every step of create,
// expand and delete, and checks that the volume is never reported ready
// when it is not, and that rerunning the command, or delete, converges
// with no leaked loop device.
func TestCrashSafety(t *testing.T) {
	createSteps := []string{"create:reserved", "create:file", "create:attached", "create:formatted", "create:ready"}
	for _, step := range createSteps {
		for _, recovery := range []string{"rerun", "delete"} {
			t.Run(step+"/"+recovery, func(t *testing.T) {
				root := newRoot(t)
				r := sparsevol(t, root, []string{volume.CrashEnv + "=" + step}, "create", "v", "--size", "16M")
				if !r.signaled {
					t.Fatalf("crash point %s not reached: exit %d %s", step, r.code, r.stderr)
				}
				sts := statuses(t, root)
				if len(sts) != 1 {
					t.Fatalf("%d volumes after crash, want 1", len(sts))
				}
				if step != "create:ready" && sts[0].State == volume.StateReady {
					t.Fatalf("volume reported ready after a crash at %s", step)
				}
				if recovery == "delete" {
					mustRun(t, root, "delete", "v")
					if sts := statuses(t, root); len(sts) != 0 {
						t.Fatalf("volumes left after delete: %+v", sts)
					}
					assertEmptyStore(t, root)
					return
				}
				r = sparsevol(t, root, nil, "create", "v", "--size", "16M")
				if step == "create:ready" {
					// Finished before the kill: the name is simply taken.
					if r.code != 2 {
						t.Fatalf("rerun after a complete create: exit %d, want 2", r.code)
					}
				} else if r.code != 0 {
					t.Fatalf("rerun create: exit %d: %s", r.code, r.stderr)
				}
				st := statuses(t, root)[0]
				if st.State != volume.StateReady || len(st.ExtraDevices) > 0 {
					t.Fatalf("after rerun: %+v", st)
				}
				if out, err := exec.Command("blkid", "-p", "-s", "UUID", "-o", "value", st.BackingFile).Output(); err != nil || strings.TrimSpace(string(out)) != st.UUID {
					t.Fatalf("filesystem UUID %q, want %s", out, st.UUID)
				}
				mustRun(t, root, "delete", "v")
			})
		}
	}
	for _, step := range []string{"expand:recorded", "expand:file", "expand:grown"} {
		t.Run(step, func(t *testing.T) {
			root := newRoot(t)
			mustRun(t, root, "create", "v", "--size", "16M")
			r := sparsevol(t, root, []string{volume.CrashEnv + "=" + step}, "expand", "v", "--size", "48M")
			if !r.signaled {
				t.Fatalf("crash point %s not reached: exit %d %s", step, r.code, r.stderr)
			}
			mustRun(t, root, "expand", "v", "--size", "48M")
			st := statuses(t, root)[0]
			if st.SizeBytes != 48<<20 || st.ExpandingTo != 0 || st.FileSizeBytes != 48<<20 {
				t.Fatalf("after rerun: size %d, expanding %d, file %d", st.SizeBytes, st.ExpandingTo, st.FileSizeBytes)
			}
			if size, _ := loop.Size(st.Device); size != 48<<20 {
				t.Fatalf("device size %d", size)
			}
			mustRun(t, root, "delete", "v")
		})
	}
	for _, step := range []string{"delete:marked", "delete:detached", "delete:file"} {
		t.Run(step, func(t *testing.T) {
			root := newRoot(t)
			mustRun(t, root, "create", "v", "--size", "16M")
			r := sparsevol(t, root, []string{volume.CrashEnv + "=" + step}, "delete", "v")
			if !r.signaled {
				t.Fatalf("crash point %s not reached: exit %d %s", step, r.code, r.stderr)
			}
			if sts := statuses(t, root); len(sts) != 1 || sts[0].State != volume.StateDeleting {
				t.Fatalf("after crash: %+v", sts)
			}
			if r := sparsevol(t, root, nil, "attach", "v"); r.code == 0 {
				t.Fatal("a volume being deleted was attached")
			}
			mustRun(t, root, "delete", "v")
			assertEmptyStore(t, root)
		})
	}
}

// TestExpandCrashWithTemporaryMount: a crash while an offline XFS expansion
// has its temporary mount leaves nothing that blocks a rerun or delete.
func TestExpandCrashWithTemporaryMount(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "x", "--size", "300M", "--fs", "xfs", "--no-start")
	r := sparsevol(t, root, []string{volume.CrashEnv + "=expand:mounted"}, "expand", "x", "--size", "400M")
	if !r.signaled {
		t.Fatalf("crash point not reached: exit %d %s", r.code, r.stderr)
	}
	mustRun(t, root, "expand", "x", "--size", "400M")
	st := statuses(t, root)[0]
	if len(st.MountPoints) > 0 || st.SizeBytes != 400<<20 {
		t.Fatalf("after rerun: mounts %v, size %d", st.MountPoints, st.SizeBytes)
	}
	mustRun(t, root, "delete", "x")
}

// TestExpandStatesCLI: an expand whose first step fails (EFBIG: the file
// size limit stands for a size the filesystem cannot hold) leaves nothing
// pending; one that stopped after the file grew is listed and shown as
// expanding with its target, and can be abandoned or finished.
func TestExpandStatesCLI(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "v", "--size", "32M", "--mode", "block", "--no-partition", "--no-start")
	file := func() int64 {
		t.Helper()
		sts := statuses(t, root)
		return sts[0].FileSizeBytes
	}

	// The first step fails: EFBIG.
	cmd := exec.Command("prlimit", "--fsize=67108864", "--", os.Args[0], "--root", root, "--overcommit-ratio", "1e9", "expand", "v", "--size", "20T")
	cmd.Env = append(os.Environ(), asCLI+"=1")
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(string(out), "file too large") {
		t.Fatalf("expand beyond the file size limit: %v: %s; want exit 1, file too large", err, out)
	}
	if st := statuses(t, root)[0]; st.State != "ready" || st.ExpandingTo != 0 || file() != 32<<20 {
		t.Fatalf("after a failed first step: state %s, pending %d, file %d; want ready, nothing pending, 32 MiB", st.State, st.ExpandingTo, file())
	}
	mustRun(t, root, "create", "w", "--size", "1M", "--mode", "block", "--no-partition", "--no-start")

	crash := func() {
		t.Helper()
		r := sparsevol(t, root, []string{volume.CrashEnv + "=expand:file"}, "expand", "v", "--size", "48M")
		if !r.signaled {
			t.Fatalf("crash point not reached: exit %d %s", r.code, r.stderr)
		}
	}
	crash()
	runSteps(t, root, []cliStep{
		{[]string{"list"}, 0, []string{"32Mi->48Mi", "expanding", "--abandon"}, nil, nil},
		{[]string{"list", "-o", "json"}, 0, []string{`"state": "expanding"`, `"expandingTo": 50331648`}, nil, nil},
		{[]string{"status", "v"}, 0, []string{"expanding", "Expanding to:", "48Mi", "backing file 50331648 bytes"}, nil, nil},
		{[]string{"expand", "v", "--size", "40M"}, 2, nil, nil, nil},
		{[]string{"expand", "v"}, 2, nil, nil, nil},
		{[]string{"expand", "v", "--size", "48M", "--abandon"}, 2, nil, nil, nil},
		{[]string{"expand", "v", "--abandon"}, 0, []string{"v\t32Mi"}, nil, nil},
		{[]string{"status", "v"}, 0, []string{"ready", "32Mi"}, nil, nil},
		{[]string{"expand", "v", "--abandon"}, 2, nil, nil, nil},
	})

	if got := file(); got != 32<<20 {
		t.Errorf("backing file %d bytes after abandon, want %d", got, 32<<20)
	}
	crash()
	if out := mustRun(t, root, "expand", "v", "--size", "48M"); out != "v\t48Mi\n" {
		t.Errorf("finishing: %q", out)
	}
	if st := statuses(t, root)[0]; st.State != "ready" || st.SizeBytes != 48<<20 || file() != 48<<20 {
		t.Errorf("after finishing: state %s size %d file %d", st.State, st.SizeBytes, file())
	}
}
