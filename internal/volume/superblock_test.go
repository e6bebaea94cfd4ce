package volume

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestSuperblockOf makes filesystems with mkfs and reads them back in
// process: what superblockOf confirms is what blkid finds, and whatever
// it cannot prove (other ext flavours, no checksum, a damaged superblock)
// it leaves to blkid with the zero Found.
func TestSuperblockOf(t *testing.T) {
	s := &Store{run: execRunner{}, log: slog.New(slog.DiscardHandler)}
	tests := []struct {
		name    string
		fsType  string // what is asked for
		mkfs    []string
		size    int64
		damage  int64 // if not 0, a byte of the superblock flipped here
		confirm bool  // superblockOf proves it fsType's
	}{
		{"ext4", "ext4", []string{"mkfs.ext4", "-q", "-F"}, 64 << 20, 0, true},
		{"ext4 of 4 KiB blocks", "ext4", []string{"mkfs.ext4", "-q", "-F", "-b", "4096"}, 64 << 20, 0, true},
		{"ext4 without metadata_csum", "ext4", []string{"mkfs.ext4", "-q", "-F", "-O", "^metadata_csum"}, 64 << 20, 0, false},
		{"ext4 damaged", "ext4", []string{"mkfs.ext4", "-q", "-F"}, 64 << 20, 1024 + 0x78, false},
		{"ext3", "ext4", []string{"mkfs.ext3", "-q", "-F"}, 64 << 20, 0, false},
		{"ext2", "ext4", []string{"mkfs.ext2", "-q", "-F"}, 64 << 20, 0, false},
		{"xfs asked as ext4", "ext4", []string{"mkfs.xfs", "-q", "-f"}, 300 << 20, 0, false},
		{"xfs", "xfs", []string{"mkfs.xfs", "-q", "-f"}, 300 << 20, 0, true},
		{"xfs of 4 KiB sectors", "xfs", []string{"mkfs.xfs", "-q", "-f", "-s", "size=4096"}, 300 << 20, 0, true},
		{"xfs damaged", "xfs", []string{"mkfs.xfs", "-q", "-f"}, 300 << 20, 0x6c, false},
		{"ext4 asked as xfs", "xfs", []string{"mkfs.ext4", "-q", "-F"}, 64 << 20, 0, false},
		{"nothing", "ext4", nil, 64 << 20, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "img")
			if err := os.WriteFile(file, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(file, tt.size); err != nil {
				t.Fatal(err)
			}
			if tt.mkfs != nil {
				if out, err := exec.Command(tt.mkfs[0], append(tt.mkfs[1:], file)...).CombinedOutput(); err != nil {
					t.Fatalf("%s: %v: %s", tt.mkfs, err, out)
				}
			}
			if tt.damage != 0 {
				flipByte(t, file, tt.damage)
			}
			got := superblockOf(file, tt.fsType)
			if !tt.confirm {
				if got != (Found{}) {
					t.Fatalf("superblockOf = %v, want nothing proven", got)
				}
				return
			}
			blkid, err := s.probe(context.Background(), file)
			if err != nil {
				t.Fatal(err)
			}
			if got.Type != tt.fsType || got != blkid {
				t.Errorf("superblockOf = %+v, blkid finds %+v; want both %s", got, blkid, tt.fsType)
			}
		})
	}
}

func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}
