package fsutil

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

func TestReplaceFile(t *testing.T) {
	for _, flush := range []Flush{FlushAll, FlushNone, FlushOnce} {
		t.Run(fmt.Sprint(flush), func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "f")
			for _, content := range []string{"one", "two, longer"} {
				if err := ReplaceFile(path, []byte(content), 0o640, flush); err != nil {
					t.Fatal(err)
				}
				got, err := os.ReadFile(path)
				if err != nil || string(got) != content {
					t.Fatalf("read %q, %v; want %q", got, err, content)
				}
				if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o640 {
					t.Errorf("mode %v, want 0640", fi.Mode().Perm())
				}
			}
			if entries, _ := os.ReadDir(dir); len(entries) != 1 {
				t.Errorf("temporary files left: %v", entries)
			}
		})
	}
}

func TestReplaceSymlink(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(dir, "sub", "link") // directory made on demand
	for _, target := range []string{"/dev/loop1", "/dev/loop1", "/dev/loop2"} {
		if err := ReplaceSymlink(target, link); err != nil {
			t.Fatal(err)
		}
		if got, err := os.Readlink(link); err != nil || got != target {
			t.Fatalf("link -> %q, %v; want %q", got, err, target)
		}
	}
	if entries, _ := os.ReadDir(filepath.Dir(link)); len(entries) != 1 {
		t.Errorf("temporary links left: %v", entries)
	}
}
