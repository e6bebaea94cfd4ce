package volume

import (
	"context"
	"errors"
	"os"
	"path/filepath"
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
