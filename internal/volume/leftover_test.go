package volume

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/sparsevol/sparsevol/internal/loop"
	"github.com/sparsevol/sparsevol/internal/testutil"
)

// probeFile makes a probe file name in s's directory, last changed at
// mtime, and binds a loop device tagged tag to it ("": none); it returns
// the file's path and the device.
func probeFile(t *testing.T, s *Store, name string, mtime time.Time, tag string) (string, string) {
	t.Helper()
	path := filepath.Join(s.Root(), name)
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(1 << 20); err != nil {
		t.Fatal(err)
	}
	dev := ""
	if tag != "" {
		d, err := loop.Attach(int(f.Fd()), loop.AttachOptions{Tag: tag})
		if err != nil {
			t.Fatal(err)
		}
		dev = d.Path
		t.Cleanup(func() { testutil.DetachIfServes(dev, path) })
	}
	if err := os.Chtimes(path, mtime, mtime); err != nil {
		t.Fatal(err)
	}
	return path, dev
}

// TestProbeFileRemovesKilledProbes: the probe file of a killed doctor and
// the device tagged ProbeTag bound to it are removed when the next probe
// is made, and reported; a probe file made since this process started is
// left (another doctor's), and so is one whose device is not provably a
// probe's (another tag), reported with why. Close removes the probe.
func TestProbeFileRemovesKilledProbes(t *testing.T) {
	s := newStore(t, Options{})
	old := processStart.Add(-time.Hour)
	killed, killedDev := probeFile(t, s, ".doctor-killed", old, ProbeTag)
	bare, _ := probeFile(t, s, ".doctor-bare", old, "")
	running, _ := probeFile(t, s, ".doctor-running", time.Now().Add(time.Hour), "")
	foreign, foreignDev := probeFile(t, s, ".doctor-foreign", old, "someone-else")

	p, err := s.ProbeFile()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]ProbeLeftover{}
	for _, l := range p.Left {
		got[l.Path] = l
	}
	if l, ok := got[killed]; !ok || l.Err != nil || !slices.Equal(l.Devices, []string{killedDev}) {
		t.Errorf("killed probe: %+v, want removed with %s", l, killedDev)
	}
	if l, ok := got[bare]; !ok || l.Err != nil || len(l.Devices) != 0 {
		t.Errorf("killed probe without a device: %+v, want removed", l)
	}
	if l, ok := got[foreign]; !ok || l.Err == nil || !slices.Equal(l.Devices, []string{foreignDev}) {
		t.Errorf("probe file with another's device: %+v, want left with an error naming %s", l, foreignDev)
	}
	if _, ok := got[running]; ok || len(p.Left) != 3 {
		t.Errorf("leftovers %+v, want the three older than this process", p.Left)
	}
	for _, path := range []string{killed, bare} {
		if _, err := os.Lstat(path); !os.IsNotExist(err) {
			t.Errorf("%s: %v, want it removed", path, err)
		}
	}
	for _, path := range []string{running, foreign} {
		if _, err := os.Lstat(path); err != nil {
			t.Errorf("%s: %v, want it left", path, err)
		}
	}
	if devs := boundUnder(s.Root()); !slices.Equal(devs, []string{foreignDev}) {
		t.Errorf("bound after the probe: %v, want only %s", devs, foreignDev)
	}
	probe := p.File.Name()
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(probe); !os.IsNotExist(err) {
		t.Errorf("probe %s after Close: %v, want it removed", probe, err)
	}
}

// TestRecoverCopies: a copy a killed recover left is listed with its
// volume's UUID; one whose volume's lock is held (a recover making it)
// is not.
func TestRecoverCopies(t *testing.T) {
	s := newStore(t, Options{})
	v := mustCreate(t, s, CreateRequest{Name: "v", SizeBytes: 4 << 20, Mode: ModeBlock, NoPartition: true})
	t.Cleanup(func() { s.Delete(t.Context(), "v", DetachOptions{}) })
	path := filepath.Join(s.Root(), recoverTempName(v.UUID))
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := s.RecoverCopies()
	if err != nil || !slices.Equal(got, []RecoverCopy{{Path: path, UUID: v.UUID}}) {
		t.Fatalf("RecoverCopies: %+v, %v; want %s", got, err, path)
	}
	unlock, err := s.lock(v.UUID)
	if err != nil {
		t.Fatal(err)
	}
	got, err = s.RecoverCopies()
	unlock()
	if err != nil || len(got) != 0 {
		t.Fatalf("RecoverCopies with the volume locked: %+v, %v; want none", got, err)
	}
}
