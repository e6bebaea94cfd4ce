package attack

import "testing"

// delete of a volume whose backing file is a symlink refuses (exit 1):
// the store entry is not provably the volume's own, and the data may live
// on at the target (as with a second hard link). The victim and a foreign
// device on it stay.
func TestSymlinkedBackingFileDelete(t *testing.T) {
	symlinkedBackingFile(t, "delete")
}
