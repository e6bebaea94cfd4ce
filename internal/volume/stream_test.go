package volume

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReadStream: a stream of either version reads back as written; each
// broken rule is refused with ErrInvalid.
func TestReadStream(t *testing.T) {
	for _, version := range []uint32{1, 2} {
		var got []int64
		h, err := readStream(bytes.NewReader(validStreamVersion(t, version)), nil, func(off int64, data []byte) error {
			got = append(got, off, int64(len(data)), int64(data[0]))
			return nil
		})
		if err != nil || h.SizeBytes != 4<<20 || len(got) != 6 || got[0] != 4096 || got[1] != 512 || got[2] != 1 || got[3] != 1<<20 || got[4] != 4096 || got[5] != 2 {
			t.Fatalf("version %d: readStream = %+v, %v, extents %v", version, h, err, got)
		}
	}
	good := validStream(t)
	v1 := validStreamVersion(t, 1)
	if len(v1) != len(good)+28 {
		t.Fatalf("version 1 stream of %d bytes, version 2 of %d: want SHA-256 against CRC-32C", len(v1), len(good))
	}
	flip := func(b []byte, i int) []byte {
		b = bytes.Clone(b)
		b[i] ^= 0x10
		return b
	}
	version := func(b []byte, v byte) []byte {
		b = bytes.Clone(b)
		b[19] = v
		return b
	}
	hdrEnd := 24 + int(good[23]) // header length < 256 here
	rec := func(off, length uint64) []byte {
		b := []byte{'D'}
		for i := 7; i >= 0; i-- {
			b = append(b, byte(off>>(8*i)))
		}
		for i := 3; i >= 0; i-- {
			b = append(b, byte(length>>(8*i)))
		}
		return append(b, make([]byte, length)...)
	}
	withRecords := func(recs ...[]byte) []byte {
		return append(bytes.Clone(good[:hdrEnd]), bytes.Join(recs, nil)...)
	}
	tests := map[string][]byte{
		"overlap":       withRecords(rec(0, 4096), rec(2048, 10)),
		"backwards":     withRecords(rec(8192, 10), rec(0, 10)),
		"beyond size":   withRecords(rec(4<<20-10, 11)),
		"offset wraps":  withRecords(rec(^uint64(0)-5, 10)),
		"zero length":   withRecords(rec(0, 0)),
		"no end record": withRecords(rec(0, 10)),
		"data damaged":  flip(good, len(good)-30),
		"sum damaged":   flip(good, len(good)-1),
		"v1 damaged":    flip(v1, len(v1)-60),
		"v1 as v2":      version(v1, 2),
		"v2 as v1":      version(good, 1),
		"version 0":     version(good, 0),
		"version 3":     version(good, 3),
		"cut in sum":    good[:len(good)-2],
		"data after":    append(bytes.Clone(good), 0),
	}
	for name, in := range tests {
		if _, err := readStream(bytes.NewReader(in), nil, func(int64, []byte) error { return nil }); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
}

// TestAllZero: chunks of zeroes are told from chunks with any other byte,
// wherever it is, also beyond the comparison buffer's length.
func TestAllZero(t *testing.T) {
	for _, n := range []int{0, 1, 4096, len(zeros), len(zeros) + 1, 3*len(zeros) + 7} {
		b := make([]byte, n)
		if !allZero(b) {
			t.Errorf("%d zero bytes: not all zero", n)
		}
		for _, i := range []int{0, n / 2, n - 1} {
			if n == 0 {
				continue
			}
			b[i] = 1
			if allZero(b) {
				t.Errorf("%d bytes with byte %d set: all zero", n, i)
			}
			b[i] = 0
		}
	}
}

// TestImportKeepUUIDChecksContent: import --keep-uuid keeps what the
// stream holds only where it carries the UUID its header names (which
// uuidFree found unused). A partitioned stream whose header was given a
// fresh UUID but whose partition still has an existing volume's GUID
// would share that volume's /dev/disk/by-partuuid link: it is refused,
// and nothing is left.
func TestImportKeepUUIDChecksContent(t *testing.T) {
	s := newStore(t, Options{})
	ctx := context.Background()
	p := mustCreate(t, s, CreateRequest{Name: "p", SizeBytes: 8 << 20, Mode: ModeBlock})
	if !p.Partitioned {
		t.Fatalf("volume %+v is not partitioned", p)
	}
	var exported bytes.Buffer
	if _, err := s.Export(ctx, "p", &exported, StreamOptions{}); err != nil {
		t.Fatal(err)
	}
	// The same content under another header UUID, checksummed anew.
	forged := reheader(t, &exported, func(h *StreamHeader) { h.UUID = NewUUID() })
	before, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	v, err := s.Import(ctx, forged, ImportRequest{Name: "q", KeepUUID: true})
	if !errors.Is(err, ErrMismatch) {
		t.Fatalf("import keeping a header UUID its partition does not carry = %+v, %v; want ErrMismatch", v, err)
	}
	if after, err := s.List(); err != nil || len(after) != len(before) {
		t.Fatalf("volumes after the refused import: %d (%v), want %d", len(after), err, len(before))
	}
}

// TestImportOtherFilesystemThanHeader: a stream whose header names ext4
// but whose content is XFS is refused as ErrMismatch, with an error that
// says what the content holds; nothing is left.
func TestImportOtherFilesystemThanHeader(t *testing.T) {
	s := newStore(t, Options{})
	ctx := context.Background()
	mustCreate(t, s, CreateRequest{Name: "x", SizeBytes: 320 << 20, FSType: "xfs"})
	var exported bytes.Buffer
	if _, err := s.Export(ctx, "x", &exported, StreamOptions{}); err != nil {
		t.Fatal(err)
	}
	forged := reheader(t, &exported, func(h *StreamHeader) { h.FSType = "ext4" })
	before, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	v, err := s.Import(ctx, forged, ImportRequest{Name: "y"})
	if !errors.Is(err, ErrMismatch) || !strings.Contains(fmt.Sprint(err), "holds xfs") {
		t.Fatalf("import of XFS content under an ext4 header = %+v, %v; want ErrMismatch naming xfs", v, err)
	}
	if after, err := s.List(); err != nil || len(after) != len(before) {
		t.Fatalf("volumes after the refused import: %d (%v), want %d", len(after), err, len(before))
	}
}

// reheader returns the stream r with its header changed by edit and its
// content as it was, checksummed anew: a stream forged by someone who
// knows the format.
func reheader(t *testing.T, r io.Reader, edit func(*StreamHeader)) *bytes.Buffer {
	t.Helper()
	var out bytes.Buffer
	var sw *streamWriter
	_, err := readStream(r, func(h *StreamHeader) error {
		edit(h)
		var err error
		sw, err = newStreamWriter(&out, h)
		return err
	}, func(off int64, data []byte) error { return sw.extent(off, data) })
	if err == nil {
		err = sw.close()
	}
	if err != nil {
		t.Fatal(err)
	}
	return &out
}

// TestReadStreamRefusalShowsHeaderBounded: a header's values that are
// refused reach the error only through Quote: no control character, and
// never whole.
func TestReadStreamRefusalShowsHeaderBounded(t *testing.T) {
	hostile := "x\n\x1b[31m" + strings.Repeat("a", 5000)
	q := func(s string) string {
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	ok := `"name":"v","sizeBytes":4194304,"createdAt":"2020-01-01T00:00:00Z"`
	tests := map[string]string{
		"unknown field": `{` + q(hostile) + `:1,` + ok + `}`,
		"mode":          `{"mode":` + q(hostile) + `,"uuid":"11111111-1111-1111-1111-111111111111",` + ok + `}`,
		"fs type":       `{"mode":"filesystem","fsType":` + q(hostile) + `,"uuid":"11111111-1111-1111-1111-111111111111",` + ok + `}`,
		"block fs type": `{"mode":"block","fsType":` + q(hostile) + `,"uuid":"11111111-1111-1111-1111-111111111111",` + ok + `}`,
		"uuid":          `{"mode":"filesystem","fsType":"ext4","uuid":` + q(hostile) + `,` + ok + `}`,
		"number":        `{"sizeBytes":1` + strings.Repeat("0", 5000) + `}`,
	}
	for name, header := range tests {
		t.Run(name, func(t *testing.T) {
			in := []byte(streamMagic)
			in = binary.BigEndian.AppendUint32(in, streamVersion)
			in = binary.BigEndian.AppendUint32(in, uint32(len(header)))
			in = append(in, header...)
			_, err := readStream(bytes.NewReader(in), nil, func(int64, []byte) error { return nil })
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("readStream = %v, want ErrInvalid", err)
			}
			if msg := err.Error(); strings.ContainsAny(msg, "\n\x1b") || len(msg) > 512 {
				t.Fatalf("error of %d bytes shows the header's value raw or whole: %.300q", len(msg), msg)
			}
		})
	}
}

// TestImportProvesContentFirst: an import whose content is not what its
// header claims (a filesystem whose superblock claims more than the
// stream's size, other content than the header's layout) is refused as
// ErrMismatch before e2fsck, a mount or sgdisk sees it, with its UUID
// kept or not, and nothing is left.
func TestImportProvesContentFirst(t *testing.T) {
	ctx := context.Background()
	uuid := "0b9d5a10-8c5e-4a57-b1a3-7f3e9c2d4e62"
	tests := []struct {
		name     string
		header   StreamHeader
		imgSize  int64 // the image made, then cut to header.SizeBytes
		mkfs     []string
		keepUUID bool
		want     string
	}{
		{"ext4 larger than the stream", StreamHeader{SizeBytes: 64 << 20, Mode: ModeFilesystem, FSType: "ext4"}, 128 << 20, []string{"mkfs.ext4", "-q", "-F", "-U", uuid}, false, "claims 128Mi"},
		{"ext4 larger than the stream, uuid kept", StreamHeader{SizeBytes: 64 << 20, Mode: ModeFilesystem, FSType: "ext4"}, 128 << 20, []string{"mkfs.ext4", "-q", "-F", "-U", uuid}, true, "claims 128Mi"},
		{"xfs larger than the stream", StreamHeader{SizeBytes: 320 << 20, Mode: ModeFilesystem, FSType: "xfs"}, 640 << 20, []string{"mkfs.xfs", "-q", "-f", "-m", "uuid=" + uuid}, false, "claims 640Mi"},
		{"xfs larger than the stream, uuid kept", StreamHeader{SizeBytes: 320 << 20, Mode: ModeFilesystem, FSType: "xfs"}, 640 << 20, []string{"mkfs.xfs", "-q", "-f", "-m", "uuid=" + uuid}, true, "claims 640Mi"},
		{"partitioned, holding ext4", StreamHeader{SizeBytes: 64 << 20, Mode: ModeBlock, Partitioned: true}, 64 << 20, []string{"mkfs.ext4", "-q", "-F", "-U", uuid}, false, "holds ext4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t, Options{})
			img := filepath.Join(t.TempDir(), "img")
			if err := os.WriteFile(img, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(img, tt.imgSize); err != nil {
				t.Fatal(err)
			}
			run(t, tt.mkfs[0], append(tt.mkfs[1:], img)...)
			if err := os.Truncate(img, tt.header.SizeBytes); err != nil {
				t.Fatal(err)
			}
			h := tt.header
			h.Name, h.UUID = "v", uuid
			v, err := s.Import(ctx, streamOfImage(t, img, &h), ImportRequest{Name: "forged", KeepUUID: tt.keepUUID})
			if !errors.Is(err, ErrMismatch) || !strings.Contains(fmt.Sprint(err), tt.want) {
				t.Errorf("import = %+v, %v; want ErrMismatch saying %q", v != nil, err, tt.want)
			}
			if after, err := s.List(); err != nil || len(after) != 0 {
				t.Errorf("volumes after the refused import: %d (%v), want none", len(after), err)
			}
			if files, _ := os.ReadDir(s.root); len(files) > 1 { // the lock directory
				t.Errorf("files left in the store: %v", files)
			}
		})
	}
}

// streamOfImage returns the stream of the image file at path under the
// header h: a stream forged from content someone made.
func streamOfImage(t *testing.T, path string, h *StreamHeader) *bytes.Buffer {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b bytes.Buffer
	if err := writeFile(context.Background(), &b, h, int(f.Fd()), nil, nil); err != nil {
		t.Fatal(err)
	}
	return &b
}

// TestImportSizeBeyondFileLimit: a stream whose size passes the
// overcommit policy but is beyond the largest file the store's
// filesystem holds (ext4: 16 TiB) is refused as ErrInvalid, naming the
// size, and nothing is left.
func TestImportSizeBeyondFileLimit(t *testing.T) {
	// ext4 holds no file of 16 TiB or more (4 KiB blocks); the host's
	// filesystem may not be ext4.
	s := smallStore(t, "ext4", 64<<20, Options{OvercommitRatio: 1e9})
	h := &StreamHeader{Name: "v", UUID: "0b9d5a10-8c5e-4a57-b1a3-7f3e9c2d4e63", SizeBytes: 32 << 40, Mode: ModeBlock}
	var b bytes.Buffer
	sw, err := newStreamWriter(&b, h)
	if err == nil {
		err = sw.close()
	}
	if err != nil {
		t.Fatal(err)
	}
	v, err := s.Import(context.Background(), &b, ImportRequest{Name: "huge"})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(fmt.Sprint(err), "32Ti") {
		t.Fatalf("import of a 32 TiB stream = %+v, %v; want ErrInvalid naming 32Ti", v != nil, err)
	}
	if files, _ := os.ReadDir(s.root); len(files) > 1 { // the lock directory
		t.Errorf("files left in the store: %v", files)
	}
}
