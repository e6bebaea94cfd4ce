package volume

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"strings"
	"testing"
)

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"1", 1, true},
		{"4096", 4096, true},
		{"1K", 1 << 10, true},
		{"1Ki", 1 << 10, true},
		{"64M", 64 << 20, true},
		{"64Mi", 64 << 20, true},
		{"64MiB", 64 << 20, true},
		{"1.5G", 3 << 29, true},
		{"2Gi", 2 << 30, true},
		{"1T", 1 << 40, true},
		{"1Ti", 1 << 40, true},
		{"0", 0, false},
		{"0M", 0, false},
		{"-1", 0, false},
		{"-5G", 0, false},
		{"abc", 0, false},
		{"", 0, false},
		{"G", 0, false},
		{"12X", 0, false},
		{"1e400", 0, false},
		{"NaN", 0, false},
		{"99999999P", 0, false},
		{"512B", 512, true},
		{"1.5", 2, true},
		{"8m", 8 << 20, true},
		{"4PiB", 4 << 50, true},
		{"10iB", 0, false},
		{"1_000_000_000", 0, false},
		{"1e3", 0, false},
		{"0x10", 0, false},
		{"+8M", 0, false},
		{" 8M", 0, false},
		{"8 M", 0, false},
		{"8MiBB", 0, false},
		{"8Bi", 0, false},
		{"Inf", 0, false},
		{"1.", 0, false},
		{".5G", 0, false},
		{"0.0000001", 1, true},
		{"0.0", 0, false},
		{"٣M", 0, false},
		{"4096P", 0, false},
		{"4095.9999999P", 4611686018314797914, true}, // rounded up to a whole byte
	}
	for _, tt := range tests {
		got, err := ParseSize(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d, ok=%v", tt.in, got, err, tt.want, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseSize(%q) error %v is not ErrInvalid", tt.in, err)
		}
	}
}

// TestParseSizeBoundsText: a size text longer than maxSizeText is refused
// unparsed, and the error shows a short prefix of it, not all of it.
func TestParseSizeBoundsText(t *testing.T) {
	tests := []struct {
		name string
		in   string
		ok   bool
	}{
		{"longest accepted", strings.Repeat("0", maxSizeText-3) + "1Gi", true},
		{"one byte more", strings.Repeat("0", maxSizeText-2) + "1Gi", false},
		{"a mebibyte of nines", strings.Repeat("9", 1<<20), false},
		{"a long fraction", "1." + strings.Repeat("5", 1<<20) + "K", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseSize(tt.in)
			if (err == nil) != tt.ok {
				t.Fatalf("ParseSize(%d bytes): %v, want ok=%v", len(tt.in), err, tt.ok)
			}
			if err == nil {
				return
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error %v is not ErrInvalid", err)
			}
			if len(err.Error()) > 300 {
				t.Errorf("error of %d bytes echoes the input: %.120s...", len(err.Error()), err)
			}
		})
	}
}

func TestValidateName(t *testing.T) {
	tests := []struct {
		name string
		ok   bool
	}{
		{"data", true},
		{"prometheus-0", true},
		{"a.b_c", true},
		{strings.Repeat("a", 253), true},
		{"", false},
		{strings.Repeat("a", 254), false},
		{"a/b", false},
		{"..", false},
		{"a..b", false},
		{"a b", false},
		{"a\x00b", false},
		{"tab\there", false},
		{".hidden", false},
		{"-x", false},
		{"a\u202eb", false},
		{"a\u00a0b", false},
		{strings.Repeat("é", 100), false},
		{"name\xff", false},
		{"7f561330-fb42-440f-83e9-e9f8aa31d2f4", false},
		{"7F561330-FB42-440F-83E9-E9F8AA31D2F4", false},
		{"00000000-0000-0000-0000-000000000000", false},
		{"7f561330-fb42-440f-83e9-e9f8aa31d2f", true},
		{"7f561330fb42440f83e9e9f8aa31d2f4", true},
		{"x-7f561330-fb42-440f-83e9-e9f8aa31d2f4", true},
		{"a~b", false},
		{"a:b", false},
		{"a@b", false},
		{"a\\b", false},
		{"Data_01-x.y", true},
	}
	for _, tt := range tests {
		err := ValidateName(tt.name)
		if (err == nil) != tt.ok {
			t.Errorf("ValidateName(%q) = %v, want ok=%v", tt.name, err, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalid) {
			t.Errorf("ValidateName(%q) error is not ErrInvalid: %v", tt.name, err)
		}
	}
}

func TestValidateNameLengthMessage(t *testing.T) {
	err := ValidateName(strings.Repeat("n", 254))
	if err == nil || !strings.Contains(err.Error(), "254 characters") {
		t.Fatalf("ValidateName(254 x n) = %v, want it to say 254 characters", err)
	}
}

// TestQuoteAndClip: a value is shown ASCII-escaped and cut to its first
// 64 bytes, quoted by Quote and bare by Clip (a log handler quotes it); a
// peer's message the same by ClipMessage, cut at 512 bytes.
func TestQuoteAndClip(t *testing.T) {
	long := strings.Repeat("a", 1<<20)
	tests := []struct {
		in, quote, clip, message string
	}{
		{"pvc-1", `"pvc-1"`, "pvc-1", "pvc-1"},
		{"", `""`, "", ""},
		{"a\nb\u202e", `"a\nb\u202e"`, `a\nb\u202e`, `a\nb\u202e`},
		{strings.Repeat("a", 64), `"` + strings.Repeat("a", 64) + `"`, strings.Repeat("a", 64), strings.Repeat("a", 64)},
		{strings.Repeat("a", 512), `"` + long[:64] + `"...`, long[:64] + "...", long[:512]},
		{long, `"` + long[:64] + `"...`, long[:64] + "...", long[:512] + "..."},
		// A character the cut splits is left out whole.
		{strings.Repeat("a", 63) + "\u00e9", `"` + strings.Repeat("a", 63) + `"...`, strings.Repeat("a", 63) + "...", `` + strings.Repeat("a", 63) + `\u00e9`},
		{"\x1b]0;owned\a" + long, `"\x1b]0;owned\a` + long[:54] + `"...`, `\x1b]0;owned\a` + long[:54] + "...", `\x1b]0;owned\a` + long[:502] + "..."},
	}
	for _, tc := range tests {
		if got := Quote(tc.in); got != tc.quote {
			t.Errorf("Quote(%.80q) = %q, want %q", tc.in, got, tc.quote)
		}
		if got := Clip(tc.in); got != tc.clip {
			t.Errorf("Clip(%.80q) = %q, want %q", tc.in, got, tc.clip)
		}
		if got := ClipMessage(tc.in); got != tc.message {
			t.Errorf("ClipMessage(%.80q) = %.80q, want %.80q", tc.in, got, tc.message)
		}
	}
}

// manyLabels returns n labels, each key and value distinct and valid.
func manyLabels(n int) map[string]string {
	labels := make(map[string]string, n)
	for i := range n {
		labels[fmt.Sprintf("example.com/k%d", i)] = fmt.Sprintf("v%d", i)
	}
	return labels
}

// boundLabels returns MaxLabels labels, one with a key and one with a value
// of the longest length allowed.
func boundLabels() map[string]string {
	labels := manyLabels(MaxLabels - 2)
	labels[strings.Repeat("k", MaxLabelKeyLength)] = "v"
	labels["long"] = strings.Repeat("v", MaxLabelValueLength)
	return labels
}

func TestValidateLabels(t *testing.T) {
	tests := []struct {
		name   string
		labels map[string]string
		ok     bool
	}{
		{"none", nil, true},
		{"the CSI driver's", map[string]string{
			"sparsevol.io/csi-name": strings.Repeat("n", MaxNameLength), "sparsevol.io/managed-by": "csi",
			"sparsevol.io/provisioning": "thin", "sparsevol.io/discard": "true"}, true},
		{"empty value", map[string]string{"k": ""}, true},
		{"space and non-ASCII letters", map[string]string{"owner name": "Zoë Ünal"}, true},
		{"at the bounds", boundLabels(), true},
		{"too many", manyLabels(MaxLabels + 1), false},
		{"empty key", map[string]string{"": "v"}, false},
		{"key too long", map[string]string{strings.Repeat("k", MaxLabelKeyLength+1): "v"}, false},
		{"value too long", map[string]string{"k": strings.Repeat("v", MaxLabelValueLength+1)}, false},
		{"escape in a value", map[string]string{"k": "a\x1b[2Jb"}, false},
		{"newline in a key", map[string]string{"k\n": "v"}, false},
		{"NUL in a value", map[string]string{"k": "a\x00"}, false},
		{"DEL in a key", map[string]string{"k\x7f": "v"}, false},
		{"C1 control in a value", map[string]string{"k": "a\u0085b"}, false},
		{"bidirectional override in a value", map[string]string{"k": "a\u202eb"}, false},
		{"zero-width space in a key", map[string]string{"a\u200bb": "v"}, false},
		{"tab in a value", map[string]string{"k": "a\tb"}, false},
		{"not UTF-8", map[string]string{"k": "a\xffb"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := ValidateLabels(tt.labels)
			if (err == nil) != tt.ok {
				t.Fatalf("ValidateLabels = %v, want ok=%v", err, tt.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v is not ErrInvalid", err)
			}
			if err != nil && strings.ContainsFunc(err.Error(), func(r rune) bool { return r < ' ' || r > '~' }) {
				t.Fatalf("error %q holds a character beyond printable ASCII", err)
			}
		})
	}
}

// unsafeUnitPaths are paths systemd's unit syntax would read as more than
// a path, each with the character CheckUnitPath must name.
var unsafeUnitPaths = []struct{ name, path, char string }{
	{"specifier", "/srv/st%H", `'%'`},
	{"newline injecting a setting", "/srv/st %H\nExecStartPre=/bin/touch /tmp/pwned", `' '`},
	{"newline alone", "/srv/st\nExecStartPre=/bin/true", `'\n'`},
	{"space", "/opt/my tools/sparsevol", `' '`},
	{"tab", "/srv/a\tb", `'\t'`},
	{"carriage return", "/srv/a\rb", `'\r'`},
	{"no-break space", "/srv/a\u00a0b", `U+00A0`},
	{"right-to-left override", "/srv/a\u202eb", `U+202E`},
	{"delete", "/srv/a\x7fb", `U+007F`},
	{"nul", "/srv/a\x00b", `U+0000`},
	{"backslash", `/srv/a\x20b`, `'\\'`},
	{"double quote", `/srv/"a"`, `'"'`},
	{"single quote", "/srv/'a'", `'\''`},
	{"dollar", "/srv/$HOME", `'$'`},
	{"not UTF-8", "/srv/a\xffb", "0xff"},
}

func TestCheckUnitPath(t *testing.T) {
	type tc struct{ name, path, want string }
	tests := []tc{
		{"default store", DefaultRoot, ""},
		{"default binary", "/usr/local/bin/sparsevol", ""},
		{"punctuation systemd leaves alone", "/srv/a-b_c.d/e+f@g:h,i=j~k", ""},
		{"letters", "/srv/données", ""},
		{"root directory", "/", ""},
		{"empty", "", "empty"},
		{"relative", "srv/store", "not absolute"},
		{"dot", "/srv/./store", "not clean"},
		{"dotdot", "/usr/local/bin/../bin/sparsevol", "not clean"},
		{"double slash", "/srv//store", "not clean"},
		{"trailing slash", "/srv/store/", "not clean"},
	}
	for _, u := range unsafeUnitPaths {
		tests = append(tests, tc{u.name, u.path, u.char})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckUnitPath(tt.path)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("CheckUnitPath(%q) = %v, want nil", tt.path, err)
			case tt.want == "":
			case !errors.Is(err, ErrInvalid):
				t.Fatalf("CheckUnitPath(%q) = %v, want ErrInvalid", tt.path, err)
			case !strings.Contains(err.Error(), tt.want):
				t.Errorf("CheckUnitPath(%q) = %v, want it to name %s", tt.path, err, tt.want)
			case strings.ContainsAny(err.Error(), "\n\r"):
				t.Errorf("CheckUnitPath(%q): message spans lines: %q", tt.path, err)
			}
		})
	}
}

// TestLabelsFitARecord: a record holding labels at ValidateLabels' bounds,
// of characters JSON escapes, stays below maxRecordSize, so it is read.
func TestLabelsFitARecord(t *testing.T) {
	labels := map[string]string{}
	for i := range MaxLabels {
		key := fmt.Sprintf("%d", i)
		key += strings.Repeat("<", MaxLabelKeyLength-len(key))
		labels[key] = strings.Repeat("&", MaxLabelValueLength)
	}
	if err := ValidateLabels(labels); err != nil {
		t.Fatal(err)
	}
	v := Volume{Name: "v", UUID: NewUUID(), Labels: labels}
	data, err := json.MarshalIndent(&v, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if len(data) >= maxRecordSize {
		t.Errorf("the record is %d bytes, not below %d", len(data), maxRecordSize)
	}
}

// TestOpenRefusesUnitUnsafeRoot: a store directory whose path the units
// could not name is refused, and left as it was (Open would otherwise
// make this one private).
func TestOpenRefusesUnitUnsafeRoot(t *testing.T) {
	for _, u := range unsafeUnitPaths {
		t.Run(u.name, func(t *testing.T) {
			root := t.TempDir() + u.path
			exists := !strings.ContainsRune(root, 0) // no name holds a NUL
			if exists {
				if err := os.MkdirAll(root, 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Chmod(root, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			_, err := Open(root, Options{})
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), u.char) {
				t.Fatalf("Open(%q) = %v, want ErrInvalid naming %s", root, err, u.char)
			}
			if !exists {
				return
			}
			if fi, err := os.Stat(root); err != nil || fi.Mode().Perm() != 0o755 {
				t.Fatalf("refused store changed: %v, %v", fi.Mode(), err)
			}
		})
	}
}

func TestParseOvercommitRatio(t *testing.T) {
	tests := []struct {
		in   string
		want float64
		ok   bool
	}{
		{"1", 1, true},
		{"2.5", 2.5, true},
		{"1e9", 1e9, true},
		{"NaN", 0, false},
		{"nan", 0, false},
		{"Inf", 0, false},
		{"+Inf", 0, false},
		{"-Inf", 0, false},
		{"1e400", 0, false},
		{"-1", 0, false},
		{"0", 0, false},
		{"abc", 0, false},
		{"", 0, false},
		{"1x", 0, false},
	}
	for _, tt := range tests {
		got, err := ParseOvercommitRatio(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseOvercommitRatio(%q) = %v, %v; want %v, ok=%v", tt.in, got, err, tt.want, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseOvercommitRatio(%q) error %v is not ErrInvalid", tt.in, err)
		}
	}
}

func TestOpenRejectsBadOvercommitRatio(t *testing.T) {
	for _, r := range []float64{math.NaN(), math.Inf(1), math.Inf(-1), -1} {
		if _, err := Open(t.TempDir(), Options{OvercommitRatio: r}); !errors.Is(err, ErrInvalid) {
			t.Errorf("Open with overcommit ratio %v = %v, want ErrInvalid", r, err)
		}
	}
	if _, err := Open(t.TempDir(), Options{OvercommitRatio: 3}); err != nil {
		t.Errorf("Open with overcommit ratio 3: %v", err)
	}
}

func TestNormalizeCreateRequest(t *testing.T) {
	tests := []struct {
		name string
		req  CreateRequest
		ok   bool
		want CreateRequest // checked fields: Mode, FSType, SizeBytes
	}{
		{"defaults", CreateRequest{Name: "a", SizeBytes: 10 << 20}, true,
			CreateRequest{Mode: ModeFilesystem, FSType: "ext4", SizeBytes: 10 << 20}},
		{"rounds up to MiB", CreateRequest{Name: "a", SizeBytes: 10<<20 + 1}, true,
			CreateRequest{Mode: ModeFilesystem, FSType: "ext4", SizeBytes: 11 << 20}},
		{"block", CreateRequest{Name: "a", SizeBytes: 1 << 20, Mode: ModeBlock}, true,
			CreateRequest{Mode: ModeBlock, SizeBytes: 1 << 20}},
		{"xfs too small", CreateRequest{Name: "a", SizeBytes: 299 << 20, FSType: "xfs"}, false, CreateRequest{}},
		{"ext4 too small", CreateRequest{Name: "a", SizeBytes: 1 << 20}, false, CreateRequest{}},
		{"unknown fs", CreateRequest{Name: "a", SizeBytes: 1 << 30, FSType: "btrfs"}, false, CreateRequest{}},
		{"unknown mode", CreateRequest{Name: "a", SizeBytes: 1 << 30, Mode: "file"}, false, CreateRequest{}},
		{"fs with block", CreateRequest{Name: "a", SizeBytes: 1 << 30, Mode: ModeBlock, FSType: "ext4"}, false, CreateRequest{}},
		{"no-partition with fs", CreateRequest{Name: "a", SizeBytes: 1 << 30, NoPartition: true}, false, CreateRequest{}},
		{"bad uuid", CreateRequest{Name: "a", SizeBytes: 1 << 30, UUID: "1234"}, false, CreateRequest{}},
		{"nil uuid", CreateRequest{Name: "a", SizeBytes: 1 << 30, UUID: "00000000-0000-0000-0000-000000000000"}, false, CreateRequest{}},
		{"upper-case uuid accepted", CreateRequest{Name: "a", SizeBytes: 1 << 30, UUID: "7F561330-FB42-440F-83E9-E9F8AA31D2F4"}, true,
			CreateRequest{Mode: ModeFilesystem, FSType: "ext4", SizeBytes: 1 << 30}},
		{"mkfs option changing uuid", CreateRequest{Name: "a", SizeBytes: 1 << 30, MkfsOptions: []string{"-U 7f561330-fb42-440f-83e9-e9f8aa31d2f4"}}, false, CreateRequest{}},
		{"zero size", CreateRequest{Name: "a"}, false, CreateRequest{}},
		{"bad name", CreateRequest{Name: "a/b", SizeBytes: 1 << 30}, false, CreateRequest{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := tt.req
			err := req.Normalize()
			if (err == nil) != tt.ok {
				t.Fatalf("normalize = %v, want ok=%v", err, tt.ok)
			}
			if err != nil {
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("error %v is not ErrInvalid", err)
				}
				return
			}
			if req.Mode != tt.want.Mode || req.FSType != tt.want.FSType || req.SizeBytes != tt.want.SizeBytes {
				t.Fatalf("normalized to %+v, want %+v", req, tt.want)
			}
		})
	}
}

func TestNewUUID(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		u := NewUUID()
		if !ValidUUID(u) || u[14] != '4' {
			t.Fatalf("NewUUID() = %q, not a v4 UUID", u)
		}
		if seen[u] {
			t.Fatalf("duplicate UUID %s", u)
		}
		seen[u] = true
	}
}

func TestStablePath(t *testing.T) {
	u := "7f561330-fb42-440f-83e9-e9f8aa31d2f4"
	tests := []struct {
		v    Volume
		want string
	}{
		{Volume{UUID: u, Mode: ModeFilesystem, FSType: "ext4"}, "/dev/disk/by-uuid/" + u},
		{Volume{UUID: u, Mode: ModeBlock, Partitioned: true}, "/dev/disk/by-partuuid/" + u},
		{Volume{UUID: u, Mode: ModeBlock}, "/dev/sparsevol/" + u},
	}
	for _, tt := range tests {
		if got := tt.v.StablePath(); got != tt.want {
			t.Errorf("StablePath(%+v) = %s, want %s", tt.v, got, tt.want)
		}
	}
}

func TestFormatSize(t *testing.T) {
	for in, want := range map[int64]string{1 << 30: "1Gi", 3 << 20: "3Mi", 1536: "1536B", 5 << 40: "5Ti", 1024: "1Ki", 0: "0B"} {
		if got := FormatSize(in); got != want {
			t.Errorf("FormatSize(%d) = %s, want %s", in, got, want)
		}
		if back, err := ParseSize(FormatSize(in)); in > 0 && (err != nil || back != in) {
			t.Errorf("ParseSize(FormatSize(%d)) = %d, %v", in, back, err)
		}
	}
	for in, want := range map[int64]string{0: "0B", 1023: "1023B", 1536: "1.5Ki", 3<<20 + 1<<19: "3.5Mi", -(2 << 30): "-2.0Gi"} {
		if got := FormatBytes(in); got != want {
			t.Errorf("FormatBytes(%d) = %s, want %s", in, got, want)
		}
	}
}
