package packages_test

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// What the tests build: a fixed version and time, so the expectations
// below are exact.
const (
	version = "9.8.7+test"
	epoch   = 1700000000
)

// entry is one path of a package, as both formats describe it.
type entry struct {
	mode  fs.FileMode // type bits and permissions
	owner string      // user:group
	link  string      // symlink target
	mtime int64
	size  int64
	sum   string // sha256 of a regular file's bytes
	data  []byte // the bytes (deb only; the rpm carries sum and size)
}

type built struct{ deb, rpm string }

var (
	once     sync.Once
	packages built
	buildErr error
	buildDir string // removed by TestMain
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// build runs `make packages` once for the tests of this package.
func build(t *testing.T) built {
	t.Helper()
	once.Do(func() {
		if buildDir, buildErr = os.MkdirTemp("", "sparsevol-packages-"); buildErr == nil {
			packages, buildErr = makePackages(buildDir)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return packages
}

// makePackages runs `make packages` with its output under dir.
func makePackages(dir string) (built, error) {
	repo, err := filepath.Abs("../..")
	if err != nil {
		return built{}, err
	}
	out := filepath.Join(dir, "out")
	cmd := exec.Command("make", "--no-print-directory", "-C", repo, "packages",
		"PKGROOT="+filepath.Join(dir, "root"), "PKGDIR="+out, "VERSION="+version)
	cmd.Env = append(os.Environ(), "SOURCE_DATE_EPOCH="+strconv.Itoa(epoch))
	if b, err := cmd.CombinedOutput(); err != nil {
		return built{}, errors.New("make packages: " + err.Error() + "\n" + string(b))
	}
	debs, _ := filepath.Glob(filepath.Join(out, "*.deb"))
	rpms, _ := filepath.Glob(filepath.Join(out, "*.rpm"))
	if len(debs) != 1 || len(rpms) != 1 {
		return built{}, errors.New("make packages wrote " + strings.Join(append(debs, rpms...), ", ") + ", want one .deb and one .rpm")
	}
	return built{debs[0], rpms[0]}, nil
}

// wantFiles is the contract: every file and link the packages hold.
// Manual pages are checked by pattern.
var wantFiles = map[string]entry{
	"/usr/bin/sparsevol":                                     {mode: 0o755},
	"/usr/bin/sparsevol-csi":                                 {mode: 0o755},
	"/usr/lib/systemd/system/sparsevol@.service":             {mode: 0o644},
	"/usr/lib/systemd/system/sparsevol-boot.service":         {mode: 0o644},
	"/usr/lib/systemd/system/sparsevol-boot-done.service":    {mode: 0o644},
	"/usr/lib/systemd/system-generators/sparsevol-generator": {mode: fs.ModeSymlink | 0o777, link: "/usr/bin/sparsevol"},
	"/usr/lib/udev/rules.d/59-sparsevol.rules":               {mode: 0o644},
	"/usr/share/man/man8/sparsevol.8":                        {mode: 0o644},
	"/usr/share/man/man8/sparsevol-create.8":                 {mode: 0o644},
	"/usr/share/man/man8/sparsevol-csi.8":                    {mode: 0o644},
}

var manPage = regexp.MustCompile(`^/usr/share/man/man8/sparsevol(-[a-z-]+)?\.8$`)

// The store: the one directory the packages own, private.
const store = "/var/lib/sparsevol"

// TestContents checks both packages against the contract: paths, types,
// modes, owners, times; the same bytes in both; units that run the
// packaged binary; a static binary stamped with the version.
func TestContents(t *testing.T) {
	p := build(t)
	deb := debContents(t, p.deb)
	rpm := rpmContents(t, p.rpm)
	for name, got := range map[string]map[string]entry{"deb": deb, "rpm": rpm} {
		t.Run(name, func(t *testing.T) {
			checkContents(t, got)
		})
	}
	t.Run("same files", func(t *testing.T) {
		for p, d := range deb {
			if d.mode.IsDir() {
				continue
			}
			r, ok := rpm[p]
			if !ok {
				t.Errorf("%s in the deb, not in the rpm", p)
				continue
			}
			if perm(d.mode) != perm(r.mode) || d.link != r.link || d.sum != r.sum || d.size != r.size {
				t.Errorf("%s: deb %v %q %d %s, rpm %v %q %d %s", p, d.mode, d.link, d.size, d.sum, r.mode, r.link, r.size, r.sum)
			}
		}
		for p, r := range rpm {
			if _, ok := deb[p]; !ok && !r.mode.IsDir() {
				t.Errorf("%s in the rpm, not in the deb", p)
			}
		}
	})
	t.Run("units run the packaged binary", func(t *testing.T) {
		for p, e := range deb {
			if !strings.HasSuffix(p, ".service") {
				continue
			}
			unit := string(e.data)
			if !strings.Contains(unit, "ExecStart=/usr/bin/sparsevol ") && !strings.Contains(unit, "ExecStart=-/usr/bin/sparsevol ") {
				t.Errorf("%s does not run /usr/bin/sparsevol:\n%s", p, unit)
			}
			if strings.Contains(unit, "/usr/local") {
				t.Errorf("%s names /usr/local:\n%s", p, unit)
			}
			if strings.HasSuffix(p, "@.service") && !strings.Contains(unit, "SPARSEVOL_ROOT="+store) {
				t.Errorf("%s does not name the store %s", p, store)
			}
		}
	})
	// Both binaries: the node commands and the CSI plugin.
	for _, b := range []struct{ path, versionArg string }{
		{"/usr/bin/sparsevol", "version"},
		{"/usr/bin/sparsevol-csi", "--version"},
	} {
		t.Run("binary "+filepath.Base(b.path), func(t *testing.T) {
			bin := filepath.Join(t.TempDir(), filepath.Base(b.path))
			if err := os.WriteFile(bin, deb[b.path].data, 0o755); err != nil {
				t.Fatal(err)
			}
			f, err := elf.Open(bin)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			for _, prog := range f.Progs {
				if prog.Type == elf.PT_INTERP {
					t.Errorf("the packaged %s is dynamically linked (has an interpreter)", b.path)
				}
			}
			out, err := exec.Command(bin, b.versionArg).CombinedOutput()
			if err != nil || !strings.HasPrefix(string(out), "sparsevol "+version+" (") {
				t.Errorf("packaged %s %s = %q, %v; want version %s", b.path, b.versionArg, out, err, version)
			}
		})
	}
}

func checkContents(t *testing.T, got map[string]entry) {
	t.Helper()
	for p, w := range wantFiles {
		e, ok := got[p]
		if !ok {
			t.Errorf("%s missing", p)
			continue
		}
		if perm(e.mode) != perm(w.mode) || e.link != w.link {
			t.Errorf("%s: mode %v link %q, want %v %q", p, e.mode, e.link, w.mode, w.link)
		}
	}
	if e, ok := got[store]; !ok || e.mode != fs.ModeDir|0o700 {
		t.Errorf("store %s: %v (present %v), want a directory of mode 0700", store, e.mode, ok)
	}
	for p, e := range got {
		switch {
		case e.owner != "root:root":
			t.Errorf("%s owned by %s, want root:root", p, e.owner)
		case e.mtime != epoch:
			t.Errorf("%s dated %s, want SOURCE_DATE_EPOCH %s", p, time.Unix(e.mtime, 0).UTC(), time.Unix(epoch, 0).UTC())
		}
		_, listed := wantFiles[p]
		switch {
		case listed || p == store:
		case e.mode.IsDir():
			if e.mode != fs.ModeDir|0o755 || !strings.HasPrefix(store+"/", p+"/") && !hasChild(got, p) {
				t.Errorf("directory %s (%v) is not the store nor a parent of a packaged file", p, e.mode)
			}
		case manPage.MatchString(p):
			if e.mode != 0o644 {
				t.Errorf("%s: mode %v, want 0644", p, e.mode)
			}
		default:
			t.Errorf("%s (%v) is not part of the package contract", p, e.mode)
		}
	}
}

// perm is the mode that matters: a symlink's permissions do not (an rpm
// records none).
func perm(m fs.FileMode) fs.FileMode {
	if m&fs.ModeSymlink != 0 {
		return fs.ModeSymlink
	}
	return m
}

func hasChild(got map[string]entry, dir string) bool {
	for p := range got {
		if strings.HasPrefix(p, dir+"/") {
			return true
		}
	}
	return false
}

// TestMetadata: names, versions, dependencies, and the maintainer scripts
// are the ones of this directory (and no others: nothing runs before
// install or before remove).
func TestMetadata(t *testing.T) {
	p := build(t)
	postinst, err := os.ReadFile("postinstall.sh")
	if err != nil {
		t.Fatal(err)
	}
	postrm, err := os.ReadFile("postremove.sh")
	if err != nil {
		t.Fatal(err)
	}
	t.Run("deb", func(t *testing.T) {
		fields := run(t, "dpkg-deb", "-f", p.deb, "Package", "Version", "Architecture", "Depends")
		for _, w := range []string{"Package: sparsevol", "Version: " + version + "-1", "Architecture: amd64", "e2fsprogs"} {
			if !strings.Contains(fields, w) {
				t.Errorf("control lacks %q:\n%s", w, fields)
			}
		}
		ctrl := readTar(t, exec.Command("dpkg-deb", "--ctrl-tarfile", p.deb))
		want := map[string][]byte{"/postinst": postinst, "/postrm": postrm}
		for name, e := range ctrl {
			switch name {
			case "/", "/control", "/md5sums":
				continue
			}
			w, ok := want[name]
			if !ok {
				t.Errorf("unexpected maintainer script %s", name)
				continue
			}
			if !bytes.Equal(e.data, w) || e.mode != 0o755 {
				t.Errorf("%s (mode %v) is not deploy/packages' script:\n%s", name, e.mode, e.data)
			}
			delete(want, name)
		}
		for name := range want {
			t.Errorf("maintainer script %s missing", name)
		}
	})
	t.Run("rpm", func(t *testing.T) {
		h := readRPM(t, p.rpm)
		for tag, w := range map[int]string{tagName: "sparsevol", tagVersion: version, tagRelease: "1",
			tagPostIn: string(postinst), tagPostUn: string(postrm), tagPreIn: "", tagPreUn: ""} {
			if got := h.str(tag); strings.TrimSpace(got) != strings.TrimSpace(w) {
				t.Errorf("rpm tag %d = %q, want %q", tag, got, w)
			}
		}
		if req := strings.Join(h.strs(tagRequireName), " "); !strings.Contains(req, "e2fsprogs") {
			t.Errorf("rpm requires %s, want e2fsprogs among them", req)
		}
	})
}

// TestReproducible: a second build of the same commit gives the same
// bytes.
func TestReproducible(t *testing.T) {
	first := build(t)
	second, err := makePackages(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, pair := range [][2]string{{first.deb, second.deb}, {first.rpm, second.rpm}} {
		a, b := sum(t, pair[0]), sum(t, pair[1])
		if a != b {
			t.Errorf("%s differs between two builds: %s, %s", filepath.Base(pair[0]), a, b)
		}
	}
}

func sum(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
	return string(out)
}

// debContents reads the deb's file tree.
func debContents(t *testing.T, deb string) map[string]entry {
	t.Helper()
	return readTar(t, exec.Command("dpkg-deb", "--fsys-tarfile", deb))
}

// readTar reads the tar stream cmd writes, by absolute path.
func readTar(t *testing.T, cmd *exec.Cmd) map[string]entry {
	t.Helper()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%v: %v", cmd.Args, err)
	}
	got := map[string]entry{}
	tr := tar.NewReader(bytes.NewReader(out))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		e := entry{mode: h.FileInfo().Mode(), owner: h.Uname + ":" + h.Gname, link: h.Linkname, mtime: h.ModTime.Unix(), size: h.Size}
		if h.Typeflag == tar.TypeReg {
			if e.data, err = io.ReadAll(tr); err != nil {
				t.Fatal(err)
			}
			s := sha256.Sum256(e.data)
			e.sum = hex.EncodeToString(s[:])
		}
		got[path.Clean("/"+h.Name)] = e
	}
	return got
}
