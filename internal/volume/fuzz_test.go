package volume

import (
	"bytes"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// sizeGrammar is ParseSize's documented grammar, written out by hand so the
// fuzzer checks the regular expression against an independent reading:
// digits, optionally '.' and digits, optionally one of KMGTP (either case)
// and an 'i', optionally 'B' or 'b'.
func sizeGrammar(s string) bool {
	i := 0
	digits := func() bool {
		start := i
		for i < len(s) && '0' <= s[i] && s[i] <= '9' {
			i++
		}
		return i > start
	}
	if !digits() {
		return false
	}
	if i < len(s) && s[i] == '.' {
		i++
		if !digits() {
			return false
		}
	}
	if i < len(s) && strings.IndexByte("KMGTPkmgtp", s[i]) >= 0 {
		i++
		if i < len(s) && s[i] == 'i' {
			i++
		}
	}
	if i < len(s) && (s[i] == 'B' || s[i] == 'b') {
		i++
	}
	return i == len(s)
}

func FuzzParseSize(f *testing.F) {
	for _, s := range []string{
		"1", "8M", "64MiB", "1.5G", "2Gi", "1T", "4PiB", "512B", "0.0000001",
		"10iB", "1_000_000_000", "1e3", "0x10", "+8M", "-1G", " 8M", "8M ",
		"NaN", "Inf", "1e400", "99999999P", "4096P", "0", "0.0", ".5", "1.",
		"٣M", "８M", "8\x00M", "8MiBB", "8Bi", "",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := ParseSize(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseSize(%q) error %v is not ErrInvalid", s, err)
			}
			if n != 0 {
				t.Fatalf("ParseSize(%q) = %d with an error", s, n)
			}
			return
		}
		if !sizeGrammar(s) {
			t.Fatalf("ParseSize(%q) = %d, but the input is outside the grammar", s, n)
		}
		if n <= 0 || n > maxSize || RoundUpMiB(n) < n {
			t.Fatalf("ParseSize(%q) = %d, not a positive size that rounds to a MiB", s, n)
		}
		// Plain digits are bytes, exactly.
		if b, err := strconv.ParseInt(s, 10, 64); err == nil && b != n {
			t.Fatalf("ParseSize(%q) = %d, want %d", s, n, b)
		}
	})
}

func FuzzValidateName(f *testing.F) {
	for _, s := range []string{
		"data", "prometheus-0", "a.b_c", "", "-x", ".hidden", "..", "a..b", "a/b",
		"a b", "a\u202eb", "a\u00a0b", "a\x00b", "tab\there", "é", "name\xff",
		"7f561330-fb42-440f-83e9-e9f8aa31d2f4", "7F561330-FB42-440F-83E9-E9F8AA31D2F4",
		"00000000-0000-0000-0000-000000000000", "7f561330fb42440f83e9e9f8aa31d2f4",
		strings.Repeat("a", 253), strings.Repeat("a", 254), strings.Repeat("é", 127),
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		err := ValidateName(name)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ValidateName(%q) error %v is not ErrInvalid", name, err)
			}
			return
		}
		if len(name) == 0 || len(name) > MaxNameLength {
			t.Fatalf("ValidateName accepted %q of length %d", name, len(name))
		}
		if name[0] == '-' || name[0] == '.' || strings.Contains(name, "..") {
			t.Fatalf("ValidateName accepted %q", name)
		}
		for _, r := range name {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
				t.Fatalf("ValidateName accepted %q with %U", name, r)
			}
		}
		if ValidUUID(strings.ToLower(name)) {
			t.Fatalf("ValidateName accepted the UUID-shaped %q", name)
		}
	})
}

func FuzzMkfsOptions(f *testing.F) {
	for _, tt := range mkfsAccepted {
		f.Add(tt.fs == "xfs", strings.Join(tt.opts, " "))
	}
	for _, s := range []string{
		"-d /etc", "-d etc", "-l logdev=/tmp/x,size=64m", "-l logdev=x", "-r rtdev=x",
		"-p proto", "-c options=x", "-U random", "-Urandom", "-muuid=x", "-m uuid=x",
		"-m crc=1,uuid=x", "-n", "-N", "-S", "-O journal_dev", "-J device=x",
		"-E offset=1", "-d name=x", "-d file=1", "-l internal=0", "-L -U", "-b4096",
		"-b 4096 /dev/sda", "4096", "--", "-", "-E root_owner=0:0,,nodiscard",
		"-E nodiscard=1", "-m 50.0001", "-i size=512,size=512", "-l size=64m\x00",
		"-L\u00a0x", "-b\t4096",
	} {
		f.Add(false, s)
		f.Add(true, s)
	}
	identity := []string{"uuid", "logdev", "rtdev", "name=", "file=", "device", "journal_dev", "offset"}
	f.Fuzz(func(t *testing.T, xfs bool, s string) {
		fsType := "ext4"
		if xfs {
			fsType = "xfs"
		}
		got, err := NormalizeMkfsOptions(fsType, []string{s})
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("%s %q: error %v is not ErrInvalid", fsType, s, err)
			}
			return
		}
		if want := strings.Fields(s); !slices.Equal(got, want) && !(len(got) == 0 && len(want) == 0) {
			t.Fatalf("%s %q = %q, want its tokens", fsType, s, got)
		}
		for i, tok := range got {
			if strings.ContainsRune(tok, '/') {
				t.Fatalf("%s %q: accepted %q, which names a path", fsType, s, tok)
			}
			// A label is free text: "-L uuid" names nothing.
			label := i > 0 && got[i-1] == "-L"
			for _, word := range identity {
				if !label && strings.Contains(tok, word) {
					t.Fatalf("%s %q: accepted %q", fsType, s, tok)
				}
			}
			if strings.HasPrefix(tok, "-") {
				if len(tok) != 2 {
					t.Fatalf("%s %q: accepted the option word %q", fsType, s, tok)
				}
				if _, ok := mkfsAllowed[fsType][tok]; !ok {
					t.Fatalf("%s %q: accepted %q, not on the allow-list", fsType, s, tok)
				}
				if _, refused := mkfsRefused[fsType][tok]; refused {
					t.Fatalf("%s %q: accepted the refused %q", fsType, s, tok)
				}
			} else if i == 0 || !strings.HasPrefix(got[i-1], "-") || mkfsAllowed[fsType][got[i-1]].value == nil {
				t.Fatalf("%s %q: accepted the operand %q", fsType, s, tok)
			}
		}
		if again, err := NormalizeMkfsOptions(fsType, got); err != nil || !slices.Equal(again, got) {
			t.Fatalf("%s %q: normalizing again = %q, %v", fsType, s, again, err)
		}
	})
}

// validStream is a stream of a 4 MiB block volume with two extents.
func validStream(t testing.TB) []byte { return validStreamVersion(t, streamVersion) }

// validStreamVersion is validStream in the given format version.
func validStreamVersion(t testing.TB, version uint32) []byte {
	t.Helper()
	var b bytes.Buffer
	h := &StreamHeader{Name: "v", UUID: "0b9d5a10-8c5e-4a57-b1a3-7f3e9c2d4e61", SizeBytes: 4 << 20, Mode: ModeBlock}
	sw, err := newStreamWriterVersion(&b, h, version)
	if err != nil {
		t.Fatal(err)
	}
	if err := sw.extent(4096, bytes.Repeat([]byte{1}, 512)); err != nil {
		t.Fatal(err)
	}
	if err := sw.extent(1<<20, bytes.Repeat([]byte{2}, 4096)); err != nil {
		t.Fatal(err)
	}
	if err := sw.close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// FuzzReadStream: whatever the input, readStream never panics, and what
// it accepts keeps the rules import relies on: a checked header, extents
// in order, not overlapping, within the size, of bounded length.
func FuzzReadStream(f *testing.F) {
	good := validStream(f)
	f.Add(good)
	f.Add(good[:40])
	f.Add(validStreamVersion(f, 1))
	f.Add([]byte(streamMagic))
	f.Fuzz(func(t *testing.T, in []byte) {
		var size, end int64
		h, err := readStream(bytes.NewReader(in), func(h *StreamHeader) error {
			if err := h.check(); err != nil {
				t.Fatalf("header given to onHeader fails its check: %v", err)
			}
			size = h.SizeBytes
			return nil
		}, func(off int64, data []byte) error {
			if off < end || len(data) == 0 || len(data) > maxExtent || off+int64(len(data)) > size {
				t.Fatalf("extent %d+%d passed (previous end %d, size %d)", off, len(data), end, size)
			}
			end = off + int64(len(data))
			return nil
		})
		if err == nil && h.SizeBytes != size {
			t.Fatalf("accepted header %+v differs from the one checked", h)
		}
		if err != nil && !errors.Is(err, ErrInvalid) {
			t.Fatalf("refusal %v is not ErrInvalid", err)
		}
	})
}
