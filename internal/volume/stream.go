package volume

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
	"time"
)

// The sparse stream of export and import: a volume's data extents with
// their offsets, never its holes.
//
//	magic    "SPARSEVOL-STREAM" (16 bytes)
//	version  uint32, big endian: 1 or 2 (streamVersion, written)
//	length   uint32: of the header, at most maxHeader bytes
//	header   JSON (StreamHeader), exactly length bytes
//	records, each a type byte:
//	  'D' offset uint64, length uint32 (1..maxExtent), length bytes of data
//	  'E' extents uint64, data bytes uint64, then the checksum of every
//	      byte before it (magic to these counts): the end; nothing follows.
//
// The checksum is CRC-32C, big endian, in version 2 and SHA-256 in
// version 1 (still read: streams kept as backups). It detects damage, not
// forgery (anyone who alters a stream can compute either), and CRC-32C
// costs a fraction of SHA-256 on each side of the pipe.
//
// Extents come in ascending order and do not overlap; each lies within
// the header's size. The reader checks each rule as the bytes arrive and
// the checksum at the end: the importer writes into a file nobody sees
// and makes a volume of it only after the whole stream passed.

const (
	streamMagic   = "SPARSEVOL-STREAM"
	streamVersion = 2
	maxHeader     = 64 << 10
	// maxExtent bounds one data record: what the reader buffers at most.
	maxExtent = 1 << 20
)

// StreamHeader describes the volume a stream holds.
type StreamHeader struct {
	Name        string    `json:"name"`
	UUID        string    `json:"uuid"`
	SizeBytes   int64     `json:"sizeBytes"`
	Mode        Mode      `json:"mode"`
	FSType      string    `json:"fsType,omitempty"`
	Partitioned bool      `json:"partitioned,omitempty"`
	BlockSize   uint32    `json:"blockSize,omitempty"`
	Snapshot    string    `json:"snapshot,omitempty"` // the snapshot's name, if one was exported
	CreatedAt   time.Time `json:"createdAt"`
}

// streamSum returns the checksum of a stream of the given version; false
// for a version this sparsevol does not read.
func streamSum(version uint32) (hash.Hash, bool) {
	switch version {
	case 1:
		return sha256.New(), true
	case 2:
		return crc32.New(castagnoli()), true
	}
	return nil, false
}

// check applies the rules a header must meet before anything is written:
// checkLayout's, a size a store makes (sizeMade), a canonical UUID and a
// valid name.
func (h *StreamHeader) check() error {
	if err := checkLayout(h.Mode, h.FSType, h.Partitioned, h.SizeBytes, h.BlockSize, sizeMade); err != nil {
		return err
	}
	if !ValidUUID(h.UUID) || h.UUID == nilUUID {
		return fmt.Errorf("uuid %s is not a canonical UUID", Quote(h.UUID))
	}
	return ValidateName(h.Name)
}

// sizeRule says which sizes checkLayout admits.
type sizeRule int

const (
	// sizeMade: a size a store makes (Create, Expand, Import): a positive
	// whole number of MiB up to maxSize, at least MinSize of the
	// filesystem.
	sizeMade sizeRule = iota
	// sizeKept: a size a record may hold: also an adopted file's (a
	// multiple of 512 bytes from 1 MiB, see Adopt), which copies of the
	// volume and its snapshots keep.
	sizeKept
)

// checkLayout applies the rules every description of a volume meets (a
// stream header, a volume's record, a snapshot's record): mode filesystem
// with ext4 or xfs and no partition table, or mode block with no
// filesystem; a size as rule says; a block size of 512, 1024, 2048 or
// 4096, or 0 where none was recorded. The error names the first rule
// broken and carries no error class: each caller gives its own.
func checkLayout(mode Mode, fsType string, partitioned bool, size int64, blockSize uint32, rule sizeRule) error {
	switch {
	case mode != ModeFilesystem && mode != ModeBlock:
		return fmt.Errorf("mode %s is not filesystem or block", Quote(string(mode)))
	case mode == ModeFilesystem && fsType != "ext4" && fsType != "xfs":
		return fmt.Errorf("filesystem %s is not ext4 or xfs", Quote(fsType))
	case mode == ModeBlock && fsType != "":
		return fmt.Errorf("a block volume with filesystem %s", Quote(fsType))
	case mode == ModeFilesystem && partitioned:
		return errors.New("a partitioned filesystem volume")
	case rule == sizeMade && (size <= 0 || size > maxSize || size%MiB != 0):
		return fmt.Errorf("size %d is not a positive whole number of MiB up to %s", size, FormatSize(maxSize+1))
	case rule == sizeMade && size < MinSize(fsType):
		return fmt.Errorf("size %s is below the minimum for %s", FormatSize(size), kindName(fsType))
	case rule == sizeKept && (size < MiB || size > maxSize || size%512 != 0):
		return fmt.Errorf("size %d is not a multiple of 512 bytes from 1Mi up to %s", size, FormatSize(maxSize+1))
	case blockSize != 0 && blockSize != 512 && blockSize != 1024 && blockSize != 2048 && blockSize != 4096:
		return fmt.Errorf("block size %d is not 512, 1024, 2048 or 4096", blockSize)
	}
	return nil
}

// streamWriter writes a stream; the caller checks the header first.
type streamWriter struct {
	w              *bufio.Writer
	sum            hash.Hash
	extents, bytes uint64
	end            int64 // where the last extent ended
	size           int64
}

func newStreamWriter(w io.Writer, h *StreamHeader) (*streamWriter, error) {
	return newStreamWriterVersion(w, h, streamVersion)
}

// newStreamWriterVersion writes a stream of the given version (the tests
// write version 1, as older sparsevols did).
func newStreamWriterVersion(w io.Writer, h *StreamHeader, version uint32) (*streamWriter, error) {
	sum, ok := streamSum(version)
	if !ok {
		return nil, fmt.Errorf("stream version %d", version)
	}
	hdr, err := json.Marshal(h)
	if err != nil {
		return nil, err
	}
	sw := &streamWriter{sum: sum, size: h.SizeBytes}
	sw.w = bufio.NewWriterSize(io.MultiWriter(w, sw.sum), 1<<20)
	var pre [24]byte
	copy(pre[:], streamMagic)
	binary.BigEndian.PutUint32(pre[16:], version)
	binary.BigEndian.PutUint32(pre[20:], uint32(len(hdr)))
	sw.w.Write(pre[:])
	_, err = sw.w.Write(hdr)
	return sw, err
}

// extent writes data found at off (ascending, at most maxExtent bytes).
func (sw *streamWriter) extent(off int64, data []byte) error {
	if off < sw.end || len(data) == 0 || len(data) > maxExtent || off+int64(len(data)) > sw.size {
		return fmt.Errorf("extent %d+%d out of order or bounds", off, len(data))
	}
	var rec [13]byte
	rec[0] = 'D'
	binary.BigEndian.PutUint64(rec[1:], uint64(off))
	binary.BigEndian.PutUint32(rec[9:], uint32(len(data)))
	sw.w.Write(rec[:])
	if _, err := sw.w.Write(data); err != nil {
		return err
	}
	sw.extents++
	sw.bytes += uint64(len(data))
	sw.end = off + int64(len(data))
	return nil
}

// close writes the end record and flushes.
func (sw *streamWriter) close() error {
	var rec [17]byte
	rec[0] = 'E'
	binary.BigEndian.PutUint64(rec[1:], sw.extents)
	binary.BigEndian.PutUint64(rec[9:], sw.bytes)
	if _, err := sw.w.Write(rec[:]); err != nil {
		return err
	}
	if err := sw.w.Flush(); err != nil { // the sum now covers every byte before it
		return err
	}
	_, err := sw.w.Write(sw.sum.Sum(nil))
	if err == nil {
		err = sw.w.Flush()
	}
	return err
}

// errStream marks a stream that breaks the format; it is an ErrInvalid.
var errStream = fmt.Errorf("not a valid sparsevol stream: %w", ErrInvalid)

// readStream reads a whole stream from r: header (checked, then given to
// onHeader, which may refuse it), then each data extent to onExtent (data
// is reused after the call), then the end record, the checksum and the end
// of input. Every rule is checked; a broken rule is errStream, naming it.
// Nothing is trusted before the checksum matched, so the caller keeps what
// it wrote invisible until readStream returns nil.
func readStream(r io.Reader, onHeader func(*StreamHeader) error, onExtent func(off int64, data []byte) error) (*StreamHeader, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), errStream)
	}
	var pre [24]byte
	if _, err := io.ReadFull(br, pre[:]); err != nil {
		return nil, bad("reading the start: %v", err)
	}
	if string(pre[:16]) != streamMagic {
		return nil, bad("no %s magic at the start", streamMagic)
	}
	version := binary.BigEndian.Uint32(pre[16:])
	sum, ok := streamSum(version)
	if !ok {
		return nil, bad("version %d, this sparsevol reads versions 1 to %d", version, streamVersion)
	}
	sum.Write(pre[:])
	in := io.TeeReader(br, sum)
	n := binary.BigEndian.Uint32(pre[20:])
	if n == 0 || n > maxHeader {
		return nil, bad("header of %d bytes (at most %d)", n, maxHeader)
	}
	raw := make([]byte, n)
	if _, err := io.ReadFull(in, raw); err != nil {
		return nil, bad("reading the header: %v", err)
	}
	var h StreamHeader
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil {
		return nil, bad("header: %s", Quote(err.Error()))
	}
	if dec.More() {
		return nil, bad("header: data after the JSON object")
	}
	if err := h.check(); err != nil {
		return nil, bad("header: %v", err)
	}
	if onHeader != nil {
		if err := onHeader(&h); err != nil {
			return nil, err
		}
	}
	var buf []byte // grown to the largest extent seen, at most maxExtent
	var extents, total uint64
	var end int64
	for {
		var typ [1]byte
		if _, err := io.ReadFull(in, typ[:]); err != nil {
			return nil, bad("reading record %d: %v (the stream ends early)", extents+1, err)
		}
		switch typ[0] {
		case 'D':
			var rec [12]byte
			if _, err := io.ReadFull(in, rec[:]); err != nil {
				return nil, bad("reading extent %d: %v", extents+1, err)
			}
			off := binary.BigEndian.Uint64(rec[:])
			length := binary.BigEndian.Uint32(rec[8:])
			switch {
			case length == 0 || length > maxExtent:
				return nil, bad("extent %d has %d bytes (1 to %d)", extents+1, length, maxExtent)
			case off > uint64(h.SizeBytes) || uint64(length) > uint64(h.SizeBytes)-off:
				return nil, bad("extent %d at %d+%d lies beyond the size %d", extents+1, off, length, h.SizeBytes)
			case int64(off) < end:
				return nil, bad("extent %d at %d overlaps or precedes the one ending at %d", extents+1, off, end)
			}
			if len(buf) < int(length) {
				buf = make([]byte, length)
			}
			data := buf[:length]
			if _, err := io.ReadFull(in, data); err != nil {
				return nil, bad("reading extent %d: %v", extents+1, err)
			}
			if err := onExtent(int64(off), data); err != nil {
				return nil, err
			}
			extents++
			total += uint64(length)
			end = int64(off) + int64(length)
		case 'E':
			var rec [16]byte
			if _, err := io.ReadFull(in, rec[:]); err != nil {
				return nil, bad("reading the end: %v", err)
			}
			want := sum.Sum(nil) // of everything up to here
			got := make([]byte, len(want))
			if _, err := io.ReadFull(br, got); err != nil {
				return nil, bad("reading the checksum: %v", err)
			}
			if e, b := binary.BigEndian.Uint64(rec[:]), binary.BigEndian.Uint64(rec[8:]); e != extents || b != total {
				return nil, bad("the end counts %d extents of %d bytes, the stream held %d of %d", e, b, extents, total)
			}
			if !bytes.Equal(got, want) {
				return nil, bad("checksum mismatch: the stream was damaged or altered")
			}
			if _, err := br.ReadByte(); err != io.EOF {
				return nil, bad("data after the end")
			}
			return &h, nil
		default:
			return nil, bad("record %d has unknown type 0x%02x", extents+1, typ[0])
		}
	}
}
