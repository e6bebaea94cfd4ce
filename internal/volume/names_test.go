package volume

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// scanCounts are the counts of the whole-store and whole-machine looks:
// directory reads of the store, and lists of the bound loop devices.
type scanCounts struct{ dir, loops int64 }

func countScans() scanCounts { return scanCounts{storeDirReads.Load(), loop.Scans()} }

// TestNameHints: Get by name trusts no hint. Whatever the hint says (gone,
// another volume, no UUID, not a link), Get returns the volume that has
// the name, and a hint it could rewrite costs no scan the next time; a
// deleted volume takes its hint along.
func TestNameHints(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name   string
		meddle func(t *testing.T, hint string, other *Volume)
		scans  bool // the first Get after meddle reads the store
		repair bool // and leaves a hint that holds
	}{
		{"intact", func(*testing.T, string, *Volume) {}, false, true},
		{"gone", func(t *testing.T, hint string, _ *Volume) { mustDo(t, os.Remove(hint)) }, true, true},
		{"another volume's", func(t *testing.T, hint string, other *Volume) {
			mustDo(t, os.Remove(hint))
			mustDo(t, os.Symlink(other.UUID, hint))
		}, true, true},
		{"no uuid", func(t *testing.T, hint string, other *Volume) {
			mustDo(t, os.Remove(hint))
			mustDo(t, os.Symlink("../../"+other.UUID+metaExt, hint))
		}, true, true},
		{"no volume's uuid", func(t *testing.T, hint string, _ *Volume) {
			mustDo(t, os.Remove(hint))
			mustDo(t, os.Symlink(NewUUID(), hint))
		}, true, true},
		{"a directory", func(t *testing.T, hint string, _ *Volume) {
			mustDo(t, os.Remove(hint))
			mustDo(t, os.Mkdir(hint, 0o700))
		}, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			other := mustCreate(t, s, CreateRequest{Name: "other", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
			v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
			tt.meddle(t, filepath.Join(s.Root(), lockDir, nameDir, v.Name), other)
			for i, wantScan := range []bool{tt.scans, tt.scans && !tt.repair} {
				before := countScans()
				got, err := s.Get(v.Name)
				if err != nil || got.UUID != v.UUID {
					t.Fatalf("Get %d: %+v, %v; want volume %s", i, got, err, v.UUID)
				}
				if scanned := countScans().dir != before.dir; scanned != wantScan {
					t.Errorf("Get %d read the store directory: %t, want %t", i, scanned, wantScan)
				}
			}
			if err := s.Delete(ctx, v.Name, DetachOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Get(v.Name); !errors.Is(err, ErrNotFound) {
				t.Fatalf("Get of the deleted volume: %v, want ErrNotFound", err)
			}
			if target, err := os.Readlink(filepath.Join(s.Root(), lockDir, nameDir, v.Name)); err == nil {
				t.Errorf("the deleted volume's hint is left, pointing at %s", target)
			}
		})
	}
}

func mustDo(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestUUIDShaped: ValidUUID and the UUID-shaped name rule accept what the
// regular expressions of the UUID forms accept, over every byte at every
// position of a UUID and lengths around it.
func TestUUIDShaped(t *testing.T) {
	lower := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	anyCase := regexp.MustCompile(`^(?i)[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	base := "0a1b2c3d-4e5f-6789-abcd-ef0123456789"
	cases := []string{"", base, strings.ToUpper(base), base[1:], base + "0", base + "\n", "\n" + base[1:], nilUUID}
	for i := range len(base) {
		for c := range 256 {
			cases = append(cases, base[:i]+string([]byte{byte(c)})+base[i+1:])
		}
	}
	for _, s := range cases {
		if got, want := ValidUUID(s), lower.MatchString(s); got != want {
			t.Errorf("ValidUUID(%q) = %v, want %v", s, got, want)
		}
		if got, want := uuidShaped(s, true), anyCase.MatchString(s); got != want {
			t.Errorf("uuidShaped(%q, true) = %v, want %v", s, got, want)
		}
	}
}
