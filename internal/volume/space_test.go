package volume

import (
	"context"
	"crypto/rand"
	"errors"
	"math"
	"os"
	"testing"
)

// TestSpaceHugeRatio: a ratio whose limit does not fit in an int64 promises
// the most there is, not nothing (the conversion of the product used to be
// math.MinInt64 on amd64, and only wrapped round by luck when volumes
// existed).
func TestSpaceHugeRatio(t *testing.T) {
	for _, ratio := range []float64{1e9, 1e300} {
		s := newStore(t, Options{OvercommitRatio: ratio})
		sp, err := s.Space()
		if err != nil || sp.CapacityBytes < math.MaxInt64/4 {
			t.Errorf("ratio %g: capacity %d (%v), want at least %d", ratio, sp.CapacityBytes, err, int64(math.MaxInt64/4))
		}
		rawVolume(t, s, "v")
	}
}

// TestSpaceCountsSharedOnce: on a reflink store a snapshot shares its
// volume's extents, which Space counts once, and owns nothing until the
// volume changes; then it owns what changed. On a copy store it owns
// everything. Either way the policy counts what the snapshot holds as
// promised.
func TestSpaceCountsSharedOnce(t *testing.T) {
	for _, sk := range storeKinds {
		t.Run(sk.fs, func(t *testing.T) {
			s := fsStore(t, sk.fs, Options{})
			ctx := context.Background()
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 64 << 20, Mode: ModeBlock, NoPartition: true})
			writeFileAt(t, v.BackingFile, 0, 32<<20)
			before, err := s.Space()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := s.CreateSnapshot(ctx, v.Name, "s", SnapshotOptions{}); err != nil {
				t.Fatal(err)
			}
			sn, err := s.GetSnapshot(ctx, "s")
			if err != nil {
				t.Fatal(err)
			}
			after, err := s.Space()
			if err != nil {
				t.Fatal(err)
			}
			grew := after.AllocatedBytes - before.AllocatedBytes
			wantOwn := int64(32 << 20)
			if sk.method == CopyReflink {
				wantOwn = 0
			}
			if sn.AllocatedBytes != 32<<20 || sn.OwnBytes != wantOwn || grew != wantOwn {
				t.Fatalf("snapshot holds %d, owns %d; store grew by %d; want 32MiB, %d, %d", sn.AllocatedBytes, sn.OwnBytes, grew, wantOwn, wantOwn)
			}
			if after.SnapshotBytes != 32<<20 || after.CommittedBytes != before.CommittedBytes+32<<20 {
				t.Fatalf("committed %d -> %d, snapshots %d: want the snapshot's 32MiB promised", before.CommittedBytes, after.CommittedBytes, after.SnapshotBytes)
			}
			st, err := s.Status(v.Name)
			if err != nil {
				t.Fatal(err)
			}
			if wantShared := 32<<20 - wantOwn; st.SharedBytes != wantShared {
				t.Fatalf("volume's shared bytes %d, want %d", st.SharedBytes, wantShared)
			}
			// The volume changes 8MiB: the snapshot now owns them.
			writeFileAt(t, v.BackingFile, 0, 8<<20)
			got, err := s.GetSnapshot(ctx, sn.Name)
			if err != nil {
				t.Fatal(err)
			}
			if sk.method == CopyReflink && got.OwnBytes != 8<<20 {
				t.Fatalf("after 8MiB of the volume changed the snapshot owns %d, want 8MiB", got.OwnBytes)
			}
			if err := s.DeleteSnapshot(ctx, sn.Name); err != nil {
				t.Fatal(err)
			}
			if err := s.Delete(ctx, v.Name, DetachOptions{}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// writeFileAt writes n random bytes at off of the file at path, fsynced.
func writeFileAt(t *testing.T, path string, off, n int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, n)
	rand.Read(buf)
	if _, err := f.WriteAt(buf, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestSpaceCheckAgrees: the space check lets through without measuring
// the files only what the full figures allow too. With a snapshot in the
// store, growth well within the free space, growth that needs what the
// files hold counted, and growth beyond the capacity are decided as
// Space's figures say.
func TestSpaceCheckAgrees(t *testing.T) {
	for _, sk := range storeKinds {
		t.Run(sk.fs, func(t *testing.T) {
			s := fsStore(t, sk.fs, Options{})
			ctx := context.Background()
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 64 << 20, Mode: ModeBlock, NoPartition: true})
			writeFileAt(t, v.BackingFile, 0, 32<<20)
			if _, err := s.CreateSnapshot(ctx, v.Name, "s", SnapshotOptions{}); err != nil {
				t.Fatal(err)
			}
			sp, err := s.Space()
			if err != nil {
				t.Fatal(err)
			}
			if sp.AllocatedBytes < 16<<20 {
				t.Fatalf("allocated %d, want the volume's 32MiB counted", sp.AllocatedBytes)
			}
			// Free space moves a little as the filesystem settles: a
			// margin well below what the files hold.
			const margin = 4 << 20
			for _, c := range []struct {
				delta int64
				ok    bool
			}{{1 << 20, true}, {sp.CapacityBytes - margin, true}, {sp.CapacityBytes + margin, false}} {
				err := s.checkSpace(c.delta, false)
				if c.ok && err != nil || !c.ok && !errors.Is(err, ErrNoSpace) {
					t.Errorf("checkSpace(%d) with capacity %d (allocated %d) = %v, want allowed %v", c.delta, sp.CapacityBytes, sp.AllocatedBytes, err, c.ok)
				}
			}
		})
	}
}
