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
	"math"
	"regexp"
	"strconv"
	"strings"
	"time"

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
	// ErrNoSpace: the store's overcommit policy refuses the size.
	ErrNoSpace = errors.New("not enough space in store")
	// ErrBusy: the volume is mounted or open and the operation was refused.
	ErrBusy = errors.New("volume in use")
	// ErrNotReady: the volume exists but an earlier create did not finish.
	ErrNotReady = errors.New("volume not ready")
	// ErrMismatch: a device does not hold what the volume says it holds
	// (its own filesystem, its own partition table); nothing was changed.
	ErrMismatch = errors.New("volume content does not match its metadata")
)

// Mode is how a volume is consumed.
type Mode string

const (
	ModeFilesystem Mode = "filesystem"
	ModeBlock      Mode = "block"
)

// State records how far a volume's lifecycle got, so that a crash at any
// step is finished or cleaned up by the next run.
type State string

const (
	StateCreating State = "creating"
	StateReady    State = "ready"
	StateDeleting State = "deleting"
)

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
	// ExpandingTo is set while an expansion is in progress; a rerun of
	// expand (or attach) finishes it.
	ExpandingTo int64 `json:"expandingTo,omitempty"`
	// BackingDev and BackingInode record the backing file's identity, so a
	// device still bound to the file after it was removed can be found.
	BackingDev   uint64 `json:"backingDev,omitempty"`
	BackingInode uint64 `json:"backingInode,omitempty"`
	// Labels carry caller-owned annotations (the CSI driver keeps the
	// request name and parameters here).
	Labels map[string]string `json:"labels,omitempty"`
}

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

var uuidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// ValidUUID reports whether s is a canonical lower-case UUID.
func ValidUUID(s string) bool { return uuidRE.MatchString(s) }

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

// ValidateName checks a volume name: what may become part of a unit name,
// a label or a path component without quoting surprises.
func ValidateName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("name is empty: %w", ErrInvalid)
	case len(name) > 253:
		return fmt.Errorf("name is %d characters, at most 253 allowed: %w", len(name), ErrInvalid)
	case name == "." || strings.Contains(name, ".."):
		return fmt.Errorf("name %q contains \"..\": %w", name, ErrInvalid)
	case strings.HasPrefix(name, "."):
		return fmt.Errorf("name %q starts with a dot: %w", name, ErrInvalid)
	}
	for _, r := range name {
		switch {
		case r == '/':
			return fmt.Errorf("name %q contains \"/\": %w", name, ErrInvalid)
		case r == 0:
			return fmt.Errorf("name contains a NUL byte: %w", ErrInvalid)
		case r == ' ' || r == '\t' || r == '\n' || r < 0x20 || r == 0x7f:
			return fmt.Errorf("name %q contains spaces or control characters: %w", name, ErrInvalid)
		}
	}
	return nil
}

// ParseSize parses bytes or a number with K/M/G/T or Ki/Mi/Gi/Ti (both
// powers of 1024, optionally followed by B). Zero and negative sizes are
// rejected.
func ParseSize(s string) (int64, error) {
	in := strings.TrimSpace(s)
	num := strings.TrimRight(in, "KMGTPkmgtpiBb")
	unit := strings.ToUpper(strings.TrimSuffix(strings.TrimSuffix(in[len(num):], "B"), "b"))
	unit = strings.TrimSuffix(unit, "I")
	shift := map[string]uint{"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50}
	sh, ok := shift[unit]
	if !ok || num == "" {
		return 0, fmt.Errorf("size %q: want bytes or a number with K, M, G, T (or Ki, Mi, Gi, Ti): %w", s, ErrInvalid)
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, fmt.Errorf("size %q is not a number: %w", s, ErrInvalid)
	}
	if v <= 0 {
		return 0, fmt.Errorf("size %q must be positive: %w", s, ErrInvalid)
	}
	bytes := v * float64(uint64(1)<<sh)
	if bytes > float64(math.MaxInt64/2) {
		return 0, fmt.Errorf("size %q is too large: %w", s, ErrInvalid)
	}
	return int64(math.Ceil(bytes)), nil
}

// RoundUpMiB rounds a size up to a whole MiB.
func RoundUpMiB(n int64) int64 { return (n + MiB - 1) / MiB * MiB }

// MinSize returns the smallest size allowed for a filesystem ("" for raw).
func MinSize(fsType string) int64 { return minSize[fsType] }

// FormatSize renders bytes with the largest exact binary unit.
func FormatSize(n int64) string {
	units := []string{"Ti", "Gi", "Mi", "Ki"}
	for i, u := range units {
		div := int64(1) << (10 * uint(4-i))
		if n >= div && n%div == 0 {
			return fmt.Sprintf("%d%s", n/div, u)
		}
	}
	return strconv.FormatInt(n, 10)
}

func (v *Volume) backingID() loop.FileID {
	return loop.FileID{Dev: v.BackingDev, Inode: v.BackingInode}
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
