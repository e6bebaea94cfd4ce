// Package volume is the node's volume store: sparse backing files and their
// metadata under one root directory, and the lifecycle operations that
// converge the kernel (loop devices, filesystems, partition tables) to them.
//
// The root directory is the source of truth; loop devices are a cache of it.
// Every operation is idempotent and serialised per volume by an flock shared
// by every process that opens the same store (CLI, systemd unit, CSI plugin).
// The package knows nothing of CSI, cobra or systemd.
package volume

import (
	"crypto/rand"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/big"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// Errors callers classify with errors.Is. They are wrapped with the
// operation and the volume.
var (
	// ErrInvalid marks input that was rejected before anything changed.
	ErrInvalid = errors.New("invalid argument")
	// ErrNotFound: no volume of that name or UUID.
	ErrNotFound = errors.New("volume not found")
	// ErrExists: a volume with that name or UUID exists already.
	ErrExists = errors.New("volume already exists")
	// ErrNoSpace: the store refuses the size before anything changed:
	// its overcommit policy does, or (with ErrNoRoom) what its
	// filesystem has free cannot hold what would be allocated at once.
	// It comes as a *SpaceError.
	ErrNoSpace = errors.New("not enough space in store")
	// ErrNoRoom: the store's filesystem has not the room (no block or
	// inode left: ENOSPC; the quota spent: EDQUOT) for what was to be
	// written into the store. Alone it is an operation that failed midway
	// (what it did is undone where a failure is; see the operation); with
	// ErrNoSpace a request refused up front. It comes as a *SpaceError.
	ErrNoRoom = errors.New("no room left on the store's filesystem")
	// ErrBusy: the volume is mounted or open and the operation was refused.
	ErrBusy = errors.New("volume in use")
	// ErrNotReady: the volume exists but an earlier create did not finish.
	ErrNotReady = errors.New("volume not ready")
	// ErrMismatch: a device does not hold what the volume says it holds
	// (its own filesystem, its own partition table); nothing was changed.
	ErrMismatch = errors.New("volume content does not match its metadata")
	// ErrBroken: the volume's metadata file cannot be read or parsed, or
	// holds a field its check refuses (Volume.check, Snapshot.check). It is
	// an ErrNotReady: the volume exists, and only delete acts on it.
	ErrBroken = fmt.Errorf("metadata unreadable: %w", ErrNotReady)
	// ErrNewer: the volume's or snapshot's record is of a format newer
	// than this binary reads (RecordFormat): a newer sparsevol wrote it.
	// Nothing acts on it, delete included, until sparsevol is upgraded
	// back; listings show it in state newer.
	ErrNewer = errors.New("written by a newer sparsevol")
	// ErrUnsafe: refused because something is not provably the volume's
	// own (a symlinked or hard-linked backing file, a loop device someone
	// else bound to it, another store's link); nothing was changed.
	ErrUnsafe = errors.New("refused: not provably the volume's own")
	// ErrOrphaned: the backing file is gone but a device of the volume
	// still holds its data; detaching would lose it (see Recover).
	ErrOrphaned = errors.New("volume orphaned: backing file gone, data only on its device")
)

// SpaceError is the one form of ErrNoSpace and ErrNoRoom: a failure for
// want of room in a store. Store is the store's directory, where room is
// made, which the advice callers give names; Err is the failure as it
// happened, its message unchanged.
type SpaceError struct {
	Store string
	Err   error
	// NoRoom: the store's filesystem lacks the room (errors.Is finds
	// ErrNoRoom); otherwise the overcommit policy refused.
	NoRoom bool
}

func (e *SpaceError) Error() string { return e.Err.Error() }

// Advice says what to do about e, naming the store, as a clause the
// caller puts after the error on its line; raise says how the caller's
// user raises the overcommit ratio (a flag, a chart value), which helps
// only where the policy refused and the filesystem has the room. The CLI
// and the plugin end their refusals with it.
func (e *SpaceError) Advice(raise string) string {
	if e.NoRoom {
		return fmt.Sprintf("the store's filesystem has no room left: make room on it (store %s: delete volumes or snapshots no longer needed, or other files there), then retry",
			Shown(e.Store))
	}
	return fmt.Sprintf("make room on the store's filesystem (store %s: delete volumes or snapshots no longer needed), or raise %s, then retry",
		Shown(e.Store), raise)
}

func (e *SpaceError) Unwrap() []error {
	if e.NoRoom {
		return []error{e.Err, ErrNoRoom}
	}
	return []error{e.Err}
}

// Mode is how a volume is consumed.
type Mode string

const (
	ModeFilesystem Mode = "filesystem"
	ModeBlock      Mode = "block"
)

// LabelManagedBy is the label that names who brings a volume up, where it
// is not sparsevol's units: the CSI driver sets it on its volumes (the
// kubelet stages them), and `sparsevol doctor` expects no unit for them.
const LabelManagedBy = "sparsevol.io/managed-by"

// ManagedByCSI is the value of LabelManagedBy on the CSI driver's
// volumes: their PersistentVolume is the driver's, and the CSI delete of
// it deletes the volume.
const ManagedByCSI = "csi"

// Bounds of the labels a volume or snapshot carries (ValidateLabels).
const (
	MaxLabels           = 64
	MaxLabelKeyLength   = 253
	MaxLabelValueLength = 1024
)

// ValidateLabels checks the labels of a volume or snapshot: the one rule
// for them where they are set (create, import, change, snapshot) and in a
// record. There are at most MaxLabels; a key is not empty and at most
// MaxLabelKeyLength bytes, a value at most MaxLabelValueLength bytes;
// both are UTF-8 of printable characters only (unicode.IsPrint: no
// control, format or bidirectional characters, no space but U+0020), so
// a label shown or logged cannot rewrite a terminal. An empty value is
// allowed (Change takes it for a removal). Errors wrap ErrInvalid.
func ValidateLabels(labels map[string]string) error {
	if len(labels) > MaxLabels {
		return fmt.Errorf("%d labels, at most %d allowed: %w", len(labels), MaxLabels, ErrInvalid)
	}
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		val := labels[k]
		switch {
		case k == "":
			return fmt.Errorf("a label key is empty: %w", ErrInvalid)
		case len(k) > MaxLabelKeyLength:
			return fmt.Errorf("label key %s is %d bytes, at most %d allowed: %w", Quote(k), len(k), MaxLabelKeyLength, ErrInvalid)
		case len(val) > MaxLabelValueLength:
			return fmt.Errorf("label %s: value is %d bytes, at most %d allowed: %w", Quote(k), len(val), MaxLabelValueLength, ErrInvalid)
		}
		if i := unprintable(k); i >= 0 {
			return fmt.Errorf("label key %s contains %s: %w", Quote(k), describeByte(k, i), ErrInvalid)
		}
		if i := unprintable(val); i >= 0 {
			return fmt.Errorf("label %s: value %s contains %s: %w", Quote(k), Quote(val), describeByte(val, i), ErrInvalid)
		}
	}
	return nil
}

// unprintable is the byte offset in s of the first character that is not
// UTF-8 or not printable (unicode.IsPrint), or -1 if there is none.
func unprintable(s string) int {
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size <= 1 || !unicode.IsPrint(r) {
			return i
		}
		i += size
	}
	return -1
}

// State records how far a volume's lifecycle got, so that a crash at any
// step is finished or cleaned up by the next run.
type State string

const (
	StateCreating State = "creating"
	StateReady    State = "ready"
	StateDeleting State = "deleting"
	// StateBroken is never written: List and Get report a volume whose
	// metadata file cannot be read in it (see Volume.Error).
	StateBroken State = "broken"
	// StateNewer is never written: List and Get report a volume whose
	// record a newer sparsevol wrote (ErrNewer) in it.
	StateNewer State = "newer"
	// StateExpanding is never written: Status reports a ready volume with
	// an expansion pending (ExpandingTo) in it.
	StateExpanding State = "expanding"
	// StateOrphaned is never stored: Status reports it for a ready volume
	// whose backing file is gone while a device of ours still holds it.
	StateOrphaned State = "orphaned"
)

// checkStoredState refuses a state no record holds: a volume's or
// snapshot's record is only ever written creating, ready or deleting (the
// other states are reported, never stored). The error carries no error
// class.
func checkStoredState(st State) error {
	switch st {
	case StateCreating, StateReady, StateDeleting:
		return nil
	}
	return fmt.Errorf("state %q is not creating, ready or deleting", st)
}

// Supported filesystems and the smallest size mkfs accepts for each here.
var minSize = map[string]int64{
	"ext4": 4 << 20,
	"xfs":  300 << 20,
	"":     1 << 20, // raw block: room for a GPT and one aligned MiB
}

// MiB is the size granularity: sizes are rounded up to it so partitions
// stay aligned and CSI capacity arithmetic is exact.
const MiB = 1 << 20

// Volume is the persisted metadata of one volume (<root>/<uuid>.json).
type Volume struct {
	// Format is the record's format: RecordFormat when written, what the
	// record says when read.
	Format      int       `json:"format"`
	Name        string    `json:"name"`
	UUID        string    `json:"uuid"`
	SizeBytes   int64     `json:"sizeBytes"`
	Mode        Mode      `json:"mode"`
	FSType      string    `json:"fsType,omitempty"`
	Partitioned bool      `json:"partitioned,omitempty"`
	BackingFile string    `json:"backingFile"`
	Preallocate bool      `json:"preallocate,omitempty"`
	DirectIO    bool      `json:"directIORequested"`
	BlockSize   uint32    `json:"blockSize,omitempty"`
	MkfsOptions []string  `json:"mkfsOptions,omitempty"`
	Adopted     bool      `json:"adopted,omitempty"`
	State       State     `json:"state"`
	Created     time.Time `json:"created"`
	// ExpandingTo is set while an expansion is in progress: the backing
	// file may already have that size. Expand to it finishes the expansion,
	// AbandonExpand takes it back.
	ExpandingTo int64 `json:"expandingTo,omitempty"`
	// BackingDev and BackingInode record the backing file's identity, so a
	// device still bound to the file after it was removed can be found.
	BackingDev   uint64 `json:"backingDev,omitempty"`
	BackingInode uint64 `json:"backingInode,omitempty"`
	// FromSnapshot and ClonedFrom name (by UUID) the snapshot or volume
	// the volume was copied from when it was made, if any.
	FromSnapshot string `json:"fromSnapshot,omitempty"`
	ClonedFrom   string `json:"clonedFrom,omitempty"`
	// Imported says the volume was made from a stream (Import): one left
	// creating holds the stream's data, and only Delete removes it.
	Imported bool `json:"imported,omitempty"`
	// Labels carry caller-owned annotations (the CSI driver keeps the
	// request name and parameters here).
	Labels map[string]string `json:"labels,omitempty"`
	// IOLimits are enforced on the volume's loop device at every attach
	// (see Change).
	IOLimits IOLimits `json:"ioLimits,omitzero"`
	// Problem says what is wrong with the volume, if anything: why its
	// metadata cannot be read (state broken, set by List and Get), or,
	// in a Status, what is unsafe about it or that it is orphaned. It is
	// never written to the metadata file.
	Problem string `json:"problem,omitempty"`
	// refusal is the error a stand-in's record was refused with (see
	// Refusal).
	refusal error
}

// Refusal is the error v's record was refused with where v is a
// listing's stand-in for it (state broken or newer, see List), what every
// operation on v returns; nil for a volume read from its record.
func (v *Volume) Refusal() error { return v.refusal }

// StablePath is the path that survives reboots where udev runs:
// /dev/disk/by-uuid for filesystems, /dev/disk/by-partuuid for partitioned
// block volumes, and the store's own /dev/sparsevol link for whole-device
// raw volumes (which carry no identity on disk).
func (v *Volume) StablePath() string {
	switch {
	case v.Mode == ModeFilesystem:
		return "/dev/disk/by-uuid/" + v.UUID
	case v.Partitioned:
		return "/dev/disk/by-partuuid/" + v.UUID
	default:
		return LinkDir + "/" + v.UUID
	}
}

// LinkDir holds the links attach maintains for every volume:
// /dev/sparsevol/<uuid> -> the device to use (partition or whole device).
// They do not depend on udev.
var LinkDir = "/dev/sparsevol"

// ValidUUID reports whether s is a canonical lower-case UUID.
func ValidUUID(s string) bool { return uuidShaped(s, false) }

// uuidShaped reports whether s is 8-4-4-4-12 hexadecimal digits, lower
// case only unless anyCase.
func uuidShaped(s string, anyCase bool) bool {
	if len(s) != 36 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case i == 8 || i == 13 || i == 18 || i == 23:
			if c != '-' {
				return false
			}
		case '0' <= c && c <= '9' || 'a' <= c && c <= 'f':
		case anyCase && 'A' <= c && c <= 'F':
		default:
			return false
		}
	}
	return true
}

// NewUUID returns a random (version 4) UUID.
func NewUUID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// MaxNameLength is the longest volume name, in characters (bytes: names
// are ASCII).
const MaxNameLength = 253

// ValidateName checks a volume name: what may become part of a unit name,
// a label or a path component without quoting surprises. A name is ASCII
// letters, digits, '.', '_' and '-', does not start with '-' or '.',
// contains no "..", and is never shaped like a UUID in any letter case
// (references are resolved by UUID first, so such a name could stand for
// another volume).
func ValidateName(name string) error {
	if name == "" {
		return fmt.Errorf("name is empty: %w", ErrInvalid)
	}
	for i := 0; i < len(name); i++ {
		if !nameByte(name[i]) {
			return fmt.Errorf("name %s contains %s; allowed are ASCII letters, digits, '.', '_' and '-': %w",
				Quote(name), describeByte(name, i), ErrInvalid)
		}
	}
	switch {
	case len(name) > MaxNameLength:
		return fmt.Errorf("name is %d characters, at most %d allowed: %w", len(name), MaxNameLength, ErrInvalid)
	case name[0] == '-' || name[0] == '.':
		return fmt.Errorf("name %q starts with %q: %w", name, name[:1], ErrInvalid)
	case strings.Contains(name, ".."):
		return fmt.Errorf("name %q contains \"..\": %w", name, ErrInvalid)
	case uuidShaped(name, true):
		return fmt.Errorf("name %q is shaped like a UUID, which would make it ambiguous with a volume's UUID: %w", name, ErrInvalid)
	}
	return nil
}

// Quote quotes a refused value for a message or a log: ASCII only, so
// that no control or bidirectional character reaches a terminal, and
// shortened to its first bytes, so that a hostile value is never echoed
// whole. It is the one way a refused value is shown.
func Quote(s string) string {
	q, cut := quoteCut(s, valueMax)
	if cut {
		return q + "..."
	}
	return q
}

// Clip is Quote for a value given to a structured log handler, which adds
// its own quotes where a value needs them: the same escapes and the same
// cut, without the enclosing quotes. It is the one way a value from a
// client is logged.
func Clip(s string) string { return clipAt(s, valueMax) }

// ClipMessage is Clip for a message a peer wrote (kubelet's error for a
// refused registration): the same escapes, but cut at messageMax bytes,
// enough for a message of a few lines, never megabytes. It is the one way
// a peer's message is logged or kept.
func ClipMessage(s string) string { return clipAt(s, messageMax) }

// valueMax and messageMax are the bytes of a value (Quote, Clip) and of a
// peer's message (ClipMessage) that are shown.
const (
	valueMax   = 64
	messageMax = 512
)

// clipAt is Clip with the cut at max bytes.
func clipAt(s string, max int) string {
	q, cut := quoteCut(s, max)
	q = q[1 : len(q)-1]
	if cut {
		return q + "..."
	}
	return q
}

// quoteCut is the rule of Quote and Clip: s Go-quoted with every
// non-ASCII character escaped, cut to its first max bytes (cut reports
// whether it was).
func quoteCut(s string, max int) (q string, cut bool) {
	if len(s) <= max {
		return strconv.QuoteToASCII(s), false
	}
	return strconv.QuoteToASCII(strings.ToValidUTF8(s[:max], "")), true
}

// Shown is how a text the system reports and anyone may have chosen (a
// mount point, a process name) is shown in a line of output: as it is
// where every character of it prints, else Go-quoted with every
// non-ASCII character escaped, so that no newline, escape sequence or
// bidirectional character reaches a terminal. Unlike Quote it is never
// cut: a long path is no attack, and an operator needs it whole.
func Shown(s string) string {
	for _, r := range s {
		if !strconv.IsPrint(r) || r == utf8.RuneError {
			return strconv.QuoteToASCII(s)
		}
	}
	return s
}

// PlainName reports whether name, a file name read from a directory or
// from sysfs (hostile: anyone who can name a file chose it), may be
// printed as it is, in a line or in a command an operator pastes: not
// empty, and only the bytes a volume name may hold (ASCII letters,
// digits, '.', '_', '-'), none of which a shell or a terminal reads as
// more than text. Every name the store gives its files is plain; any
// other is shown through Quote and never put into a command.
func PlainName(name string) bool {
	for i := 0; i < len(name); i++ {
		if !nameByte(name[i]) {
			return false
		}
	}
	return name != ""
}

func nameByte(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-'
}

// describeByte names the character at byte offset i of s for an error
// message: the rune (quoted, with its code point) or the invalid byte.
func describeByte(s string, i int) string {
	r, size := utf8.DecodeRuneInString(s[i:])
	if r == utf8.RuneError && size <= 1 {
		return fmt.Sprintf("the byte 0x%02x, which is not UTF-8", s[i])
	}
	return fmt.Sprintf("%+q (%U)", r, r)
}

// CheckUnitPath is the rule for a path that sparsevol writes into a
// service manager's unit file: the store root (Open refuses any other) and
// the binary the units run (`units install --binary`). Such a path is
// absolute, clean (filepath.Clean leaves it as it is), UTF-8 of printable
// characters (unprintable: no control or format character, as a newline
// would start a setting of its own), and holds none that systemd's unit
// syntax reads as more than itself: no space (which splits a setting's
// values), '%' (specifiers such as %H), '\' (escapes), quotes or '$'
// (variables in ExecStart=). It is a path a file can have
// (checkPathLength). The error, ErrInvalid, names the character or the
// length.
func CheckUnitPath(path string) error {
	switch {
	case path == "":
		return fmt.Errorf("empty path: %w", ErrInvalid)
	case !filepath.IsAbs(path):
		return fmt.Errorf("path %s is not absolute; give the absolute path: %w", Quote(path), ErrInvalid)
	}
	if err := checkPathLength(path); err != nil {
		return err
	}
	i := unprintable(path)
	if j := strings.IndexAny(path, unitPathSpecials); j >= 0 && (i < 0 || j < i) {
		i = j
	}
	if i >= 0 {
		return fmt.Errorf("path %s contains %s: a systemd unit file would not read it as part of a path; choose a path without it: %w",
			Quote(path), describeByte(path, i), ErrInvalid)
	}
	if clean := filepath.Clean(path); clean != path {
		return fmt.Errorf("path %s is not clean; give it as %s: %w", Quote(path), Quote(clean), ErrInvalid)
	}
	return nil
}

// checkPathLength refuses a path no file can have, which the kernel
// refuses too (ENAMETOOLONG): of PATH_MAX bytes or more, or with a
// component longer than NAME_MAX bytes. The error, ErrInvalid, shows the
// path through Quote, so such a path is never echoed whole.
func checkPathLength(path string) error {
	if len(path) >= unix.PathMax {
		return fmt.Errorf("path %s is %d bytes, and no file's path is longer than %d; give the file's path: %w",
			Quote(path), len(path), unix.PathMax-1, ErrInvalid)
	}
	for _, name := range strings.Split(path, "/") {
		if len(name) > unix.NAME_MAX {
			return fmt.Errorf("path %s has a component of %d bytes, and no file name is longer than %d; give the file's path: %w",
				Quote(path), len(name), unix.NAME_MAX, ErrInvalid)
		}
	}
	return nil
}

// unitPathSpecials are the printable characters systemd's unit syntax
// reads as more than themselves in a path (CheckUnitPath).
const unitPathSpecials = ` %\"'$`

// nilUUID is the all-zero UUID: no filesystem or partition can be told
// apart by it.
const nilUUID = "00000000-0000-0000-0000-000000000000"

// maxSize bounds parsed sizes, so that rounding and the store's space
// arithmetic cannot overflow.
const maxSize = math.MaxInt64 / 2

// maxSizeText bounds the text ParseSize reads: the longest size (4 EiB in
// bytes, with a fraction to spare) fits, and nothing longer is parsed, so
// no input can make the number parser work long.
const maxSizeText = 32

// sizeRE is the grammar of ParseSize: a decimal number (digits, optionally
// a fraction) and an optional unit, K M G T P in either case, optionally
// followed by i, optionally followed by B (or a B alone: bytes),
// compiled on first use rather than at every start.
var sizeRE = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^([0-9]+(?:\.[0-9]+)?)(?:([KMGTPkmgtp])(i)?)?([Bb])?$`)
})

// ParseSize parses bytes or a number with K/M/G/T/P or Ki/Mi/Gi/Ti/Pi (all
// powers of 1024, optionally followed by B). The number is decimal digits
// with an optional fraction: no sign, exponent, separators or spaces. The
// result is rounded up to a whole byte; zero, sizes beyond 4 EiB and
// texts longer than maxSizeText bytes are rejected, the latter unparsed.
func ParseSize(s string) (int64, error) {
	if len(s) > maxSizeText {
		return 0, fmt.Errorf("size %s is %d bytes long, at most %d: want bytes or a number with K, M, G, T, P (or Ki, Mi, Gi, Ti, Pi): %w",
			Quote(s), len(s), maxSizeText, ErrInvalid)
	}
	m := sizeRE().FindStringSubmatch(s)
	if m == nil {
		return 0, fmt.Errorf("size %s: want bytes or a number with K, M, G, T, P (or Ki, Mi, Gi, Ti, Pi), digits and an optional fraction only: %w", Quote(s), ErrInvalid)
	}
	n, ok := new(big.Rat).SetString(m[1])
	if !ok {
		return 0, fmt.Errorf("size %s is not a number: %w", Quote(s), ErrInvalid)
	}
	if m[2] != "" {
		shift := uint(10 * (1 + strings.IndexByte("KMGTP", strings.ToUpper(m[2])[0])))
		n.Mul(n, new(big.Rat).SetInt(new(big.Int).Lsh(big.NewInt(1), shift)))
	}
	if n.Sign() <= 0 {
		return 0, fmt.Errorf("size %s must be positive: %w", Quote(s), ErrInvalid)
	}
	// Round up to a whole byte.
	q, r := new(big.Int).QuoRem(n.Num(), n.Denom(), new(big.Int))
	if r.Sign() != 0 {
		q.Add(q, big.NewInt(1))
	}
	if !q.IsInt64() || q.Int64() > maxSize {
		return 0, fmt.Errorf("size %s is too large (at most %s): %w", Quote(s), FormatSize(maxSize+1), ErrInvalid)
	}
	return q.Int64(), nil
}

// ParseOvercommitRatio parses an overcommit ratio (Options.OvercommitRatio)
// from a flag or the environment and checks it as Open does.
func ParseOvercommitRatio(s string) (float64, error) {
	r, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return 0, fmt.Errorf("overcommit ratio %s is not a number: %w", Quote(s), ErrInvalid)
	}
	if err := checkOvercommitRatio(r); err != nil {
		return 0, err
	}
	return r, nil
}

// checkOvercommitRatio is the rule for an overcommit ratio: a finite
// positive number. NaN would turn off the space policy.
func checkOvercommitRatio(r float64) error {
	if math.IsNaN(r) || math.IsInf(r, 0) || r <= 0 {
		return fmt.Errorf("overcommit ratio %v: want a finite positive number (1 = never overcommit): %w", r, ErrInvalid)
	}
	return nil
}

// RoundUpMiB rounds a size up to a whole MiB; sizes within a MiB of the
// largest int64 round down to the largest whole MiB instead of overflowing.
func RoundUpMiB(n int64) int64 {
	if n > math.MaxInt64-(MiB-1) {
		return math.MaxInt64 / MiB * MiB
	}
	return (n + MiB - 1) / MiB * MiB
}

// MinSize returns the smallest size allowed for a filesystem ("" for raw).
func MinSize(fsType string) int64 { return minSize[fsType] }

// The one style of sizes in output: binary units written Ki, Mi, Gi, Ti,
// or B below a KiB (what ParseSize reads back), exact where a size is a
// setting (FormatSize), to one decimal where it is a measurement
// (FormatBytes).
var binaryUnits = []string{"Ti", "Gi", "Mi", "Ki"}

// FormatSize renders bytes with the largest exact binary unit, or in B.
func FormatSize(n int64) string {
	for i, u := range binaryUnits {
		div := int64(1) << (10 * uint(4-i))
		if n >= div && n%div == 0 {
			return fmt.Sprintf("%d%s", n/div, u)
		}
	}
	return strconv.FormatInt(n, 10) + "B"
}

// FormatBytes renders a measured amount of bytes (allocation, free space,
// progress) to one decimal of the largest binary unit it reaches; negative
// amounts (space given back) keep their sign.
func FormatBytes(n int64) string {
	if n < 0 {
		return "-" + FormatBytes(-n)
	}
	for i, u := range binaryUnits {
		div := int64(1) << (10 * uint(4-i))
		if n >= div {
			return fmt.Sprintf("%.1f%s", float64(n)/float64(div), u)
		}
	}
	return strconv.FormatInt(n, 10) + "B"
}

func (v *Volume) backingID() loop.FileID {
	return loop.FileID{Dev: v.BackingDev, Inode: v.BackingInode}
}

// owner is the proof of ownership of v's devices bound to the file id:
// read-write, from offset 0, whole file, tagged with v's UUID.
func (v *Volume) owner(id loop.FileID) loop.Owner {
	return loop.Owner{ID: id, Tag: tag(v.UUID)}
}

// noteBackingID records id and reports whether it changed (the file was
// made, adopted, or replaced, say restored from a backup).
func (v *Volume) noteBackingID(id loop.FileID) bool {
	if v.backingID() == id {
		return false
	}
	v.BackingDev, v.BackingInode = id.Dev, id.Inode
	return true
}
