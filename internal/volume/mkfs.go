package volume

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Extra mkfs options are an allow-list per filesystem: what tunes the
// filesystem mkfs makes on the volume's own device (block and inode sizes,
// features, stripe geometry, lazy initialisation, the size of an internal
// log, a label). Anything else is refused with ErrInvalid before anything
// is made, in particular what names a host path or device (mke2fs -d, -z,
// -M; mkfs.xfs -d name=, -l logdev=, -r, -p, -c), what changes the
// filesystem's identity (-U, -m uuid=: the filesystem UUID is the volume
// UUID), what makes no filesystem (mke2fs -n, -S, -O journal_dev; mkfs.xfs
// -N) and what mkfs would read as a device or size operand.
//
// Options are tokenised once, on white space (one --mkfs-option may hold
// several). An option is a token of its own: attached values (-b4096,
// -Urandom, -muuid=...) are refused, so that no value can hide an option.

// maxMkfsToken bounds one token of mkfs options: every allowed option and
// value fits, and a refusal echoing a token stays short.
const maxMkfsToken = 1024

// mkfsOption is one allowed option; value checks its argument (nil: the
// option takes none).
type mkfsOption struct {
	value func(string) error
}

// mkfsRefused explains options that are refused on purpose.
var mkfsRefused = map[string]map[string]string{
	"ext4": {
		"-U": "would change the filesystem UUID, which is the volume UUID",
		"-n": "makes no filesystem (dry run)",
		"-S": "writes superblocks only and makes no usable filesystem",
		"-d": "copies a host directory into the volume",
		"-z": "writes an undo file on the host",
		"-M": "names a host path",
		"-l": "reads a bad blocks list from a host file",
		"-c": "scans the device for bad blocks",
		"-t": "would change the filesystem type",
		"-r": "would change the filesystem revision",
		"-o": "would change the creator OS",
		"-F": "is given already",
		"-q": "is given already",
	},
	"xfs": {
		"-N": "makes no filesystem (dry run)",
		"-p": "reads a protofile from the host",
		"-r": "puts data on a host realtime device",
		"-c": "reads a config file from the host",
		"-f": "is given already",
		"-q": "is given already",
	},
}

// mkfsAllowed is the allow-list: option -> its argument's grammar.
var mkfsAllowed = map[string]map[string]mkfsOption{
	"ext4": {
		"-b": {powerOfTwo(1024, 65536)},
		"-C": {powerOfTwo(1024, 1<<28)},
		"-e": {ext4Errors},
		"-E": {subOptions("extended option", ext4Extended, nil)},
		"-g": {multipleOf(8, 256, 65528)},
		"-G": {powerOfTwo(1, 1<<31)},
		"-i": {uintIn(1024, 1<<26)},
		"-I": {powerOfTwo(128, 65536)},
		"-j": {},
		"-J": {subOptions("journal option", map[string]func(string) error{
			"size":             uintIn(1, 10240),
			"fast_commit_size": uintIn(1, 10240),
		}, map[string]string{
			"device":   "puts the journal on a host device",
			"location": "places the journal explicitly",
		})},
		"-L": {label(16)},
		"-m": {percent},
		"-N": {uintIn(1, 1<<32-1)},
		"-O": {ext4Features},
		"-T": {listOf("usage type", "floppy", "small", "default", "big", "huge", "news", "largefile", "largefile4", "hurd")},
	},
	"xfs": {
		"-b": {subOptions("block option", map[string]func(string) error{
			"size": powerOfTwo(512, 65536),
		}, nil)},
		"-d": {subOptions("data option", map[string]func(string) error{
			"su":      xfsSize,
			"sw":      uintIn(1, 1<<16),
			"sunit":   uintIn(0, 1<<31),
			"swidth":  uintIn(0, 1<<31),
			"agcount": uintIn(1, 1<<31),
			"agsize":  xfsSize,
			"noalign": optional(boolish),
		}, map[string]string{
			"name":      "names a host file or device",
			"file":      "makes the data section a host file",
			"size":      "would make the filesystem smaller than the volume",
			"rtinherit": "needs a realtime device",
		})},
		"-i": {subOptions("inode option", map[string]func(string) error{
			"size":        powerOfTwo(256, 2048),
			"maxpct":      uintIn(0, 100),
			"align":       boolish,
			"sparse":      boolish,
			"nrext64":     boolish,
			"projid32bit": boolish,
			"attr":        oneOf("2"),
		}, nil)},
		"-l": {subOptions("log option", map[string]func(string) error{
			"size":       xfsSize,
			"lazy-count": boolish,
			"version":    oneOf("1", "2"),
			"su":         xfsSize,
			"sunit":      uintIn(0, 1<<31),
			"internal":   oneOf("1"),
		}, map[string]string{
			"logdev":   "puts the log on a host device",
			"name":     "puts the log on a host file or device",
			"file":     "puts the log in a host file",
			"internal": "would need an external log on a host device",
		})},
		"-m": {subOptions("metadata option", map[string]func(string) error{
			"crc":        boolish,
			"reflink":    boolish,
			"finobt":     boolish,
			"bigtime":    boolish,
			"rmapbt":     boolish,
			"inobtcount": boolish,
		}, map[string]string{
			"uuid": "would change the filesystem UUID, which is the volume UUID",
		})},
		"-n": {subOptions("naming option", map[string]func(string) error{
			"size":    powerOfTwo(512, 65536),
			"ftype":   boolish,
			"version": oneOf("2", "ci"),
		}, nil)},
		"-s": {subOptions("sector option", map[string]func(string) error{
			"size": powerOfTwo(512, 32768),
		}, nil)},
		"-K": {},
		"-L": {label(12)},
	},
}

// Ext4ErrorBehaviors are the only ext4 error behaviours a volume may be
// given, by mkfs -e or by the errors= mount option (package csi's mount
// allow-list): never panic. On a thin, overcommitted store a full backing
// file surfaces as ext4 errors, and a volume's errors must not panic the
// node's kernel.
var Ext4ErrorBehaviors = []string{"continue", "remount-ro"}

// ext4Errors checks the value of mkfs -e against Ext4ErrorBehaviors.
func ext4Errors(v string) error {
	if v == "panic" {
		return fmt.Errorf("panic is refused: a volume's filesystem errors (a full thin store makes them) must not panic the node; want one of %s",
			strings.Join(Ext4ErrorBehaviors, ", "))
	}
	return oneOf(Ext4ErrorBehaviors...)(v)
}

var ext4Extended = map[string]func(string) error{
	"stride":                   uintIn(1, 1<<31),
	"stripe_width":             uintIn(1, 1<<31),
	"stripe-width":             uintIn(1, 1<<31),
	"resize":                   uintIn(1, 1<<32-1),
	"lazy_itable_init":         optional(boolish),
	"lazy_journal_init":        optional(boolish),
	"packed_meta_blocks":       optional(boolish),
	"assume_storage_prezeroed": optional(boolish),
	"nodiscard":                none,
	"num_backup_sb":            oneOf("0", "1", "2"),
	"root_owner":               optional(uidGid),
	"quotatype":                colonList("quota type", "usrquota", "grpquota", "prjquota"),
	"orphan_file_size":         uintIn(1, 1<<31),
	"mmp_update_interval":      uintIn(0, 300),
	"encoding":                 oneOf("utf8", "utf8-12.1"),
	"encoding_flags":           oneOf("strict"),
}

// ext4FeatureNames are the features -O may set or (with ^) clear.
var ext4FeatureNames = []string{
	"64bit", "bigalloc", "casefold", "dir_index", "dir_nlink", "ea_inode",
	"encrypt", "ext_attr", "extent", "extents", "extra_isize", "fast_commit",
	"filetype", "flex_bg", "has_journal", "huge_file", "inline_data",
	"large_dir", "large_file", "meta_bg", "metadata_csum", "metadata_csum_seed",
	"mmp", "orphan_file", "project", "quota", "resize_inode", "sparse_super",
	"sparse_super2", "stable_inodes", "uninit_bg", "verity",
}

// NormalizeMkfsOptions checks extra mkfs arguments for fsType against the
// allow-list and returns them as the tokens mkfs will get (nil for none).
// Refusals wrap ErrInvalid and name the option and why.
func NormalizeMkfsOptions(fsType string, opts []string) ([]string, error) {
	tokens := mkfsTokens(opts)
	if len(tokens) == 0 {
		return nil, nil
	}
	allowed, ok := mkfsAllowed[fsType]
	if !ok {
		return nil, fmt.Errorf("mkfs options cannot be given for %s: %w", kindName(fsType), ErrInvalid)
	}
	for _, tok := range tokens {
		if len(tok) > maxMkfsToken {
			return nil, fmt.Errorf("mkfs option %s is %d bytes long, at most %d: %w", Quote(tok), len(tok), maxMkfsToken, ErrInvalid)
		}
	}
	for i := 0; i < len(tokens); i++ {
		tok := tokens[i]
		opt, ok := allowed[tok]
		if !ok {
			return nil, fmt.Errorf("mkfs option %s for %s: %s: %w", Quote(tok), fsType, whyRefused(fsType, tok), ErrInvalid)
		}
		if opt.value == nil {
			continue
		}
		if i+1 == len(tokens) {
			return nil, fmt.Errorf("mkfs option %s for %s needs a value: %w", tok, fsType, ErrInvalid)
		}
		i++
		err := checkValue(tokens[i])
		if err == nil {
			err = opt.value(tokens[i])
		}
		if err != nil {
			return nil, fmt.Errorf("mkfs option %s %s for %s: %v: %w", tok, Quote(tokens[i]), fsType, err, ErrInvalid)
		}
	}
	return tokens, nil
}

// mkfsTokens splits each option on white space, as mkfs gets them.
func mkfsTokens(opts []string) []string {
	var tokens []string
	for _, o := range opts {
		tokens = append(tokens, strings.Fields(o)...)
	}
	return tokens
}

func kindName(fsType string) string {
	if fsType == "" {
		return "block volumes"
	}
	return fsType
}

// whyRefused explains a token that is not an allowed option.
func whyRefused(fsType, tok string) string {
	switch {
	case strings.ContainsRune(tok, '/'):
		return "names a host path"
	case !strings.HasPrefix(tok, "-") || tok == "-":
		return "is not an option (mkfs would take it for the device or the size)"
	case strings.HasPrefix(tok, "--"):
		return "long options are not allowed"
	}
	if why, ok := mkfsRefused[fsType][tok]; ok {
		return why
	}
	if len(tok) > 2 {
		why := "write " + tok[:2] + " " + tok[2:]
		if r, ok := mkfsRefused[fsType][tok[:2]]; ok {
			why = tok[:2] + " " + r
		} else if opt, ok := mkfsAllowed[fsType][tok[:2]]; ok && opt.value != nil {
			if err := opt.value(tok[2:]); err != nil {
				why = err.Error()
			}
		}
		return fmt.Sprintf("attached values are not accepted (%s)", why)
	}
	return "not an allowed option (" + allowedList(fsType) + ")"
}

func allowedList(fsType string) string {
	var names []string
	for name := range mkfsAllowed[fsType] {
		names = append(names, name)
	}
	slices.Sort(names)
	return "allowed: " + strings.Join(names, " ")
}

// checkValue refuses what no value of an allowed option contains: paths,
// and a leading '-' that reads like an option.
func checkValue(v string) error {
	switch {
	case strings.ContainsRune(v, '/'):
		return fmt.Errorf("names a host path")
	case strings.HasPrefix(v, "-"):
		return fmt.Errorf("is an option, not a value")
	}
	return nil
}

// subOptions checks a comma-separated key[=value] list: each key allowed
// (its check gets the value, "" when there is none), or refused with a
// reason.
func subOptions(what string, keys map[string]func(string) error, refused map[string]string) func(string) error {
	return func(v string) error {
		seen := map[string]bool{}
		for _, item := range strings.Split(v, ",") {
			key, val, hasVal := strings.Cut(item, "=")
			check, ok := keys[key]
			if why, bad := refused[key]; bad && (!ok || check(val) != nil) {
				return fmt.Errorf("%s %s is refused: it %s", what, item, why)
			}
			if !ok {
				return fmt.Errorf("%s %q is not allowed", what, key)
			}
			if seen[key] {
				return fmt.Errorf("%s %q given twice", what, key)
			}
			seen[key] = true
			if hasVal && val == "" {
				return fmt.Errorf("%s %s has an empty value", what, key)
			}
			if err := check(val); err != nil {
				return fmt.Errorf("%s %s: %v", what, key, err)
			}
		}
		return nil
	}
}

func none(v string) error {
	if v != "" {
		return fmt.Errorf("takes no value")
	}
	return nil
}

func optional(check func(string) error) func(string) error {
	return func(v string) error {
		if v == "" {
			return nil
		}
		return check(v)
	}
}

func boolish(v string) error { return oneOf("0", "1")(v) }

func oneOf(vals ...string) func(string) error {
	return func(v string) error {
		for _, ok := range vals {
			if v == ok {
				return nil
			}
		}
		return fmt.Errorf("want one of %s", strings.Join(vals, ", "))
	}
}

func listOf(what string, vals ...string) func(string) error {
	one := oneOf(vals...)
	return func(v string) error {
		for _, item := range strings.Split(v, ",") {
			if err := one(item); err != nil {
				return fmt.Errorf("%s %q: %v", what, item, err)
			}
		}
		return nil
	}
}

func colonList(what string, vals ...string) func(string) error {
	one := oneOf(vals...)
	return func(v string) error {
		for _, item := range strings.Split(v, ":") {
			if err := one(item); err != nil {
				return fmt.Errorf("%s %q: %v", what, item, err)
			}
		}
		return nil
	}
}

// parseUint accepts decimal digits only (no sign, prefix or separator).
func parseUint(v string) (uint64, error) {
	if v == "" || len(v) > 19 || strings.TrimLeft(v, "0123456789") != "" {
		return 0, fmt.Errorf("want a decimal number")
	}
	return strconv.ParseUint(v, 10, 64)
}

func uintIn(lo, hi uint64) func(string) error {
	return func(v string) error {
		n, err := parseUint(v)
		if err != nil {
			return err
		}
		if n < lo || n > hi {
			return fmt.Errorf("want %d to %d", lo, hi)
		}
		return nil
	}
}

func powerOfTwo(lo, hi uint64) func(string) error {
	return func(v string) error {
		n, err := parseUint(v)
		if err != nil {
			return err
		}
		if n < lo || n > hi || n&(n-1) != 0 {
			return fmt.Errorf("want a power of two from %d to %d", lo, hi)
		}
		return nil
	}
}

func multipleOf(m, lo, hi uint64) func(string) error {
	return func(v string) error {
		n, err := parseUint(v)
		if err != nil {
			return err
		}
		if n < lo || n > hi || n%m != 0 {
			return fmt.Errorf("want a multiple of %d from %d to %d", m, lo, hi)
		}
		return nil
	}
}

// xfsSize is a byte count with an optional k, m, g or t (either case).
func xfsSize(v string) error {
	num := strings.TrimRight(v, "kmgtKMGT")
	if len(v)-len(num) > 1 {
		return fmt.Errorf("want a number with at most one of k, m, g, t")
	}
	n, err := parseUint(num)
	if err != nil || n == 0 || n > 1<<40 {
		return fmt.Errorf("want a positive number with an optional k, m, g or t")
	}
	return nil
}

// percent is mke2fs -m: a reserved percentage, 0 to 50, with an optional
// fraction.
func percent(v string) error {
	whole, frac, hasFrac := strings.Cut(v, ".")
	n, err := parseUint(whole)
	if err == nil && hasFrac {
		_, err = parseUint(frac)
	}
	if err != nil || n > 50 || (n == 50 && hasFrac && strings.Trim(frac, "0") != "") {
		return fmt.Errorf("want a percentage from 0 to 50")
	}
	return nil
}

func uidGid(v string) error {
	uid, gid, ok := strings.Cut(v, ":")
	if !ok {
		return fmt.Errorf("want uid:gid")
	}
	if _, err := parseUint(uid); err != nil {
		return fmt.Errorf("want uid:gid")
	}
	if _, err := parseUint(gid); err != nil {
		return fmt.Errorf("want uid:gid")
	}
	return nil
}

// label is a filesystem label of ASCII letters, digits, '.', '_' and '-',
// starting with a letter or digit.
func label(max int) func(string) error {
	return func(v string) error {
		if v == "" || len(v) > max {
			return fmt.Errorf("want 1 to %d characters", max)
		}
		for i := 0; i < len(v); i++ {
			if !nameByte(v[i]) || (i == 0 && (v[i] == '-' || v[i] == '.')) {
				return fmt.Errorf("want ASCII letters, digits, '.', '_' and '-', starting with a letter or digit")
			}
		}
		return nil
	}
}

func ext4Features(v string) error {
	if v == "none" {
		return nil
	}
	for _, f := range strings.Split(v, ",") {
		name := strings.TrimPrefix(f, "^")
		if name == "journal_dev" {
			return fmt.Errorf("feature journal_dev makes a journal device, not a filesystem")
		}
		if err := oneOf(ext4FeatureNames...)(name); err != nil {
			return fmt.Errorf("feature %q is not known", f)
		}
	}
	return nil
}

// mkfsCommand returns the program and arguments that write v's filesystem
// or partition table on device, whose UUID is the volume UUID ("" for a
// whole-device raw volume, which holds nothing but zeroes). v.MkfsOptions
// were checked by NormalizeMkfsOptions when the volume was made; the
// options that make the identity come first and are never overridden.
func mkfsCommand(v *Volume, device string) (string, []string) {
	var prog string
	var args []string
	switch {
	case v.FSType == "ext4":
		prog = "mkfs.ext4"
		args = []string{"-q", "-F", "-U", v.UUID}
		// mke2fs takes the last -E only: merge them, so that a thick
		// volume's nodiscard survives the caller's extended options.
		var extended []string
		tokens := mkfsTokens(v.MkfsOptions)
		for i := 0; i < len(tokens); i++ {
			if tokens[i] == "-E" && i+1 < len(tokens) {
				extended = append(extended, tokens[i+1])
				i++
				continue
			}
			args = append(args, tokens[i])
		}
		if v.Preallocate {
			extended = append(extended, "nodiscard")
		}
		if len(extended) > 0 {
			args = append(args, "-E", strings.Join(extended, ","))
		}
	case v.FSType == "xfs":
		prog = "mkfs.xfs"
		args = []string{"-q", "-f", "-m", "uuid=" + v.UUID}
		if v.Preallocate {
			args = append(args, "-K")
		}
		args = append(args, mkfsTokens(v.MkfsOptions)...)
	case v.Partitioned:
		prog = "sgdisk"
		args = []string{"--clear", "--new=1:0:0", "--partition-guid=1:" + v.UUID,
			"--typecode=1:8300", "--change-name=1:" + partitionName}
	default:
		return "", nil
	}
	return prog, append(args, device)
}

// mkfsFileCommand is mkfsCommand for v's backing file instead of its
// device. mkfs takes the sector size from a device, and a filesystem
// volume's device has FilesystemBlockSize sectors: for the file it is
// given (ext4 -b, XFS -s), which makes the same filesystem. ok is false
// for other volumes and where v's own options set that size, which the
// device checks against its sectors (a file would take any).
func mkfsFileCommand(v *Volume, path string) (prog string, args []string, ok bool) {
	if v.Mode != ModeFilesystem || v.BlockSize != FilesystemBlockSize {
		return "", nil, false
	}
	var size []string
	switch {
	case v.FSType == "ext4" && !slices.Contains(mkfsTokens(v.MkfsOptions), "-b"):
		size = []string{"-b", strconv.Itoa(FilesystemBlockSize)}
	case v.FSType == "xfs" && !slices.Contains(mkfsTokens(v.MkfsOptions), "-s"):
		size = []string{"-s", "size=" + strconv.Itoa(FilesystemBlockSize)}
	default:
		return "", nil, false
	}
	prog, args = mkfsCommand(v, path)
	if prog == "" {
		return "", nil, false
	}
	last := len(args) - 1
	return prog, append(append(args[:last:last], size...), args[last]), true
}
