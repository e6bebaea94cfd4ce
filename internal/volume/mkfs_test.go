package volume

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// mkfsAccepted are option sets the allow-list takes, per filesystem; the
// mkfs run test makes a filesystem with each.
var mkfsAccepted = []struct {
	fs   string
	opts []string
}{
	{"ext4", []string{"-b 4096"}},
	{"ext4", []string{"-I 256 -i 16384", "-N 4000"}},
	{"ext4", []string{"-O ^has_journal,metadata_csum"}},
	{"ext4", []string{"-E stride=16,stripe_width=64,lazy_itable_init=0,lazy_journal_init,nodiscard,root_owner=1000:1000"}},
	{"ext4", []string{"-J size=4", "-L data_1", "-m 0.5"}},
	{"ext4", []string{"-T small", "-j", "-e remount-ro"}},
	{"ext4", []string{"-e continue"}},
	{"ext4", []string{"-E num_backup_sb=1,quotatype=usrquota:grpquota", "-O sparse_super2,quota"}},
	{"xfs", []string{"-b size=4096"}},
	{"xfs", []string{"-i size=512,maxpct=25", "-n size=8192,ftype=1"}},
	{"xfs", []string{"-m crc=1,reflink=1,finobt=1,bigtime=1,rmapbt=0"}},
	{"xfs", []string{"-l size=64m,lazy-count=1,version=2,su=64k"}},
	{"xfs", []string{"-d su=64k,sw=4,agcount=4", "-s size=4096", "-L data"}},
}

func TestNormalizeMkfsOptionsAccepts(t *testing.T) {
	for _, tt := range mkfsAccepted {
		got, err := NormalizeMkfsOptions(tt.fs, tt.opts)
		if err != nil {
			t.Errorf("%s %q: %v", tt.fs, tt.opts, err)
			continue
		}
		if want := strings.Fields(strings.Join(tt.opts, " ")); !slices.Equal(got, want) {
			t.Errorf("%s %q = %q, want the tokens %q", tt.fs, tt.opts, got, want)
		}
	}
	if got, err := NormalizeMkfsOptions("ext4", []string{" ", ""}); err != nil || got != nil {
		t.Errorf("blank options = %q, %v; want none", got, err)
	}
}

func TestNormalizeMkfsOptionsRefuses(t *testing.T) {
	const u = "11111111-1111-1111-1111-111111111111"
	tests := []struct {
		fs   string
		opts []string
		why  string // in the message
	}{
		// Host paths and devices.
		{"ext4", []string{"-d /etc"}, "copies a host directory"},
		{"ext4", []string{"-l /tmp/badblocks"}, "bad blocks"},
		{"ext4", []string{"-z /tmp/undo"}, "undo file"},
		{"ext4", []string{"-M /mnt"}, "host path"},
		{"ext4", []string{"-J device=/dev/vdb"}, "host path"},
		{"ext4", []string{"-J device=vdb"}, "host device"},
		{"ext4", []string{"-L a/b"}, "host path"},
		{"ext4", []string{"/dev/vda"}, "host path"},
		{"xfs", []string{"-d name=/etc/passwd"}, "host path"},
		{"xfs", []string{"-d name=passwd"}, "host file or device"},
		{"xfs", []string{"-d file=1,name=x"}, "host file"},
		{"xfs", []string{"-l logdev=/tmp/victim,size=64m"}, "host path"},
		{"xfs", []string{"-l logdev=victim,size=64m"}, "host device"},
		{"xfs", []string{"-l internal=0"}, "external log"},
		{"xfs", []string{"-r rtdev=/dev/vdb"}, "realtime device"},
		{"xfs", []string{"-p /etc/proto"}, "protofile"},
		{"xfs", []string{"-c options=/etc/mkfs.conf"}, "config file"},
		// Identity.
		{"ext4", []string{"-U random"}, "UUID"},
		{"ext4", []string{"-Urandom"}, "UUID"},
		{"ext4", []string{"-b4096"}, "write -b 4096"},
		{"ext4", []string{"-U " + u}, "UUID"},
		{"ext4", []string{"-L", "-U"}, "option, not a value"},
		{"xfs", []string{"-m uuid=" + u}, "UUID"},
		{"xfs", []string{"-muuid=" + u}, "UUID"},
		{"xfs", []string{"-m crc=1,uuid=" + u}, "UUID"},
		// No filesystem.
		{"ext4", []string{"-n"}, "dry run"},
		{"ext4", []string{"-S"}, "superblocks only"},
		{"ext4", []string{"-O journal_dev"}, "journal device"},
		{"xfs", []string{"-N"}, "dry run"},
		// Unknown options, operands, bad values.
		{"ext4", []string{"-t ext2"}, "type"},
		{"ext4", []string{"-c"}, "bad blocks"},
		{"ext4", []string{"-E offset=4096"}, "not allowed"},
		{"ext4", []string{"-E android_sparse"}, "not allowed"},
		{"ext4", []string{"-E lazy_itable_init=2"}, "want one of"},
		{"ext4", []string{"-b4096"}, "attached"},
		{"ext4", []string{"-b 3000"}, "power of two"},
		{"ext4", []string{"-b 0x1000"}, "decimal"},
		{"ext4", []string{"-b"}, "needs a value"},
		{"ext4", []string{"-N -1"}, "option, not a value"},
		{"ext4", []string{"-m 51"}, "percentage"},
		{"ext4", []string{"-e panic"}, "must not panic the node"},
		{"ext4", []string{"-e remount-ro", "-e panic"}, "must not panic the node"},
		{"ext4", []string{"-e Panic"}, "want one of continue, remount-ro"},
		{"ext4", []string{"-T small,weird"}, "usage type"},
		{"ext4", []string{"-O frobnicate"}, "not known"},
		{"ext4", []string{"4096"}, "not an option"},
		{"ext4", []string{"--help"}, "long options"},
		{"ext4", []string{"-V"}, "not an allowed option"},
		{"xfs", []string{"-d size=100m"}, "smaller"},
		{"xfs", []string{"-b size=1000"}, "power of two"},
		{"xfs", []string{"-m crc=2"}, "want one of"},
		{"xfs", []string{"-m crc"}, "want one of"},
		{"xfs", []string{"-i size=512,size=256"}, "twice"},
		{"xfs", []string{"-f"}, "given already"},
		{"xfs", []string{"-L 0123456789abc"}, "1 to 12"},
		{"xfs", []string{"-l size=64mm"}, "at most one"},
		// Block volumes take none.
		{"", []string{"-b 4096"}, "block volumes"},
	}
	for _, tt := range tests {
		got, err := NormalizeMkfsOptions(tt.fs, tt.opts)
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("%s %q = %q, %v; want ErrInvalid", tt.fs, tt.opts, got, err)
			continue
		}
		if !strings.Contains(err.Error(), tt.why) {
			t.Errorf("%s %q: %v; want it to say %q", tt.fs, tt.opts, err, tt.why)
		}
	}
}

// TestMkfsAcceptedOptionsMakeOwnFilesystem runs mkfs with every accepted
// option set on a sparse file and proves the result is the volume's own
// filesystem: the allow-list holds nothing mkfs refuses or that changes
// the identity.
func TestMkfsAcceptedOptionsMakeOwnFilesystem(t *testing.T) {
	s := &Store{run: execRunner{}, log: slog.New(slog.DiscardHandler)}
	for i, tt := range mkfsAccepted {
		t.Run(fmt.Sprintf("%s-%d", tt.fs, i), func(t *testing.T) {
			opts, err := NormalizeMkfsOptions(tt.fs, tt.opts)
			if err != nil {
				t.Fatal(err)
			}
			v := &Volume{Name: "v", UUID: NewUUID(), Mode: ModeFilesystem, FSType: tt.fs, MkfsOptions: opts}
			file := filepath.Join(t.TempDir(), v.UUID)
			if err := os.WriteFile(file, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(file, max(MinSize(tt.fs), 64<<20)); err != nil {
				t.Fatal(err)
			}
			prog, args := mkfsCommand(v, file)
			if out, err := exec.Command(prog, args...).CombinedOutput(); err != nil {
				t.Fatalf("%s %q: %v: %s", prog, args, err, out)
			}
			if err := s.CheckFilesystem(context.Background(), v, file); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestMkfsCommandKeepsNodiscard(t *testing.T) {
	u := "7f561330-fb42-440f-83e9-e9f8aa31d2f4"
	tests := []struct {
		v    Volume
		want string
	}{
		{Volume{UUID: u, FSType: "ext4"}, "mkfs.ext4 -q -F -U " + u + " /dev/loop9"},
		{Volume{UUID: u, FSType: "ext4", Preallocate: true}, "mkfs.ext4 -q -F -U " + u + " -E nodiscard /dev/loop9"},
		{Volume{UUID: u, FSType: "ext4", Preallocate: true, MkfsOptions: []string{"-E", "stride=16", "-b", "4096", "-E", "lazy_itable_init=0"}},
			"mkfs.ext4 -q -F -U " + u + " -b 4096 -E stride=16,lazy_itable_init=0,nodiscard /dev/loop9"},
		{Volume{UUID: u, FSType: "xfs", Preallocate: true, MkfsOptions: []string{"-m", "crc=1"}}, "mkfs.xfs -q -f -m uuid=" + u + " -K -m crc=1 /dev/loop9"},
		{Volume{UUID: u, Mode: ModeBlock, Partitioned: true}, "sgdisk --clear --new=1:0:0 --partition-guid=1:" + u + " --typecode=1:8300 --change-name=1:sparsevol /dev/loop9"},
		{Volume{UUID: u, Mode: ModeBlock}, ""},
	}
	for _, tt := range tests {
		prog, args := mkfsCommand(&tt.v, "/dev/loop9")
		if got := strings.TrimSpace(prog + " " + strings.Join(args, " ")); got != tt.want {
			t.Errorf("mkfsCommand(%+v) = %s, want %s", tt.v, got, tt.want)
		}
	}
}

func TestMkfsFileCommand(t *testing.T) {
	u := "7f561330-fb42-440f-83e9-e9f8aa31d2f4"
	fs := func(fsType string, opts ...string) Volume {
		return Volume{UUID: u, Mode: ModeFilesystem, FSType: fsType, BlockSize: FilesystemBlockSize, MkfsOptions: opts}
	}
	old := fs("ext4")
	old.BlockSize = 0 // made before volumes recorded it
	tests := []struct {
		v    Volume
		want string // "" for: on the device
	}{
		{fs("ext4"), "mkfs.ext4 -q -F -U " + u + " -b 4096 /f"},
		{fs("ext4", "-E", "stride=16"), "mkfs.ext4 -q -F -U " + u + " -E stride=16 -b 4096 /f"},
		{fs("ext4", "-b", "1024"), ""},
		{fs("xfs"), "mkfs.xfs -q -f -m uuid=" + u + " -s size=4096 /f"},
		{fs("xfs", "-b", "size=4096"), "mkfs.xfs -q -f -m uuid=" + u + " -b size=4096 -s size=4096 /f"},
		{fs("xfs", "-s", "size=512"), ""},
		{old, ""},
		{Volume{UUID: u, Mode: ModeBlock, Partitioned: true, BlockSize: FilesystemBlockSize}, ""},
	}
	for _, tt := range tests {
		prog, args, ok := mkfsFileCommand(&tt.v, "/f")
		got := strings.TrimSpace(prog + " " + strings.Join(args, " "))
		if ok != (tt.want != "") || got != tt.want && ok {
			t.Errorf("mkfsFileCommand(%+v) = %q, %t; want %q", tt.v, got, ok, tt.want)
		}
	}
}
