package volume

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sparsevol/sparsevol/internal/testutil"
)

// storeDir makes an empty directory with exactly mode perm.
func storeDir(t *testing.T, perm os.FileMode) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "store")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, perm); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestOpenMakesStorePrivate(t *testing.T) {
	testutil.RequireRoot(t)
	const uuid = "3f0c1f4e-8a51-4c3e-9a57-1b7c2d9e4f60"
	chown := func(t *testing.T, dir string) {
		t.Helper()
		if err := os.Chown(dir, 4242, 4242); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name string
		perm os.FileMode
		// setup prepares dir and returns the root to open.
		setup    func(t *testing.T, dir string) string
		wantErr  bool        // ErrInvalid, nothing changed
		wantPerm os.FileMode // of dir afterwards
	}{
		{"world-writable", 0o777, nil, false, 0o700},
		{"world-readable", 0o755, nil, false, 0o700},
		{"group-readable", 0o750, nil, false, 0o700},
		{"holding only store entries", 0o777, func(t *testing.T, dir string) string {
			for _, d := range []string{lockDir, "lost+found"} {
				os.Mkdir(filepath.Join(dir, d), 0o700)
			}
			for _, f := range []string{uuid, uuid + metaExt, ".tmp-" + uuid + metaExt + "-123", ".recover-" + uuid, ".doctor-42"} {
				os.WriteFile(filepath.Join(dir, f), nil, 0o600)
			}
			return dir
		}, false, 0o700},
		{"holding a file that is not the store's", 0o777, func(t *testing.T, dir string) string {
			os.WriteFile(filepath.Join(dir, "notes.txt"), nil, 0o644)
			return dir
		}, true, 0o777},
		{"owned by another user", 0o700, func(t *testing.T, dir string) string { chown(t, dir); return dir }, true, 0o700},
		{"owned by another user, world-writable", 0o777, func(t *testing.T, dir string) string { chown(t, dir); return dir }, true, 0o777},
		{"symlink to a private store", 0o700, func(t *testing.T, dir string) string {
			link := dir + "-link"
			if err := os.Symlink(dir, link); err != nil {
				t.Fatal(err)
			}
			return link
		}, true, 0o700},
		{"symlink to a world-writable store", 0o777, func(t *testing.T, dir string) string {
			link := dir + "-link"
			if err := os.Symlink(dir, link); err != nil {
				t.Fatal(err)
			}
			return link
		}, true, 0o777},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := storeDir(t, tt.perm)
			root := dir
			if tt.setup != nil {
				root = tt.setup(t, dir)
			}
			before, _ := os.ReadDir(dir)
			var logged bytes.Buffer
			_, err := Open(root, Options{Logger: slog.New(slog.NewTextHandler(&logged, nil))})
			fi, serr := os.Stat(dir)
			if serr != nil {
				t.Fatal(serr)
			}
			if got := fi.Mode().Perm(); got != tt.wantPerm {
				t.Errorf("mode %04o after Open, want %04o", got, tt.wantPerm)
			}
			if tt.wantErr {
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("Open = %v, want ErrInvalid", err)
				}
				if after, _ := os.ReadDir(dir); len(after) != len(before) {
					t.Fatalf("refused Open changed the directory: %v -> %v", before, after)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(logged.String(), "level=WARN") || !strings.Contains(logged.String(), "made it private") {
				t.Fatalf("tightening was not said as a warning; log:\n%s", logged.String())
			}
		})
	}
}

// TestListRemovesStaleTemps: a listing sweeps the temporary metadata of
// dead writers, never one whose writer may still run; Open leaves them.
func TestListRemovesStaleTemps(t *testing.T) {
	testutil.RequireRoot(t)
	const uuid = "9d2b7a64-0c1e-4f8a-b3d5-6e7f8a9b0c1d"
	stale := ".tmp-" + uuid + metaExt + "-4107342391"
	// Names that are no temporary metadata of the store's stay.
	others := []string{".tmp-sparsevol@" + uuid + ".service-1", ".tmp-" + uuid + metaExt + "-12x", ".tmp-notauuid.json-1", uuid + metaExt}
	tests := []struct {
		name string
		held string // lock held by a live writer while the store is listed, "" none
	}{
		{"writer dead", ""},
		{"volume lock held", uuid},
		{"store lock held", storeLock},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := storeDir(t, 0o700)
			writer, err := Open(dir, Options{})
			if err != nil {
				t.Fatal(err)
			}
			lister, err := Open(dir, Options{})
			if err != nil {
				t.Fatal(err)
			}
			for _, name := range append([]string{stale}, others...) {
				if err := os.WriteFile(filepath.Join(dir, name), []byte("{}\n"), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			exists := func(name string) bool {
				_, err := os.Lstat(filepath.Join(dir, name))
				return err == nil
			}
			if tt.held != "" {
				unlock, err := writer.lock(tt.held)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := lister.List(); err != nil {
					unlock()
					t.Fatal(err)
				}
				unlock()
				if !exists(stale) {
					t.Fatalf("%s removed while its writer may run (%s held)", stale, tt.held)
				}
			}
			if _, err := Open(dir, Options{}); err != nil {
				t.Fatal(err)
			}
			if !exists(stale) {
				t.Fatalf("%s removed by Open: a call about one volume reads no directory", stale)
			}
			if _, err := lister.List(); err != nil {
				t.Fatal(err)
			}
			if exists(stale) {
				t.Errorf("%s left after a listing with no writer", stale)
			}
			for _, name := range others {
				if !exists(name) {
					t.Errorf("%s removed: not a temporary metadata file", name)
				}
			}
		})
	}
}
