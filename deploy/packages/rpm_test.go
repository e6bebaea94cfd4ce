package packages_test

import (
	"bytes"
	"encoding/binary"
	"io/fs"
	"os"
	"strings"
	"testing"
)

// A minimal reader of an RPM's main header (the format of rpm's
// lib/header.c): enough to list the files and read the scripts without
// rpm(8), which Debian hosts lack.

// Header tags used here.
const (
	tagName        = 1000
	tagVersion     = 1001
	tagRelease     = 1002
	tagPreIn       = 1023
	tagPostIn      = 1024
	tagPreUn       = 1025
	tagPostUn      = 1026
	tagFileSizes   = 1028
	tagFileModes   = 1030
	tagFileMtimes  = 1034
	tagFileDigests = 1035
	tagFileLinkTos = 1036
	tagFileUser    = 1039
	tagFileGroup   = 1040
	tagRequireName = 1049
	tagDirIndexes  = 1116
	tagBaseNames   = 1117
	tagDirNames    = 1118
)

// Value types.
const (
	typeInt16       = 3
	typeInt32       = 4
	typeString      = 6
	typeStringArray = 8
	typeI18NString  = 9
)

type rpmHeader map[int]any // tag -> string, []string, []int64

func (h rpmHeader) str(tag int) string {
	switch v := h[tag].(type) {
	case string:
		return v
	case []string:
		if len(v) > 0 {
			return v[0]
		}
	}
	return ""
}

func (h rpmHeader) strs(tag int) []string {
	if v, ok := h[tag].([]string); ok {
		return v
	}
	if s, ok := h[tag].(string); ok {
		return []string{s}
	}
	return nil
}

func (h rpmHeader) ints(tag int) []int64 {
	v, _ := h[tag].([]int64)
	return v
}

// readRPM reads the main header: after the 96-byte lead, the signature
// header (padded to 8 bytes), then the main header.
func readRPM(t *testing.T, path string) rpmHeader {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) < 96 || !bytes.Equal(b[:4], []byte{0xed, 0xab, 0xee, 0xdb}) {
		t.Fatalf("%s: not an rpm (lead)", path)
	}
	off := 96
	_, n := parseHeader(t, b[off:])
	off += (n + 7) &^ 7
	h, _ := parseHeader(t, b[off:])
	return h
}

// parseHeader parses one header structure and returns it and its length.
func parseHeader(t *testing.T, b []byte) (rpmHeader, int) {
	t.Helper()
	if len(b) < 16 || !bytes.Equal(b[:3], []byte{0x8e, 0xad, 0xe8}) {
		t.Fatal("rpm: bad header magic")
	}
	nindex := int(binary.BigEndian.Uint32(b[8:]))
	hsize := int(binary.BigEndian.Uint32(b[12:]))
	store := 16 + 16*nindex
	if len(b) < store+hsize {
		t.Fatal("rpm: header truncated")
	}
	data := b[store : store+hsize]
	h := rpmHeader{}
	for i := range nindex {
		e := b[16+16*i:]
		tag := int(binary.BigEndian.Uint32(e))
		typ := binary.BigEndian.Uint32(e[4:])
		off := int(binary.BigEndian.Uint32(e[8:]))
		count := int(binary.BigEndian.Uint32(e[12:]))
		switch typ {
		case typeString, typeStringArray, typeI18NString:
			var ss []string
			for range count {
				end := bytes.IndexByte(data[off:], 0)
				ss = append(ss, string(data[off:off+end]))
				off += end + 1
			}
			if typ == typeString {
				h[tag] = ss[0]
			} else {
				h[tag] = ss
			}
		case typeInt16, typeInt32:
			size := map[uint32]int{typeInt16: 2, typeInt32: 4}[typ]
			v := make([]int64, count)
			for j := range v {
				p := data[off+size*j:]
				if size == 2 {
					v[j] = int64(binary.BigEndian.Uint16(p))
				} else {
					v[j] = int64(binary.BigEndian.Uint32(p))
				}
			}
			h[tag] = v
		}
	}
	return h, store + hsize
}

// rpmContents lists the rpm's files as entries (no bytes: sum and size).
func rpmContents(t *testing.T, path string) map[string]entry {
	t.Helper()
	h := readRPM(t, path)
	dirs, names, idx := h.strs(tagDirNames), h.strs(tagBaseNames), h.ints(tagDirIndexes)
	modes, mtimes, sizes := h.ints(tagFileModes), h.ints(tagFileMtimes), h.ints(tagFileSizes)
	links, digests, users, groups := h.strs(tagFileLinkTos), h.strs(tagFileDigests), h.strs(tagFileUser), h.strs(tagFileGroup)
	if len(idx) != len(names) || len(modes) != len(names) || len(links) != len(names) || len(digests) != len(names) {
		t.Fatalf("rpm file tags disagree: %d names, %d indexes, %d modes, %d links, %d digests", len(names), len(idx), len(modes), len(links), len(digests))
	}
	got := map[string]entry{}
	for i, name := range names {
		p := strings.TrimSuffix(dirs[idx[i]], "/") + "/" + name
		m := uint32(modes[i])
		mode := fs.FileMode(m & 0o777)
		switch m & 0o170000 {
		case 0o040000:
			mode |= fs.ModeDir
		case 0o120000:
			mode |= fs.ModeSymlink
		case 0o100000:
		default:
			t.Errorf("rpm: %s has file type %o", p, m&0o170000)
		}
		e := entry{mode: mode, owner: users[i] + ":" + groups[i], link: links[i], mtime: mtimes[i], size: sizes[i]}
		if mode.IsRegular() {
			e.sum = digests[i]
		} else {
			e.size = 0 // a link's size is its target's length in an rpm, 0 in a tar
		}
		got[p] = e
	}
	return got
}
