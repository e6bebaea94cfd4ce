// Package iolimit enforces per-device I/O limits with the cgroup v2 io
// controller: one io.max entry, keyed by a block device's major:minor, on
// the cgroup that holds all pods (kubepods). Since every volume has a loop
// device of its own, such an entry limits the volume for every pod that
// uses it, whoever that is (docs/design.md says why this cgroup and not
// per-pod ones).
//
// The package knows nothing of volumes: it is given device numbers and
// limits, checks the limits, and converges the cgroup's io.max to them.
package iolimit

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
)

var (
	// ErrInvalid marks limits refused before anything was written.
	ErrInvalid = errors.New("invalid I/O limit")
	// ErrNotSupported: the host cannot enforce limits (cgroup v1 or
	// hybrid, or a cgroup v2 without the io controller). Never a silent
	// no-op: setting a limit there fails with it.
	ErrNotSupported = errors.New("I/O limits not supported on this host")
)

// The largest limits the kernel's blk-throttle takes as limits: its
// IOPS limits are 32-bit and UINT_MAX means none; byte rates are 64-bit
// and bounded here like the store's sizes, so arithmetic on them cannot
// overflow.
const (
	MaxIOPS = math.MaxUint32 - 1
	MaxBPS  = math.MaxInt64 / 2
)

// Limits are the I/O limits of one device. Zero means no limit.
type Limits struct {
	ReadBPS   uint64 `json:"readBytesPerSecond,omitempty"`
	WriteBPS  uint64 `json:"writeBytesPerSecond,omitempty"`
	ReadIOPS  uint64 `json:"readIOPS,omitempty"`
	WriteIOPS uint64 `json:"writeIOPS,omitempty"`
}

// IsZero reports whether l limits nothing.
func (l Limits) IsZero() bool { return l == Limits{} }

// Validate checks that each limit is one the kernel enforces as given.
// Errors wrap ErrInvalid.
func (l Limits) Validate() error {
	for _, f := range l.fields() {
		if f.v > f.max {
			return fmt.Errorf("%s %d is beyond the largest limit, %d: %w", f.key, f.v, f.max, ErrInvalid)
		}
	}
	return nil
}

type field struct {
	key string // io.max key
	v   uint64
	max uint64
}

func (l Limits) fields() []field {
	return []field{
		{"rbps", l.ReadBPS, MaxBPS},
		{"wbps", l.WriteBPS, MaxBPS},
		{"riops", l.ReadIOPS, MaxIOPS},
		{"wiops", l.WriteIOPS, MaxIOPS},
	}
}

// ParseIOPS parses an IOPS limit: a positive decimal integer no longer
// than MaxIOPS written out, or "max" for none (0). Errors wrap
// ErrInvalid; an overlong value is not echoed.
func ParseIOPS(s string) (uint64, error) {
	if s == "max" {
		return 0, nil
	}
	if len(s) > len(strconv.FormatUint(MaxIOPS, 10)) {
		return 0, fmt.Errorf("IOPS value of %d bytes: want a positive whole number up to %d, or max for no limit: %w", len(s), uint64(MaxIOPS), ErrInvalid)
	}
	if s == "" || strings.Trim(s, "0123456789") != "" {
		return 0, fmt.Errorf("IOPS %q: want a positive whole number, or max for no limit: %w", s, ErrInvalid)
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil || n > MaxIOPS {
		return 0, fmt.Errorf("IOPS %q: at most %d: %w", s, uint64(MaxIOPS), ErrInvalid)
	}
	if n == 0 {
		return 0, fmt.Errorf("IOPS %q: a limit of 0 would stop all I/O; want a positive number, or max for no limit: %w", s, ErrInvalid)
	}
	return n, nil
}

// line is the io.max line that sets exactly l for device dev (major:minor
// from unix.Major and unix.Minor: loop minors pass 255).
func (l Limits) line(major, minor uint32) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d:%d", major, minor)
	for _, f := range l.fields() {
		b.WriteString(" " + f.key + "=")
		if f.v == 0 {
			b.WriteString("max")
		} else {
			b.WriteString(strconv.FormatUint(f.v, 10))
		}
	}
	return b.String()
}

// parseLine reads one io.max line ("MAJ:MIN key=value ..."); keys it does
// not know are ignored, whatever their value.
func parseLine(s string) (major, minor uint32, l Limits, err error) {
	words := strings.Fields(s)
	if len(words) == 0 {
		return 0, 0, l, fmt.Errorf("empty io.max line")
	}
	majS, minS, ok := strings.Cut(words[0], ":")
	maj, err1 := strconv.ParseUint(majS, 10, 32)
	min, err2 := strconv.ParseUint(minS, 10, 32)
	if !ok || err1 != nil || err2 != nil {
		return 0, 0, l, fmt.Errorf("io.max line %q: no device number", s)
	}
	dst := map[string]*uint64{"rbps": &l.ReadBPS, "wbps": &l.WriteBPS, "riops": &l.ReadIOPS, "wiops": &l.WriteIOPS}
	for _, w := range words[1:] {
		k, v, ok := strings.Cut(w, "=")
		p := dst[k]
		if !ok || p == nil || v == "max" {
			continue
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return 0, 0, Limits{}, fmt.Errorf("io.max line %q: %s: %w", s, w, err)
		}
		*p = n
	}
	return uint32(maj), uint32(min), l, nil
}
