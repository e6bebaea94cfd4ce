package testutil

import (
	"encoding/json"
	"os"
	"testing"
)

// EditJSON rewrites the JSON object in the file at path as edit changes
// it, the way an attacker who can write the file (or another release of
// sparsevol) would: decoded into a map, edited, encoded and written back
// over the file, mode 0600.
func EditJSON(t testing.TB, path string, edit func(rec map[string]any)) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rec map[string]any
	if err := json.Unmarshal(data, &rec); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	edit(rec)
	if data, err = json.Marshal(rec); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}
