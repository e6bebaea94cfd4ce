package systemd

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	systemdunit "github.com/sparsevol/sparsevol/deploy/systemd"
	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// enable does what `systemctl enable` leaves on disk for an instance, with
// the drop-in Enable writes when root is set.
func enable(t *testing.T, m Manager, uuid, root string, mountsFor ...string) {
	t.Helper()
	wants := filepath.Join(m.Dir, "multi-user.target.wants")
	if err := os.MkdirAll(wants, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(m.Dir, TemplateName), filepath.Join(wants, UnitName(uuid))); err != nil {
		t.Fatal(err)
	}
	if root == "" {
		return
	}
	dropIn := "[Unit]\nRequiresMountsFor=" + strings.Join(mountsFor, " ") + "\n\n[Service]\nEnvironment=SPARSEVOL_ROOT=" + root + "\n"
	if err := os.MkdirAll(filepath.Dir(m.DropInPath(uuid)), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(m.DropInPath(uuid), []byte(dropIn), 0o644); err != nil {
		t.Fatal(err)
	}
}

func newTestManager(t *testing.T, storeRoot string) Manager {
	t.Helper()
	dir := t.TempDir()
	// No fstab unless a test writes one: the host's says nothing of
	// these paths.
	m := Manager{Dir: filepath.Join(dir, "etc"), RunDir: filepath.Join(dir, "run"), Fstab: filepath.Join(dir, "fstab")}
	if err := os.MkdirAll(m.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(m.Dir, TemplateName), []byte(render(systemdunit.Template, "/usr/bin/sparsevol", storeRoot)), 0o644); err != nil {
		t.Fatal(err)
	}
	return m
}

func TestEnabledInstances(t *testing.T) {
	const a, b, c = "0aaaaaaa-0000-4000-8000-000000000001", "0bbbbbbb-0000-4000-8000-000000000002", "0ccccccc-0000-4000-8000-000000000003"
	m := newTestManager(t, "/srv/store")
	enable(t, m, c, "/mnt/other", "/mnt/other", "/mnt/files")
	enable(t, m, a, "") // no drop-in: the template's store
	enable(t, m, b, "/srv/store", "/srv/store")
	// Not ours, and an instance left in another target: ignored.
	os.Symlink("/lib/systemd/system/ssh.service", filepath.Join(m.Dir, "multi-user.target.wants", "ssh.service"))
	got, err := m.EnabledInstances()
	if err != nil {
		t.Fatal(err)
	}
	want := []Instance{
		{UUID: a, Root: "/srv/store"},
		{UUID: b, Root: "/srv/store", MountsFor: []string{"/srv/store"}},
		{UUID: c, Root: "/mnt/other", MountsFor: []string{"/mnt/other", "/mnt/files"}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("EnabledInstances =\n%+v\nwant\n%+v", got, want)
	}
	// What the volume store's boot attaches, store by store.
	vols, err := m.EnabledVolumes()
	wantVols := []volume.EnabledVolume{{UUID: a, Root: "/srv/store"}, {UUID: b, Root: "/srv/store"}, {UUID: c, Root: "/mnt/other"}}
	if err != nil || !reflect.DeepEqual(vols, wantVols) {
		t.Errorf("EnabledVolumes = %+v, %v; want %+v", vols, err, wantVols)
	}
}

// TestEnabledVolumesLeaveOutUnmountedStores: a store, or a path an
// instance requires mounted, at or below an fstab mount point that is not
// mounted is left out of what boot attaches (ErrUnsafe, naming the mount
// point): the directory below a mount point is not the store, and may
// hold an older one with the same volumes. Once mounted, it is listed.
func TestEnabledVolumesLeaveOutUnmountedStores(t *testing.T) {
	testutil.RequireRoot(t) // mounts a tmpfs
	const a, b, c = "0aaaaaaa-0000-4000-8000-000000000001", "0bbbbbbb-0000-4000-8000-000000000002", "0ccccccc-0000-4000-8000-000000000003"
	mnt := filepath.Join(t.TempDir(), "disk")
	if err := os.MkdirAll(filepath.Join(mnt, "store"), 0o700); err != nil {
		t.Fatal(err)
	}
	m := newTestManager(t, "/srv/store")
	fstab := "# a comment\nUUID=0000 / ext4 defaults 0 1\n/dev/sdb1 " + mnt + " ext4 nofail 0 2\nnone swap swap sw 0 0\n"
	if err := os.WriteFile(m.Fstab, []byte(fstab), 0o644); err != nil {
		t.Fatal(err)
	}
	enable(t, m, a, "/srv/store", "/srv/store")
	enable(t, m, b, filepath.Join(mnt, "store"), filepath.Join(mnt, "store"))
	enable(t, m, c, "/srv/store", "/srv/store", filepath.Join(mnt, "files"))
	vols, err := m.EnabledVolumes()
	want := []volume.EnabledVolume{{UUID: a, Root: "/srv/store"}}
	if !reflect.DeepEqual(vols, want) || !errors.Is(err, volume.ErrUnsafe) || !strings.Contains(err.Error(), mnt+" (in "+m.Fstab+") is not mounted") ||
		!strings.Contains(err.Error(), UnitName(b)) || !strings.Contains(err.Error(), UnitName(c)) {
		t.Fatalf("EnabledVolumes with %s not mounted = %+v, %v; want %+v and ErrUnsafe naming it for %s and %s", mnt, vols, err, want, b, c)
	}
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	vols, err = m.EnabledVolumes()
	want = []volume.EnabledVolume{{UUID: a, Root: "/srv/store"}, {UUID: b, Root: filepath.Join(mnt, "store")}, {UUID: c, Root: "/srv/store"}}
	if err != nil || !reflect.DeepEqual(vols, want) {
		t.Errorf("EnabledVolumes with %s mounted = %+v, %v; want %+v", mnt, vols, err, want)
	}
}

// TestFstabMountPoints: fields split as libmount splits them (spaces and
// tabs, nothing else), escapes decoded as libmount decodes them (\457
// is "/"), and a line without a filesystem type, which systemd skips,
// is no mount point.
func TestFstabMountPoints(t *testing.T) {
	got := fstabMountPoints([]byte("# c\n\nUUID=1 / ext4 defaults 0 1\n/dev/sdb1\t/srv/disk\\040two/ xfs nofail 0 2\nnone swap swap sw 0 0\nbroken\n" +
		"LABEL=x /mnt/a\\134b ext4\n/dev/sdc1 /var/lib\n/dev/sdd1 /var/\u00a0old ext4 nofail 0 0\n/dev/sde1 /data\\457lib  ext4\n"))
	if want := []string{"/srv/disk two", `/mnt/a\b`, "/var/\u00a0old", "/data/lib"}; !reflect.DeepEqual(got, want) {
		t.Errorf("fstabMountPoints = %q, want %q", got, want)
	}
}

// TestEnabledVolumesLeaveOutUnmountedUnitStores: a mount point defined
// by a mount unit's file, not in the fstab, guards the stores below it
// as an fstab entry does, unless the unit is masked; and an fstab mount
// point written through a symbolic link is the directory systemd mounts
// (the link resolved), for the stores written either way.
func TestEnabledVolumesLeaveOutUnmountedUnitStores(t *testing.T) {
	testutil.RequireRoot(t) // mounts a tmpfs
	const a, b = "0aaaaaaa-0000-4000-8000-000000000001", "0bbbbbbb-0000-4000-8000-000000000002"
	dir := t.TempDir()
	disk, real := filepath.Join(dir, "disk"), filepath.Join(dir, "real")
	for _, d := range []string{filepath.Join(disk, "store"), filepath.Join(real, "data", "store")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink("real", link); err != nil {
		t.Fatal(err)
	}
	m := newTestManager(t, "/srv/store")
	unitFile := filepath.Join(m.Dir, mountUnit(disk))
	if err := os.WriteFile(unitFile, []byte("[Mount]\nWhat=/dev/vdb\nWhere="+disk+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(m.Fstab, []byte("/dev/vdc "+link+"/data ext4 nofail 0 2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	enable(t, m, a, filepath.Join(disk, "store"), filepath.Join(disk, "store"))
	enable(t, m, b, filepath.Join(link, "data", "store"), filepath.Join(link, "data", "store"))
	check := func(what string, want []volume.EnabledVolume, unsafe ...string) {
		t.Helper()
		vols, err := m.EnabledVolumes()
		if len(vols) == 0 {
			vols = nil
		}
		if !reflect.DeepEqual(vols, want) {
			t.Errorf("%s: EnabledVolumes = %+v, want %+v (error %v)", what, vols, want, err)
		}
		if len(unsafe) == 0 && err != nil {
			t.Errorf("%s: EnabledVolumes: %v", what, err)
		}
		for _, u := range unsafe {
			if !errors.Is(err, volume.ErrUnsafe) || !strings.Contains(err.Error(), u) {
				t.Errorf("%s: EnabledVolumes error %v, want ErrUnsafe naming %q", what, err, u)
			}
		}
	}
	check("neither mounted", nil, disk+" (in "+unitFile+") is not mounted", filepath.Join(real, "data")+" (in "+m.Fstab+") is not mounted")
	// The boot unit waits for the mount systemd makes: the link resolved.
	out := t.TempDir()
	if err := m.Generate(out); err != nil {
		t.Fatal(err)
	}
	if boot, err := os.ReadFile(filepath.Join(out, BootUnit+".d", bootDropIn)); err != nil || !slices.Contains(strings.Fields(strings.ReplaceAll(string(boot), "=", " ")), mountUnit(filepath.Join(real, "data"))) {
		t.Errorf("the boot unit's drop-in does not name %s:\n%s", mountUnit(filepath.Join(real, "data")), boot)
	}

	mount := func(at string) {
		t.Helper()
		if err := unix.Mount("tmpfs", at, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(at, unix.MNT_DETACH) })
	}
	mount(filepath.Join(real, "data")) // where systemd mounts the fstab's link/data
	check("the fstab's mounted at the link's target", []volume.EnabledVolume{{UUID: b, Root: filepath.Join(link, "data", "store")}}, disk+" (in "+unitFile+")")

	for _, mask := range []func() error{
		func() error { return os.WriteFile(unitFile, nil, 0o644) },
		func() error { os.Remove(unitFile); return os.Symlink(os.DevNull, unitFile) },
	} {
		if err := mask(); err != nil {
			t.Fatal(err)
		}
		check("the unit masked", []volume.EnabledVolume{{UUID: a, Root: filepath.Join(disk, "store")}, {UUID: b, Root: filepath.Join(link, "data", "store")}})
	}
	os.Remove(unitFile)
	if err := os.WriteFile(unitFile, []byte("[Mount]\nWhat=/dev/vdb\nWhere="+disk+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	mount(disk)
	check("both mounted", []volume.EnabledVolume{{UUID: a, Root: filepath.Join(disk, "store")}, {UUID: b, Root: filepath.Join(link, "data", "store")}})
}

// TestGenerateRefusesInstanceNames: an enabled instance whose name is not
// a volume UUID gets no drop-in and is not listed for boot; the generator
// says so (ErrInvalid) and still writes the drop-ins of the others.
func TestGenerateRefusesInstanceNames(t *testing.T) {
	const good = "0aaaaaaa-0000-4000-8000-000000000001"
	for _, name := range []string{
		"x\n[Service]\nExecStartPre=sh -c id",
		"..",
		"data",
		"0AAAAAAA-0000-4000-8000-000000000001",
		good + " " + good,
	} {
		t.Run(name, func(t *testing.T) {
			m := newTestManager(t, "/srv/store")
			enable(t, m, good, "")
			enable(t, m, name, "")
			out := t.TempDir()
			if err := m.Generate(out); !errors.Is(err, volume.ErrInvalid) {
				t.Errorf("Generate = %v, want ErrInvalid", err)
			}
			entries, err := os.ReadDir(out)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, e := range entries {
				got = append(got, e.Name())
			}
			if want := []string{BootUnit + ".d", UnitName(good) + ".d"}; !reflect.DeepEqual(got, want) {
				t.Errorf("generated %q, want %q", got, want)
			}
			vols, err := m.EnabledVolumes()
			if want := []volume.EnabledVolume{{UUID: good, Root: "/srv/store"}}; !reflect.DeepEqual(vols, want) || !errors.Is(err, volume.ErrInvalid) {
				t.Errorf("EnabledVolumes = %+v, %v; want %+v and ErrInvalid", vols, err, want)
			}
		})
	}
}

// TestGenerateRefusesDropInPaths: an instance whose store or mounts, read
// from its drop-in or the template, fail volume.CheckUnitPath gets no
// drop-in, adds nothing to the boot unit's mounts and is not listed for
// boot; the others are generated as usual.
func TestGenerateRefusesDropInPaths(t *testing.T) {
	const good, bad = "0aaaaaaa-0000-4000-8000-000000000001", "0bbbbbbb-0000-4000-8000-000000000002"
	tests := []struct {
		name, template, root string
		mounts               []string
	}{
		{"relative store", "/srv/store", "../../tmp/evil", []string{"/srv/x"}},
		{"store with a specifier", "/srv/store", "/srv/a%i", []string{"/srv/x"}},
		{"quoted mount", "/srv/store", "/srv/x", []string{`"/a`, `b"`}},
		{"mount with a specifier", "/srv/store", "/srv/x", []string{"%h/x"}},
		{"relative mount", "/srv/store", "/srv/x", []string{"relative"}},
		{"unclean mount", "/srv/store", "/srv/x", []string{"/srv/x/../y"}},
		{"relative template store", "srv/store", "", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newTestManager(t, tt.template)
			enable(t, m, good, "/srv/good", "/srv/good")
			enable(t, m, bad, tt.root, tt.mounts...)
			out := t.TempDir()
			if err := m.Generate(out); !errors.Is(err, volume.ErrInvalid) {
				t.Errorf("Generate = %v, want ErrInvalid", err)
			}
			if _, err := os.Stat(filepath.Join(out, UnitName(bad)+".d")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("drop-in generated for %s (%v)", bad, err)
			}
			if boot, err := os.ReadFile(filepath.Join(out, BootUnit+".d", bootDropIn)); err != nil || !strings.HasSuffix(string(boot), "\nAfter=-.mount srv-good.mount srv.mount\n") {
				t.Errorf("%s drop-in (%v):\n%s", BootUnit, err, boot)
			}
			if _, err := os.Stat(filepath.Join(out, UnitName(good)+".d", bootDropIn)); err != nil {
				t.Errorf("no drop-in for %s: %v", good, err)
			}
			vols, err := m.EnabledVolumes()
			if want := []volume.EnabledVolume{{UUID: good, Root: "/srv/good"}}; !reflect.DeepEqual(vols, want) || !errors.Is(err, volume.ErrInvalid) {
				t.Errorf("EnabledVolumes = %+v, %v; want %+v and ErrInvalid", vols, err, want)
			}
		})
	}
}

// TestGenerateUnreadableDropIn: a drop-in that is not a regular file of
// Enable's size (a FIFO would hold up the generator for good, a link
// would make it read another file) is refused without waiting; only its
// instance is left out.
func TestGenerateUnreadableDropIn(t *testing.T) {
	const good, bad = "0aaaaaaa-0000-4000-8000-000000000001", "0bbbbbbb-0000-4000-8000-000000000002"
	elsewhere := filepath.Join(t.TempDir(), "10-store.conf")
	if err := os.WriteFile(elsewhere, []byte("[Service]\nEnvironment=SPARSEVOL_ROOT=/srv/elsewhere\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		make func(path string) error
	}{
		{"directory", func(p string) error { return os.Mkdir(p, 0o755) }},
		{"fifo", func(p string) error { return unix.Mkfifo(p, 0o644) }},
		{"symlink", func(p string) error { return os.Symlink(elsewhere, p) }},
		{"oversized", func(p string) error {
			return os.WriteFile(p, []byte("[Service]\nEnvironment=SPARSEVOL_ROOT=/srv/x\n"+strings.Repeat("#\n", maxUnit)), 0o644)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newTestManager(t, "/srv/store")
			enable(t, m, good, "/srv/good", "/srv/good")
			enable(t, m, bad, "")
			if err := os.MkdirAll(filepath.Dir(m.DropInPath(bad)), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := tt.make(m.DropInPath(bad)); err != nil {
				t.Fatal(err)
			}
			out := t.TempDir()
			done := make(chan error, 1)
			go func() { done <- m.Generate(out) }()
			select {
			case err := <-done:
				if err == nil || !strings.Contains(err.Error(), UnitName(bad)) {
					t.Errorf("Generate = %v, want an error naming %s", err, UnitName(bad))
				}
			case <-time.After(10 * time.Second):
				if fd, err := unix.Open(m.DropInPath(bad), unix.O_WRONLY|unix.O_NONBLOCK, 0); err == nil {
					unix.Close(fd) // let the blocked reader go
				}
				t.Fatal("Generate blocked on the drop-in")
			}
			if _, err := os.Stat(filepath.Join(out, UnitName(bad)+".d")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("drop-in generated for %s (%v)", bad, err)
			}
			if _, err := os.Stat(filepath.Join(out, UnitName(good)+".d", bootDropIn)); err != nil {
				t.Errorf("no drop-in for %s: %v", good, err)
			}
			vols, _ := m.EnabledVolumes()
			if want := []volume.EnabledVolume{{UUID: good, Root: "/srv/good"}}; !reflect.DeepEqual(vols, want) {
				t.Errorf("EnabledVolumes = %+v, want %+v", vols, want)
			}
		})
	}
}

// TestMarkBootDoneNoFollow: a link at the boot-done marker's name is
// refused, never followed: the file it names keeps its content, a
// missing one is not made, and the boot is not taken for done.
func TestMarkBootDoneNoFollow(t *testing.T) {
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	absent := filepath.Join(t.TempDir(), "absent")
	for _, target := range []string{victim, absent} {
		t.Run(filepath.Base(target), func(t *testing.T) {
			m := newTestManager(t, "/srv/store")
			if err := os.MkdirAll(m.RunDir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(target, m.bootDoneFile()); err != nil {
				t.Fatal(err)
			}
			if err := m.MarkBootDone(); err == nil {
				t.Error("MarkBootDone through a link succeeded")
			}
			if m.BootDone() {
				t.Error("BootDone with a link for a marker")
			}
			if got, err := os.ReadFile(victim); err != nil || string(got) != "kept" {
				t.Errorf("victim now %q, %v", got, err)
			}
			if _, err := os.Lstat(absent); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the link's target was made (%v)", err)
			}
		})
	}
}

// TestGenerateGoesOnPastOneInstance: an instance whose drop-in cannot be
// written is reported, and the other instances still get theirs; a link
// at a drop-in's name is replaced, never written through.
func TestGenerateGoesOnPastOneInstance(t *testing.T) {
	const a, b, c = "0aaaaaaa-0000-4000-8000-000000000001", "0bbbbbbb-0000-4000-8000-000000000002", "0ccccccc-0000-4000-8000-000000000003"
	m := newTestManager(t, "/srv/store")
	for _, uuid := range []string{a, b, c} {
		enable(t, m, uuid, "/srv/store", "/srv/store")
	}
	out := t.TempDir()
	// b's drop-in directory is a file: b's drop-in cannot be written.
	if err := os.WriteFile(filepath.Join(out, UnitName(b)+".d"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// a's drop-in is a link to a file elsewhere.
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(out, UnitName(a)+".d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, filepath.Join(out, UnitName(a)+".d", bootDropIn)); err != nil {
		t.Fatal(err)
	}
	err := m.Generate(out)
	if err == nil || !strings.Contains(err.Error(), UnitName(b)) {
		t.Errorf("Generate = %v, want an error naming %s", err, UnitName(b))
	}
	for _, uuid := range []string{a, c} {
		path := filepath.Join(out, UnitName(uuid)+".d", bootDropIn)
		st, err := os.Lstat(path)
		if err != nil || !st.Mode().IsRegular() {
			t.Errorf("%s: %v, want its drop-in, a regular file", path, err)
		}
	}
	if data, err := os.ReadFile(victim); err != nil || string(data) != "keep" {
		t.Errorf("the drop-in link's target now holds %q (%v), want it untouched", data, err)
	}
}

// TestMountUnit: mount unit names are systemd-escape --path's (the
// values are systemd 252's).
func TestMountUnit(t *testing.T) {
	for _, tt := range []struct{ path, want string }{
		{"/", "-.mount"},
		{"/srv/sparsevol-store", `srv-sparsevol\x2dstore.mount`},
		{"/var/lib/.hidden", "var-lib-.hidden.mount"},
		{"/.x", `\x2ex.mount`},
		{"/mnt/a.b/.c", "mnt-a.b-.c.mount"},
		{"/mnt/é", `mnt-\xc3\xa9.mount`},
		{"/a:b_c/x~y", `a:b_c-x\x7ey.mount`},
	} {
		if got := mountUnit(tt.path); got != tt.want {
			t.Errorf("mountUnit(%q) = %q, want %q", tt.path, got, tt.want)
		}
	}
}

func TestGenerate(t *testing.T) {
	const a, b = "0aaaaaaa-0000-4000-8000-000000000001", "0bbbbbbb-0000-4000-8000-000000000002"
	read := func(t *testing.T, path string) string {
		t.Helper()
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return string(data)
	}
	t.Run("boot", func(t *testing.T) {
		m := newTestManager(t, "/srv/store")
		enable(t, m, a, "/srv/store", "/srv/store")
		enable(t, m, b, "/mnt/other", "/mnt/other", "/mnt/files")
		out := t.TempDir()
		if err := m.Generate(out); err != nil {
			t.Fatal(err)
		}
		for _, uuid := range []string{a, b} {
			conf := read(t, filepath.Join(out, UnitName(uuid)+".d", bootDropIn))
			for _, w := range []string{"\nExecStart=\n", "Wants=" + BootUnit, "After=" + BootUnit,
				"AssertPathExists=" + filepath.Join(m.RunDir, "attached", uuid)} {
				if !strings.Contains(conf, w) {
					t.Errorf("%s drop-in lacks %q:\n%s", uuid, w, conf)
				}
			}
		}
		// Wanted, not required: one failed mount does not fail the boot
		// unit and with it every volume.
		boot := read(t, filepath.Join(out, BootUnit+".d", bootDropIn))
		const units = "-.mount mnt-files.mount mnt-other.mount mnt.mount srv-store.mount srv.mount"
		if !strings.Contains(boot, "\nWants="+units+"\nAfter="+units+"\n") || strings.Contains(boot, "Requires") {
			t.Errorf("%s drop-in:\n%s", BootUnit, boot)
		}
	})
	t.Run("after the boot", func(t *testing.T) {
		m := newTestManager(t, "/srv/store")
		enable(t, m, a, "/srv/store", "/srv/store")
		if err := m.MarkBootDone(); err != nil {
			t.Fatal(err)
		}
		out := t.TempDir()
		if err := m.Generate(out); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(out, UnitName(a)+".d")); !os.IsNotExist(err) {
			t.Errorf("instance drop-in written after the boot was done (%v)", err)
		}
		// The boot unit keeps its mounts: it stays loaded after a reload.
		read(t, filepath.Join(out, BootUnit+".d", bootDropIn))
	})
	t.Run("nothing enabled", func(t *testing.T) {
		m := newTestManager(t, "/srv/store")
		out := t.TempDir()
		if err := m.Generate(out); err != nil {
			t.Fatal(err)
		}
		if entries, _ := os.ReadDir(out); len(entries) != 0 {
			t.Errorf("generated %d entries with no volume enabled", len(entries))
		}
	})
}

// TestInstallLinksGenerator: the generator is linked in the
// system-generators directory next to the unit directory, however the
// unit directory is spelled (a trailing slash on --unit-dir).
func TestInstallLinksGenerator(t *testing.T) {
	for _, tt := range []struct{ name, suffix string }{
		{"clean", ""},
		{"trailing slash", "/"},
		{"trailing slashes", "//"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			m := Manager{Dir: filepath.Join(dir, "etc", "systemd", "system") + tt.suffix}
			paths, err := m.Install(context.Background(), "/opt/sv/bin/sparsevol", "/srv/store")
			if err != nil {
				t.Fatal(err)
			}
			gen := filepath.Join(dir, "etc", "systemd", "system-generators", GeneratorName)
			if target, err := os.Readlink(gen); err != nil || target != "/opt/sv/bin/sparsevol" {
				t.Errorf("generator link %s -> %q, %v", gen, target, err)
			}
			if len(paths) != 4 {
				t.Errorf("Install wrote %v, want 3 units and the generator", paths)
			}
			boot := filepath.Join(m.Dir, BootUnit)
			if data, err := os.ReadFile(boot); err != nil || !strings.Contains(string(data), "ExecStart=-/opt/sv/bin/sparsevol --udev-timeout=80s attach --boot") {
				t.Errorf("%s: %v\n%s", boot, err, data)
			}
			if _, err := m.Uninstall(context.Background()); err != nil {
				t.Fatal(err)
			}
			for _, p := range paths {
				if _, err := os.Lstat(p); !os.IsNotExist(err) {
					t.Errorf("%s left after Uninstall (%v)", p, err)
				}
			}
		})
	}
}

// unsafePaths are paths systemd's unit syntax would read as more than a
// path (volume.CheckUnitPath has the full table).
var unsafePaths = []struct{ name, path string }{
	{"specifier and injected setting", "/srv/st %H\nExecStartPre=/bin/touch /tmp/pwned"},
	{"space", "/opt/my tools/sparsevol"},
	{"specifier", "/srv/st%H"},
	{"dollar", "/opt/$X/sparsevol"},
	{"backslash", `/srv/a\x20b`},
	{"relative", "bin/sparsevol"},
	{"not clean", "/usr/local/bin/../bin/sparsevol"},
}

// noFiles fails the test if anything was made under dir.
func noFiles(t *testing.T, dir string) {
	t.Helper()
	if entries, err := os.ReadDir(dir); err != nil || len(entries) != 0 {
		t.Errorf("refused call left %v in %s (%v)", entries, dir, err)
	}
}

// TestInstallRefusesUnsafePaths: a binary or store the units could not
// name is refused before any unit or link is written.
func TestInstallRefusesUnsafePaths(t *testing.T) {
	for _, u := range unsafePaths {
		for _, field := range []string{"binary", "store"} {
			t.Run(u.name+"/"+field, func(t *testing.T) {
				dir := t.TempDir()
				m := Manager{Dir: filepath.Join(dir, "etc", "systemd", "system"), Offline: true}
				binary, root := "/usr/bin/sparsevol", "/srv/store"
				if field == "binary" {
					binary = u.path
				} else {
					root = u.path
				}
				paths, err := m.Install(context.Background(), binary, root)
				if !errors.Is(err, volume.ErrInvalid) || len(paths) != 0 {
					t.Fatalf("Install(%q, %q) = %v, %v; want ErrInvalid and nothing written", binary, root, paths, err)
				}
				noFiles(t, dir)
			})
		}
	}
}

// TestEnableRefusesUnsafeInput: a store or mount path the drop-in could
// not name, or a UUID that is not one, is refused before the drop-in is
// written (systemctl, absent here, is never reached).
func TestEnableRefusesUnsafeInput(t *testing.T) {
	const uuid = "0aaaaaaa-0000-4000-8000-000000000001"
	type tc struct {
		name, uuid, root string
		mountsFor        []string
	}
	tests := []tc{
		{"uuid with a path", "../../x", "/srv/store", []string{"/srv/store"}},
		{"uuid with a newline", uuid + "\n[Service]", "/srv/store", []string{"/srv/store"}},
	}
	for _, u := range unsafePaths {
		tests = append(tests, tc{"store " + u.name, uuid, u.path, []string{"/srv/store"}},
			tc{"mount " + u.name, uuid, "/srv/store", []string{"/srv/store", u.path}})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			m := Manager{Dir: filepath.Join(dir, "etc"), Offline: true}
			err := m.Enable(context.Background(), tt.uuid, tt.root, tt.mountsFor, false)
			if !errors.Is(err, volume.ErrInvalid) {
				t.Fatalf("Enable = %v, want ErrInvalid", err)
			}
			noFiles(t, dir)
		})
	}
}

// TestInstalled: the template counts as installed in the unit directory
// or where a package puts it, and nowhere else.
func TestInstalled(t *testing.T) {
	tests := []struct {
		name   string
		in     string // "etc", "vendor" or "" (nowhere)
		vendor bool   // the Manager searches the vendor directory
		want   bool
	}{
		{"nowhere", "", true, false},
		{"unit dir", "etc", true, true},
		{"package", "vendor", true, true},
		{"package, vendor dirs not searched", "vendor", false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			m := Manager{Dir: filepath.Join(dir, "etc"), VendorDirs: []string{}}
			vendor := filepath.Join(dir, "usr/lib/systemd/system")
			if tt.vendor {
				m.VendorDirs = []string{filepath.Join(dir, "missing"), vendor}
			}
			if tt.in != "" {
				d := map[string]string{"etc": m.Dir, "vendor": vendor}[tt.in]
				if err := os.MkdirAll(d, 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(d, TemplateName), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if got := m.Installed(); got != tt.want {
				t.Errorf("Installed() = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestInstallLeavesOthersUnits puts at one of Install's paths something
// sparsevol did not write there: a mask, a unit of the operator's own, a
// FIFO, a file where the generator's link goes. Install refuses
// (ErrExists) and writes nothing; Uninstall of an install removes the
// rest and leaves that thing as it was, naming it.
func TestInstallLeavesOthersUnits(t *testing.T) {
	for _, tc := range []struct {
		name  string
		path  func(m Manager) string
		plant func(t *testing.T, path string)
	}{
		{"masked template", func(m Manager) string { return filepath.Join(m.Dir, TemplateName) }, func(t *testing.T, path string) {
			if err := os.Symlink("/dev/null", path); err != nil {
				t.Fatal(err)
			}
		}},
		{"operator's boot unit", func(m Manager) string { return filepath.Join(m.Dir, BootUnit) }, func(t *testing.T, path string) {
			if err := os.WriteFile(path, []byte("[Unit]\nDescription=mine\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"FIFO as the boot-done unit", func(m Manager) string { return filepath.Join(m.Dir, BootDoneUnit) }, func(t *testing.T, path string) {
			if err := unix.Mkfifo(path, 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"file as the generator", func(m Manager) string { return filepath.Join(m.generatorDir(), GeneratorName) }, func(t *testing.T, path string) {
			if err := os.WriteFile(path, []byte("#!/bin/sh\n"), 0o755); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			m := Manager{Dir: filepath.Join(dir, "etc", "systemd", "system")}
			path := tc.path(m)
			for _, d := range []string{m.Dir, m.generatorDir()} {
				if err := os.MkdirAll(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			plant := func() {
				os.Remove(path)
				tc.plant(t, path)
			}
			plant()
			before := tree(t, dir)
			if _, err := m.Install(context.Background(), "/opt/sv/bin/sparsevol", "/srv/store"); !errors.Is(err, volume.ErrExists) {
				t.Fatalf("Install over %s = %v, want ErrExists", path, err)
			}
			if after := tree(t, dir); !slices.Equal(after, before) {
				t.Fatalf("a refused Install changed the unit directories:\n%v\nwas\n%v", after, before)
			}
			os.Remove(path)
			paths, err := m.Install(context.Background(), "/opt/sv/bin/sparsevol", "/srv/store")
			if err != nil {
				t.Fatal(err)
			}
			plant()
			if _, err := m.Uninstall(context.Background()); !errors.Is(err, volume.ErrExists) || !strings.Contains(err.Error(), path) {
				t.Fatalf("Uninstall with %s planted = %v, want ErrExists naming it", path, err)
			}
			for _, p := range paths {
				_, err := os.Lstat(p)
				if p == path && err != nil {
					t.Errorf("Uninstall removed %s, which it did not write: %v", p, err)
				}
				if p != path && !os.IsNotExist(err) {
					t.Errorf("%s left after Uninstall (%v)", p, err)
				}
			}
		})
	}
}

// tree lists the files below dir with their kind and size.
func tree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		out = append(out, fmt.Sprintf("%s %v %d", p, fi.Mode(), fi.Size()))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestGenerateTemplateNotAFile: a FIFO at the template's path makes the
// generator fail at once (it would hang the boot reading it); a masked
// template (a link to /dev/null) and a linked one (`systemctl link`) are
// read as systemd reads them.
func TestGenerateTemplateNotAFile(t *testing.T) {
	const uuid = "0aaaaaaa-0000-4000-8000-000000000001"
	linked := filepath.Join(t.TempDir(), TemplateName)
	if err := os.WriteFile(linked, []byte(render(systemdunit.Template, "/opt/sv/sparsevol", "/srv/linked")), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		make  func(path string) error
		ok    bool
		store string
	}{
		{"fifo", func(p string) error { return unix.Mkfifo(p, 0o644) }, false, ""},
		{"masked", func(p string) error { return os.Symlink("/dev/null", p) }, true, defaultRoot},
		{"linked", func(p string) error { return os.Symlink(linked, p) }, true, "/srv/linked"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newTestManager(t, "/srv/store")
			enable(t, m, uuid, "")
			tmpl := filepath.Join(m.Dir, TemplateName)
			os.Remove(tmpl)
			if err := tc.make(tmpl); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- m.Generate(t.TempDir()) }()
			var err error
			select {
			case err = <-done:
			case <-time.After(10 * time.Second):
				if fd, err := unix.Open(tmpl, unix.O_WRONLY|unix.O_NONBLOCK, 0); err == nil {
					unix.Close(fd) // let the blocked reader go
				}
				t.Fatal("Generate blocked on the template")
			}
			if (err == nil) != tc.ok {
				t.Fatalf("Generate = %v, want success %v", err, tc.ok)
			}
			if !tc.ok {
				return
			}
			vols, err := m.EnabledVolumes()
			if want := []volume.EnabledVolume{{UUID: uuid, Root: tc.store}}; err != nil || !reflect.DeepEqual(vols, want) {
				t.Errorf("EnabledVolumes = %+v, %v; want %+v", vols, err, want)
			}
		})
	}
}
