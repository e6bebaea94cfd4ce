package volume

import "testing"

func TestBlockSizeForMode(t *testing.T) {
	dir := t.TempDir()
	align := blockSizeFor(dir)
	tests := []struct {
		mode Mode
		want uint32
	}{
		{ModeFilesystem, FilesystemBlockSize},
		{ModeBlock, align},
	}
	for _, tt := range tests {
		t.Run(string(tt.mode), func(t *testing.T) {
			if got := blockSizeForMode(dir, tt.mode); got != tt.want {
				t.Errorf("blockSizeForMode(%s) = %d, want %d (alignment %d)", tt.mode, got, tt.want, align)
			}
		})
	}
	if align < 512 || align > 4096 || align&(align-1) != 0 {
		t.Errorf("alignment %d is not a power of two in 512..4096", align)
	}
}
