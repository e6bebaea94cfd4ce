package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/udev"
)

// miniUdev plays udevd for the store's tests, where no udevd runs: it
// hears the kernel's uevents for loop devices and writes a database entry
// for each into dir/data, as udevd with deploy/udev's rule would. Where
// rule says the rule is in effect for the event, the entry names the
// binding (SPARSEVOL_DISKSEQ) and holds the binding's identity file if
// the event finds it; else it holds what a probe found (a forged UUID).
// rule is told whether a process asked for the event through sysfs (as
// udev.Change does) and how many such events of the device came before.
// An event the kernel sent finds the identity file only with wait (it
// waits for it, as udev does that gets to the event after attach wrote
// the file); without, the file was not there yet.
type miniUdev struct {
	dir      udev.Dir
	identity string // Options.UdevIdentityDir
	rule     func(asked bool, before int) bool
	wait     bool
	mu       sync.Mutex
	asked    map[string]int // events asked for, per device
}

func startMiniUdev(t *testing.T, identity string, wait bool, rule func(asked bool, before int) bool) *miniUdev {
	t.Helper()
	m := &miniUdev{dir: udev.Dir(t.TempDir()), identity: identity, rule: rule, wait: wait, asked: map[string]int{}}
	if err := os.MkdirAll(filepath.Join(string(m.dir), "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(string(m.dir), "control"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	sock, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_KOBJECT_UEVENT)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(sock, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: 1}); err != nil {
		unix.Close(sock)
		t.Fatal(err)
	}
	tv := unix.NsecToTimeval((100 * time.Millisecond).Nanoseconds())
	if err := unix.SetsockoptTimeval(sock, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		buf := make([]byte, 64<<10)
		for {
			select {
			case <-done:
				return
			default:
			}
			n, _, err := unix.Recvfrom(sock, buf, 0)
			if err != nil {
				continue
			}
			m.handle(strings.Split(string(buf[:n]), "\x00"))
		}
	}()
	t.Cleanup(func() { close(done); <-stopped; unix.Close(sock) })
	return m
}

func (m *miniUdev) handle(fields []string) {
	env := map[string]string{}
	for _, f := range fields[1:] {
		if k, v, ok := strings.Cut(f, "="); ok {
			env[k] = v
		}
	}
	name := env["DEVNAME"]
	if env["SUBSYSTEM"] != "block" || !strings.HasPrefix(name, "loop") || (env["ACTION"] != "add" && env["ACTION"] != "change") {
		return
	}
	_, asked := env["SYNTH_UUID"]
	m.mu.Lock()
	before := m.asked[name]
	if asked {
		m.asked[name]++
	}
	m.mu.Unlock()
	entry := fmt.Sprintf("E:DEVNAME=/dev/%s\n", name)
	file := filepath.Join(m.identity, env["DISKSEQ"])
	for deadline := time.Now().Add(100 * time.Millisecond); m.wait && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if _, err := os.Stat(file); err == nil {
			break
		}
	}
	b, err := os.ReadFile(file)
	switch {
	case !m.rule(asked, before):
		entry += "E:ID_FS_TYPE=ext4\nE:ID_FS_UUID=forged\n"
	case err == nil && (asked || m.wait):
		entry += "E:SPARSEVOL_DISKSEQ=" + env["DISKSEQ"] + "\n"
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			entry += "E:" + line + "\n"
		}
		entry += "E:SPARSEVOL_IDENTITY=store\n"
	default:
		entry += "E:SPARSEVOL_DISKSEQ=" + env["DISKSEQ"] + "\nE:ID_FS_TYPE=ext4\nE:ID_FS_UUID=forged\n"
	}
	path := filepath.Join(string(m.dir), "data", "b"+env["MAJOR"]+":"+env["MINOR"])
	os.WriteFile(path+".tmp", []byte(entry), 0o644)
	os.Rename(path+".tmp", path)
}

// askedFor is how many events of the device name a process asked for.
func (m *miniUdev) askedFor(name string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.asked[name]
}

// An attach of a raw volume returns once udev's record of the binding is
// the store's identity: at once where udev read the identity file, after a
// change event where udev probed before the file was there (or before it
// read the rule), and never where udev keeps probing: the attach fails,
// naming the rule, and leaves nothing bound.
func TestSettleIdentity(t *testing.T) {
	defer func(d time.Duration) { retryIdentity = d }(retryIdentity)
	retryIdentity = 200 * time.Millisecond
	tests := []struct {
		name string
		wait bool
		rule func(asked bool, before int) bool
		// asks is how many change events the attach asks for.
		asks    int
		wantErr bool
	}{
		{"file there first", true, func(bool, int) bool { return true }, 0, false},
		{"udev probed first", false, func(bool, int) bool { return true }, 1, false},
		{"rule read late", false, func(asked bool, before int) bool { return asked && before > 0 }, 2, false},
		{"no rule", false, func(bool, int) bool { return false }, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			identity := filepath.Join(t.TempDir(), "identity")
			m := startMiniUdev(t, identity, tt.wait, tt.rule)
			s := newStore(t, Options{UdevIdentityDir: identity, Udev: m.dir, UdevTimeout: 5 * time.Second})
			mustCreate(t, s, CreateRequest{Name: "raw", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
			st, err := s.Attach(ctx, "raw")
			if tt.wantErr {
				if err == nil || !strings.Contains(err.Error(), "59-sparsevol.rules") || !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("Attach with udev probing for good = %v; want the deadline, naming the rule", err)
				}
				if st, err := s.Status("raw"); err != nil || st.Attached {
					t.Errorf("a failed attach left the volume attached: %+v, %v", st, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			name := filepath.Base(st.Device)
			rec, ok, err := m.dir.Record(name)
			if err != nil || !ok || rec["SPARSEVOL_IDENTITY"] != "store" || rec["ID_FS_UUID"] != "" {
				t.Errorf("udev's record after the attach: %v %v %v; want the store's identity, no probed UUID", rec, ok, err)
			}
			if got := m.askedFor(name); got != tt.asks {
				t.Errorf("the attach asked for %d change events of %s, want %d", got, name, tt.asks)
			}
			if err := s.Delete(ctx, "raw", DetachOptions{}); err != nil {
				t.Error(err)
			}
		})
	}
}

// The store looks whether udev runs where it attaches, not once when it
// opens: a udevd that starts after Open (its control socket appears) gets
// the rule at the next attach, and one that restarted with an empty
// runtime directory gets it again; where udev does not run, no rule is
// written.
func TestUdevRuleWhenUdevStarts(t *testing.T) {
	ctx := context.Background()
	dir := udev.Dir(t.TempDir())
	control := filepath.Join(string(dir), "control")
	rule := filepath.Join(string(dir), "rules.d", "59-test.rules")
	// A raw volume without identity files: its attach waits for no link
	// and no record of udev's, which plays no part here.
	s := newStore(t, Options{Udev: dir, UdevRuleName: "59-test.rules", UdevRule: []byte("RULE\n")})
	mustCreate(t, s, CreateRequest{Name: "fs", SizeBytes: 16 << 20, Mode: ModeBlock, NoPartition: true})
	t.Cleanup(func() { s.Delete(ctx, "fs", DetachOptions{}) })
	steps := []struct {
		name    string
		running bool
		wipe    bool // udev's runtime directory starts empty
	}{
		{"udev not running yet", false, false},
		{"udev started", true, false},
		{"udev stopped", false, true},
		{"udev restarted", true, false},
	}
	for _, step := range steps {
		if step.wipe {
			if err := os.RemoveAll(filepath.Join(string(dir), "rules.d")); err != nil {
				t.Fatal(err)
			}
		}
		if step.running {
			if err := os.WriteFile(control, nil, 0o600); err != nil {
				t.Fatal(err)
			}
		} else if err := os.Remove(control); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		if _, err := s.Attach(ctx, "fs"); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		got, err := os.ReadFile(rule)
		switch {
		case step.running && (err != nil || string(got) != "RULE\n"):
			t.Errorf("%s: rule %q, %v; want it installed", step.name, got, err)
		case !step.running && !os.IsNotExist(err):
			t.Errorf("%s: a rule where udev does not run: %q, %v", step.name, got, err)
		}
	}
}

// The store looks for udev in Options.Udev, the node's runtime directory
// where this process sees it, never at udev.Host: the plugin's container
// mounts the node's elsewhere, and its own /run/udev is empty. Where udev
// runs in Options.Udev, attach waits for udev's stable link of a
// filesystem volume (here none comes: the test's udev is a control file);
// where it does not, attach waits for nothing.
func TestUdevLookedForInOptions(t *testing.T) {
	if udev.Host.Running() {
		t.Skip("udev runs on this host: " + string(udev.Host) + " has its control socket")
	}
	ctx := context.Background()
	for _, tt := range []struct {
		name    string
		running bool
	}{
		{"udev runs in Options.Udev", true},
		{"udev does not run", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := udev.Dir(t.TempDir())
			if tt.running {
				if err := os.WriteFile(filepath.Join(string(dir), "control"), nil, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			s := newStore(t, Options{Udev: dir, UdevTimeout: 300 * time.Millisecond})
			v := mustCreate(t, s, CreateRequest{Name: "fs", SizeBytes: 16 << 20})
			t.Cleanup(func() { s.Delete(ctx, "fs", DetachOptions{}) })
			_, err := s.Attach(ctx, "fs")
			switch {
			case tt.running && (!errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), v.StablePath())):
				t.Errorf("Attach where udev runs = %v; want it to wait for %s until the deadline", err, v.StablePath())
			case !tt.running && err != nil:
				t.Errorf("Attach where udev does not run = %v", err)
			}
		})
	}
}

// A record of the binding that imported an identity file is the store's
// only where that file was the volume's own (SPARSEVOL_VOLUME): a file
// that names another volume (put there by someone who can write the
// identity directory, or left from elsewhere) gives the device another
// identity, and the attach does not take it for the store's.
func TestSettleIdentityNamesTheVolume(t *testing.T) {
	defer func(d time.Duration) { retryIdentity = d }(retryIdentity)
	retryIdentity = 50 * time.Millisecond
	dir := udev.Dir(t.TempDir())
	if err := os.MkdirAll(filepath.Join(string(dir), "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(string(dir), "control"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	s := newStore(t, Options{Udev: dir, UdevIdentityDir: filepath.Join(t.TempDir(), "identity")})
	v := mustCreate(t, s, CreateRequest{Name: "raw", SizeBytes: 1 << 20, Mode: ModeBlock, NoPartition: true})
	// A device of the test's own, bound to a file of its own: settle only
	// reads its record and asks for change events of it.
	file := filepath.Join(t.TempDir(), "backing")
	if err := os.WriteFile(file, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	dev, err := loop.Get(testutil.Losetup(t, file))
	if err != nil {
		t.Fatal(err)
	}
	num, err := os.ReadFile(filepath.Join("/sys/class/block", filepath.Base(dev.Path), "dev"))
	if err != nil {
		t.Fatal(err)
	}
	record := filepath.Join(string(dir), "data", "b"+strings.TrimSpace(string(num)))
	seq := strconv.FormatUint(dev.DiskSeq, 10)
	for _, tt := range []struct {
		name, volume string
		ok           bool
	}{
		{"the volume's identity", v.UUID, true},
		{"another volume's identity", "0f0e0d0c-0b0a-4908-8706-050403020100", false},
		{"no volume named", "", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			entry := "E:SPARSEVOL_DISKSEQ=" + seq + "\n"
			if tt.volume != "" {
				entry += "E:SPARSEVOL_VOLUME=" + tt.volume + "\n"
			}
			entry += "E:SPARSEVOL_IDENTITY=store\n"
			if err := os.WriteFile(record, []byte(entry), 0o644); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			err := s.settleIdentity(ctx, v, dev)
			if tt.ok && err != nil {
				t.Errorf("settle with the volume's own identity: %v", err)
			}
			if !tt.ok && !errors.Is(err, errProbed) {
				t.Errorf("settle with a record of %q, not %s: %v; want errProbed", tt.volume, v.UUID, err)
			}
		})
	}
}
