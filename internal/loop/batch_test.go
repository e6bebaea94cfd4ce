package loop

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// TestAttachMany binds a batch in parallel while foreign losetup processes
// take free devices at the same time: every request must end on its own
// device, bound to its own file, with the options asked for.
func TestAttachMany(t *testing.T) {
	testutil.RequireRoot(t)
	tests := []struct {
		name     string
		n        int
		parallel int
		foreign  int
		opts     AttachOptions
	}{
		{"sequential", 5, 1, 0, AttachOptions{}},
		{"parallel", 40, DefaultParallel, 0, AttachOptions{DirectIO: true, BlockSize: 512}},
		{"parallel with foreign losetup", 40, DefaultParallel, 10, AttachOptions{DirectIO: true}},
		{"empty", 0, DefaultParallel, 0, AttachOptions{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var reqs []AttachRequest
			var ids []FileID
			for i := range tt.n {
				path, id := backingFile(t, 1<<20)
				opts := tt.opts
				opts.Tag = fmt.Sprintf("sparsevol:batch-%d", i)
				reqs = append(reqs, AttachRequest{FD: openFD(t, path), Options: opts})
				ids = append(ids, id)
			}
			var foreign [][2]string // device, file
			var mu sync.Mutex
			var wg sync.WaitGroup
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			for range tt.foreign {
				path, _ := backingFile(t, 1<<20)
				wg.Add(1)
				go func() {
					defer wg.Done()
					out, err := exec.CommandContext(ctx, "losetup", "--find", "--show", path).Output()
					if err == nil {
						mu.Lock()
						foreign = append(foreign, [2]string{strings.TrimSpace(string(out)), path})
						mu.Unlock()
					}
				}()
			}
			results := AttachMany(reqs, tt.parallel)
			wg.Wait()
			t.Cleanup(func() {
				for _, f := range foreign {
					testutil.DetachIfServes(f[0], f[1])
				}
			})
			seen := map[string]bool{}
			for i, r := range results {
				if r.Err != nil {
					t.Errorf("request %d: %v", i, r.Err)
					continue
				}
				t.Cleanup(func() {
					if err := Detach(r.Device.Path, ownerOf(r.Device)); err != nil && !errors.Is(err, ErrNotAttached) {
						t.Errorf("detach %s: %v", r.Device.Path, err)
					}
				})
				if seen[r.Device.Path] {
					t.Errorf("device %s handed out twice", r.Device.Path)
				}
				seen[r.Device.Path] = true
				got, err := Get(r.Device.Path)
				if err != nil {
					t.Fatal(err)
				}
				if got.Backing != ids[i] || got.Tag != reqs[i].Options.Tag || got.Autoclear() {
					t.Errorf("request %d: device %s holds %+v tag %q autoclear %v", i, got.Path, got.Backing, got.Tag, got.Autoclear())
				}
				if tt.opts.BlockSize != 0 && got.BlockSize != tt.opts.BlockSize {
					t.Errorf("request %d: block size %d, want %d", i, got.BlockSize, tt.opts.BlockSize)
				}
			}
			for _, f := range foreign {
				if seen[f[0]] {
					t.Errorf("device %s given to both losetup and AttachMany", f[0])
				}
			}
		})
	}
}

// TestReserve: after a reserve of k, k devices are free for binding
// without adding any.
func TestReserve(t *testing.T) {
	testutil.RequireRoot(t)
	if added, err := Reserve(0); added != 0 || err != nil {
		t.Fatalf("Reserve(0) = %d, %v", added, err)
	}
	for _, k := range []int{1, 12} {
		control, err := lockControl()
		if err != nil {
			t.Fatal(err)
		}
		added, err := reserveLocked(control, k)
		if err != nil {
			unix.Close(control)
			t.Fatalf("reserve %d: %v", k, err)
		}
		// Still under the lock: tests of other packages bind devices too.
		slots, err := pickNumbers(k)
		again, againErr := reserveLocked(control, k)
		unix.Close(control)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range slots {
			if s.add {
				t.Fatalf("after reserving %d (added %d), loop%d must still be added", k, added, s.n)
			}
		}
		if again != 0 || againErr != nil {
			t.Fatalf("a second reserve of %d added %d devices (%v), want none", k, again, againErr)
		}
	}
}
