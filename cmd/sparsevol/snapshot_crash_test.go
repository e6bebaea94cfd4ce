//go:build crashtest

package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestSnapshotCrashSafety kills the CLI at every step of snapshot create,
// snapshot delete, restore and import, and checks that nothing unfinished
// is reported ready, and that a rerun or a delete converges with nothing
// left behind.
func TestSnapshotCrashSafety(t *testing.T) {
	root := fsRoot(t, "xfs")
	mustRun(t, root, "create", "v", "--size", "64M")
	for _, step := range []string{"snapshot:reserved", "snapshot:frozen", "snapshot:copied", "snapshot:ready"} {
		for _, recovery := range []string{"rerun", "delete"} {
			t.Run(step+"/"+recovery, func(t *testing.T) {
				r := sparsevol(t, root, []string{volume.CrashEnv + "=" + step}, "snapshot", "create", "v", "s")
				if !r.signaled {
					t.Fatalf("crash point %s not reached: exit %d %s", step, r.code, r.stderr)
				}
				sns := snapshots(t, root)
				if len(sns) != 1 || (step != "snapshot:ready" && sns[0].ReadyToUse) {
					t.Fatalf("after a crash at %s: %+v", step, sns)
				}
				if recovery == "rerun" {
					mustRun(t, root, "snapshot", "create", "v", "s")
					if sns := snapshots(t, root); len(sns) != 1 || !sns[0].ReadyToUse {
						t.Fatalf("after rerun: %+v", sns)
					}
				}
				mustRun(t, root, "snapshot", "delete", "s")
				assertNoSnapshots(t, root)
			})
		}
	}
	for _, step := range []string{"snapshot-delete:marked", "snapshot-delete:file"} {
		t.Run(step, func(t *testing.T) {
			mustRun(t, root, "snapshot", "create", "v", "s")
			r := sparsevol(t, root, []string{volume.CrashEnv + "=" + step}, "snapshot", "delete", "s")
			if !r.signaled {
				t.Fatalf("crash point %s not reached: exit %d %s", step, r.code, r.stderr)
			}
			if sns := snapshots(t, root); len(sns) != 1 || sns[0].State != volume.StateDeleting {
				t.Fatalf("after crash: %+v", sns)
			}
			if r := sparsevol(t, root, nil, "create", "r", "--from-snapshot", "s"); r.code == 0 {
				t.Fatal("a snapshot being deleted was restored")
			}
			mustRun(t, root, "snapshot", "delete", "s")
			assertNoSnapshots(t, root)
		})
	}
	mustRun(t, root, "snapshot", "create", "v", "s")
	for _, step := range []string{"create:reserved", "restore:copied", "create:file", "create:attached", "restore:identity", "create:ready"} {
		for _, recovery := range []string{"rerun", "delete"} {
			t.Run("restore/"+step+"/"+recovery, func(t *testing.T) {
				r := sparsevol(t, root, []string{volume.CrashEnv + "=" + step}, "create", "r", "--from-snapshot", "s")
				if !r.signaled {
					t.Fatalf("crash point %s not reached: exit %d %s", step, r.code, r.stderr)
				}
				st := volumeNamed(t, root, "r")
				if step != "create:ready" && st.State == volume.StateReady {
					t.Fatalf("restored volume reported ready after a crash at %s", step)
				}
				if recovery == "rerun" {
					r := sparsevol(t, root, nil, "create", "r", "--from-snapshot", "s")
					if step != "create:ready" && r.code != 0 {
						t.Fatalf("rerun: exit %d: %s", r.code, r.stderr)
					}
					st := volumeNamed(t, root, "r")
					if st.State != volume.StateReady || blkidUUID(t, st.BackingFile) != st.UUID {
						t.Fatalf("after rerun: %+v", st)
					}
				}
				mustRun(t, root, "delete", "r")
			})
		}
	}
	t.Run("import:checked", func(t *testing.T) {
		stream := []byte(sparsevol(t, root, nil, "export", "s").stdout)
		before := snapshot(t, root)
		r := sparsevolIn(t, root, stream, []string{volume.CrashEnv + "=import:checked"}, "import", "i")
		if !r.signaled {
			t.Fatalf("crash point not reached: exit %d %s", r.code, r.stderr)
		}
		if after := snapshot(t, root); after != before {
			t.Errorf("a killed import left something:\nbefore %s\nafter  %s", before, after)
		}
	})
	mustRun(t, root, "snapshot", "delete", "s")
	mustRun(t, root, "delete", "v")
}

func volumeNamed(t *testing.T, root, name string) volume.Status {
	t.Helper()
	for _, st := range statuses(t, root) {
		if st.Name == name {
			return st
		}
	}
	t.Fatalf("no volume %s", name)
	return volume.Status{}
}

func assertNoSnapshots(t *testing.T, root string) {
	t.Helper()
	if sns := snapshots(t, root); len(sns) != 0 {
		t.Fatalf("snapshots left: %+v", sns)
	}
	entries, _ := os.ReadDir(root + "/.snapshots")
	for _, e := range entries {
		t.Errorf("left in .snapshots: %s", e.Name())
	}
}

// TestSnapshotKilledWhileFrozenThaws: the CLI killed (SIGKILL) while it
// holds a mounted volume's filesystem frozen leaves it thawed: writers go
// on. The proof is a second freeze, which the kernel refuses (EBUSY) while
// the filesystem is frozen; the guard thaws it as soon as it sees us gone.
func TestSnapshotKilledWhileFrozenThaws(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "v", "--size", "64M")
	st := volumeNamed(t, root, "v")
	dir := t.TempDir()
	if err := unix.Mount(st.DataDevice, dir, "ext4", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, 0) })
	r := sparsevol(t, root, []string{volume.CrashEnv + "=snapshot:frozen"}, "snapshot", "create", "v", "s")
	if !r.signaled {
		t.Fatalf("crash point not reached: exit %d %s", r.code, r.stderr)
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	const fifreeze, fithaw = 0xc0045877, 0xc0045878
	thawed := false
	for range 100 { // the guard runs once it reads the end of our pipe
		err := unix.IoctlSetInt(fd, fifreeze, 0)
		if err == nil {
			unix.IoctlSetInt(fd, fithaw, 0)
			thawed = true
			break
		}
		if !errors.Is(err, unix.EBUSY) {
			t.Fatalf("FIFREEZE: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !thawed {
		unix.IoctlSetInt(fd, fithaw, 0)
	}
	unix.Close(fd)
	if !thawed {
		t.Fatal("the filesystem stayed frozen after the CLI was killed")
	}
	// The guard removes the freeze note after its thaw (it runs rm after
	// fsfreeze: wait for it), so that no later start thaws anything
	// for it.
	note := filepath.Join(root, ".locks", "frozen-"+st.UUID)
	for i := 0; ; i++ {
		if _, err := os.Lstat(note); errors.Is(err, os.ErrNotExist) {
			break
		}
		if i == 50 {
			t.Fatalf("the freeze note %s outlived the guard's thaw", note)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := os.WriteFile(dir+"/after", []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	mustRun(t, root, "snapshot", "delete", "s")
	if err := unix.Unmount(dir, 0); err != nil {
		t.Fatal(err)
	}
	mustRun(t, root, "delete", "v")
	if out := mustRun(t, root, "snapshot", "list"); strings.Count(out, "\n") != 1 {
		t.Fatalf("snapshots left: %s", out)
	}
}

// TestImportLeftCreatingIsNotCreated: an import killed after its data
// was linked leaves a volume creating that holds the stream's data. A
// plain create of the same name and layout must not finish it into a
// "new" volume holding that data: it is refused (exit 2) with the way
// out, and the volume stays for delete, after which the import reruns.
func TestImportLeftCreatingIsNotCreated(t *testing.T) {
	root := newRoot(t)
	mustRun(t, root, "create", "src", "--size", "20Mi", "--mode", "block", "--no-partition", "--no-start")
	data := bytes.Repeat([]byte{0xab}, 5<<20)
	if err := os.WriteFile(volumeNamed(t, root, "src").BackingFile, data, 0o600); err != nil {
		t.Fatal(err)
	}
	stream := []byte(mustRun(t, root, "export", "src"))
	for _, step := range []string{"create:reserved", "create:file"} {
		t.Run(step, func(t *testing.T) {
			r := sparsevolIn(t, root, stream, []string{volume.CrashEnv + "=" + step}, "import", "i", "--no-start")
			if !r.signaled {
				t.Fatalf("crash point %s not reached: exit %d %s", step, r.code, r.stderr)
			}
			r = sparsevol(t, root, nil, "create", "i", "--size", "20Mi", "--mode", "block", "--no-partition", "--no-start")
			if r.code != 2 || !strings.Contains(r.stderr, "sparsevol delete i") {
				t.Fatalf("create over an unfinished import: exit %d, want 2 with advice to delete: %s", r.code, r.stderr)
			}
			if st := volumeNamed(t, root, "i"); st.State != volume.StateCreating {
				t.Fatalf("after the refused create: state %s, want %s", st.State, volume.StateCreating)
			}
			r = sparsevol(t, root, nil, "attach", "i")
			if r.code == 0 || !strings.Contains(r.stderr, "then import again") {
				t.Fatalf("attach of an unfinished import: exit %d, want a refusal advising delete and import: %s", r.code, r.stderr)
			}
			mustRun(t, root, "delete", "i")
			sparsevolIn(t, root, stream, nil, "import", "i", "--no-start")
			got, err := os.ReadFile(volumeNamed(t, root, "i").BackingFile)
			if err != nil || !bytes.Equal(got[:len(data)], data) {
				t.Fatalf("rerun import after delete: %v", err)
			}
			mustRun(t, root, "delete", "i")
		})
	}
	mustRun(t, root, "delete", "src")
}
