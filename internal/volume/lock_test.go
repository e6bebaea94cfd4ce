package volume

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestLockFollowsName: a lock file its holder removes (release) while
// another waits on it does not leave the waiter holding a file no one
// else can find: once the waiter has the lock, a third caller is kept out
// by it.
func TestLockFollowsName(t *testing.T) {
	s := newStore(t, Options{})
	unlockA, err := s.lock("x")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan func(), 1)
	go func() {
		unlock, err := s.lock("x")
		if err != nil {
			t.Error(err)
			got <- func() {}
			return
		}
		got <- unlock
	}()
	// Give the waiter time to reach its flock: if it gets there after the
	// removal, it makes a new file and the test proves less, never wrong.
	time.Sleep(200 * time.Millisecond)
	if err := os.Remove(filepath.Join(s.Root(), lockDir, "x")); err != nil {
		t.Fatal(err)
	}
	unlockA()
	unlockB := <-got
	defer unlockB()
	if unlock, err := s.tryLock("x"); !errors.Is(err, unix.EWOULDBLOCK) {
		if err == nil {
			unlock()
		}
		t.Fatalf("tryLock while the waiter holds the lock: %v, want EWOULDBLOCK", err)
	}
}

// TestDeleteRemovesLocks: deleting a volume or a snapshot removes its lock
// file; .locks does not grow with every volume and snapshot ever made.
func TestDeleteRemovesLocks(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
	sn, err := s.CreateSnapshot(ctx, v.Name, "snap", SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	locks := filepath.Join(s.Root(), lockDir)
	for _, name := range []string{v.UUID, snapLock(sn.UUID)} {
		if _, err := os.Lstat(filepath.Join(locks, name)); err != nil {
			t.Fatalf("lock file %s before the delete: %v", name, err)
		}
	}
	if err := s.DeleteSnapshot(ctx, sn.Name); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, v.Name, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{v.UUID, snapLock(sn.UUID)} {
		if _, err := os.Lstat(filepath.Join(locks, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("lock file %s after the delete: %v, want it gone", name, err)
		}
	}
}

// TestWaiterLeavesNoLock: a call that waited on a volume's lock while the
// holder deleted the volume finds it gone (ErrNotFound) and leaves no lock
// file behind, though its wait made one anew (flock follows the name).
func TestWaiterLeavesNoLock(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, Options{})
	v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
	if err := s.Detach(v.Name, DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	unlock, err := s.lock(v.UUID)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := s.Attach(ctx, v.UUID); done <- err }()
	// Give the waiter time to reach its flock: if it gets there after the
	// delete, it finds no volume before locking and the test proves less,
	// never wrong.
	time.Sleep(200 * time.Millisecond)
	// What Delete does while it holds the lock: the volume's files go.
	if err := s.removeBacking(v.UUID); err != nil {
		t.Fatal(err)
	}
	if err := s.removeMeta(v.UUID); err != nil {
		t.Fatal(err)
	}
	unlock()
	if err := <-done; !errors.Is(err, ErrNotFound) {
		t.Fatalf("attach of a volume deleted while it waited: %v, want ErrNotFound", err)
	}
	if _, err := os.Lstat(filepath.Join(s.Root(), lockDir, v.UUID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("lock file after the waiter: %v, want it gone", err)
	}
}

// waitHeld waits until another caller holds the lock name (tryLock fails
// with EWOULDBLOCK).
func waitHeld(t *testing.T, s *Store, name string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		unlock, err := s.tryLock(name)
		switch {
		case errors.Is(err, unix.EWOULDBLOCK):
			return
		case err != nil:
			t.Fatal(err)
		}
		unlock()
		if time.Now().After(deadline) {
			t.Fatalf("lock %s: nobody took it", name)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestCloneRetryAndDetachAllDoNotDeadlock: every caller that holds two or
// more volume locks takes them in UUID order. A clone a crash left
// creating, whose UUID sorts before its source's, is finished by a rerun
// while detach --all holds the clone's lock and waits on a busy volume
// (between the two in UUID order): once the busy volume is free, both
// finish.
func TestCloneRetryAndDetachAllDoNotDeadlock(t *testing.T) {
	const (
		cloneUUID = "00000000-0000-4000-8000-00000000c10e"
		busyUUID  = "77777777-0000-4000-8000-0000000000b5"
		srcUUID   = "ffffffff-0000-4000-8000-000000000005"
	)
	ctx := context.Background()
	s := newStore(t, Options{})
	for name, uuid := range map[string]string{"src": srcUUID, "busy": busyUUID} {
		mustCreate(t, s, CreateRequest{Name: name, UUID: uuid, SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
	}
	req := CreateRequest{Name: "clone", CloneOf: "src", UUID: cloneUUID}
	crashed := req
	if err := crashed.Normalize(); err != nil {
		t.Fatal(err)
	}
	if err := s.resolveSource(&crashed); err != nil {
		t.Fatal(err)
	}
	if _, err := s.reserve(crashed); err != nil { // what a create killed before the copy leaves
		t.Fatal(err)
	}

	unlockBusy, err := s.lock(busyUUID)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(unlockBusy)
	detached := make(chan error, 1)
	go func() { detached <- s.DetachAll(DetachOptions{}) }()
	waitHeld(t, s, cloneUUID) // detach --all has the clone's lock, waits on busy
	created := make(chan error, 1)
	go func() { _, err := s.Create(ctx, req); created <- err }()
	// Give the create time to reach its locks: if it gets there after
	// detach --all is done, the test proves less, never wrong.
	time.Sleep(200 * time.Millisecond)
	unlockBusy()

	timeout := time.After(30 * time.Second)
	for _, c := range []struct {
		op   string
		done chan error
	}{{"detach --all", detached}, {"create (rerun of the clone)", created}} {
		select {
		case err := <-c.done:
			if err != nil {
				t.Errorf("%s: %v", c.op, err)
			}
		case <-timeout:
			t.Fatalf("%s still waits on a lock: deadlock", c.op)
		}
	}
	if v, err := s.Get(cloneUUID); err != nil || v.State != StateReady {
		t.Fatalf("clone after the rerun: %+v, %v; want it ready", v, err)
	}
}

// TestCloneRereadsSourceUnderLock: a clone resolves its source before it
// holds the source's lock (lockAll takes it with the new volume's), so a
// source that changed while the clone waited for that lock fails the
// create with ErrNotReady, rolled back: no clone is left, and a rerun
// starts afresh.
func TestCloneRereadsSourceUnderLock(t *testing.T) {
	tests := []struct {
		name   string
		change func(v *Volume)
	}{
		{"resized", func(v *Volume) { v.SizeBytes += 1 << 20 }},
		{"expanding", func(v *Volume) { v.ExpandingTo = v.SizeBytes + 1<<20 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := newStore(t, Options{})
			src := mustCreate(t, s, CreateRequest{Name: "src", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
			unlock, err := s.lock(src.UUID)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(unlock)
			created := make(chan error, 1)
			go func() { _, err := s.Create(ctx, CreateRequest{Name: "clone", CloneOf: "src"}); created <- err }()
			// Reserved: the clone resolved its source and waits for the locks.
			deadline := time.Now().Add(10 * time.Second)
			for {
				if _, err := s.Get("clone"); err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the clone was never reserved")
				}
				time.Sleep(10 * time.Millisecond)
			}
			v, err := s.readMeta(src.UUID)
			if err != nil {
				t.Fatal(err)
			}
			tt.change(v)
			if err := s.writeMeta(v); err != nil {
				t.Fatal(err)
			}
			unlock()
			select {
			case err := <-created:
				if !errors.Is(err, ErrNotReady) {
					t.Fatalf("clone of a source changed while it waited: %v, want ErrNotReady", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("the clone still waits on a lock")
			}
			if v, err := s.Get("clone"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("clone after the failure: %+v, %v; want it rolled back", v, err)
			}
		})
	}
}

// TestBadLockLeavesOutItsVolumeOnly: a volume whose lock file cannot be
// taken (not a regular file of its own) is reported by attach --all and
// detach --all (AttachMany, DetachAll) and left as it is; the store's
// other volumes are still attached and detached.
func TestBadLockLeavesOutItsVolumeOnly(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name string
		make func(t *testing.T, path string)
	}{
		{"symlink", func(t *testing.T, path string) {
			if err := os.Symlink("/etc/hostname", path); err != nil {
				t.Fatal(err)
			}
		}},
		{"fifo", func(t *testing.T, path string) {
			if err := unix.Mkfifo(path, 0o600); err != nil {
				t.Fatal(err)
			}
		}},
		{"directory", func(t *testing.T, path string) {
			if err := os.Mkdir(path, 0o700); err != nil {
				t.Fatal(err)
			}
		}},
		{"hard link", func(t *testing.T, path string) {
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Link(path, filepath.Join(filepath.Dir(path), "..", "linked")); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			a, b, c := rawVolume(t, s, "a"), rawVolume(t, s, "b"), rawVolume(t, s, "c")
			bad := filepath.Join(s.Root(), lockDir, b.UUID)
			t.Cleanup(func() {
				os.Remove(filepath.Join(s.Root(), "linked"))
				os.RemoveAll(bad)
				s.DetachAll(DetachOptions{})
			})
			if err := s.DetachAll(DetachOptions{}); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(bad); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Fatal(err)
			}
			tt.make(t, bad)
			attached := func(v *Volume) bool {
				t.Helper()
				st, err := s.Status(v.UUID)
				if err != nil {
					t.Fatal(err)
				}
				return st.Attached
			}
			_, err := s.AttachAll(ctx)
			if err == nil || !strings.Contains(err.Error(), b.UUID) {
				t.Errorf("AttachAll = %v, want an error naming %s", err, b.UUID)
			}
			if !attached(a) || !attached(c) || attached(b) {
				t.Errorf("after AttachAll: a %v, b %v, c %v attached; want a and c only", attached(a), attached(b), attached(c))
			}
			err = s.DetachAll(DetachOptions{})
			if err == nil || !strings.Contains(err.Error(), b.UUID) {
				t.Errorf("DetachAll = %v, want an error naming %s", err, b.UUID)
			}
			if attached(a) || attached(c) {
				t.Errorf("after DetachAll: a %v, c %v attached; want neither", attached(a), attached(c))
			}
		})
	}
}

// TestAttachManyWaitsForBusyLast: a volume whose lock another process
// holds does not keep attach --all from the others: they are attached
// while it waits, and the busy one once its lock is free.
func TestAttachManyWaitsForBusyLast(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s := newStore(t, Options{})
	a, b, c := rawVolume(t, s, "a"), rawVolume(t, s, "b"), rawVolume(t, s, "c")
	t.Cleanup(func() { s.DetachAll(DetachOptions{}) })
	if err := s.DetachAll(DetachOptions{}); err != nil {
		t.Fatal(err)
	}
	// Another holder: a second open of the store, as another process.
	other, err := Open(s.Root(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	unlock, err := other.lock(b.UUID)
	if err != nil {
		t.Fatal(err)
	}
	othersUp := make(chan bool, 1)
	go func() {
		defer unlock()
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			sa, errA := other.Status(a.UUID)
			sc, errC := other.Status(c.UUID)
			if errA == nil && errC == nil && sa.Attached && sc.Attached {
				othersUp <- true
				return
			}
		}
		othersUp <- false
	}()
	sts, err := s.AttachAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !<-othersUp {
		t.Error("a and c were not attached while b's lock was held")
	}
	var names []string
	for _, st := range sts {
		names = append(names, st.Name)
	}
	if want := []string{"a", "b", "c"}; !slices.Equal(names, want) {
		t.Errorf("attached %v, want %v", names, want)
	}
}
