package main

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// deb is one Debian package of the image: its candidate version in the
// host's apt sources and the checksum apt knows for it.
type deb struct {
	Name, Version, Arch, SHA256 string
}

// file is the .deb's name in the cache: versions are in it, so a new
// version is a new file and an old one is never reused for it.
func (d deb) file() string {
	return strings.NewReplacer(":", "%3a").Replace(fmt.Sprintf("%s_%s_%s.deb", d.Name, d.Version, d.Arch))
}

// resolve asks apt (one apt-cache call) for the candidate version of
// each package.
func resolve(names []string) ([]deb, error) {
	out, err := exec.Command("apt-cache", append([]string{"show", "--no-all-versions"}, names...)...).Output()
	if err != nil {
		return nil, fmt.Errorf("apt-cache show %s: %w (run apt-get update first)", strings.Join(names, " "), exitDetail(err))
	}
	found := map[string]deb{}
	for _, record := range strings.Split(string(out), "\n\n") {
		var d deb
		sc := bufio.NewScanner(strings.NewReader(record))
		sc.Buffer(make([]byte, 0, 1<<16), 1<<20)
		for sc.Scan() {
			k, v, ok := strings.Cut(sc.Text(), ": ")
			if !ok {
				continue
			}
			switch k {
			case "Package":
				d.Name = v
			case "Version":
				d.Version = v
			case "Architecture":
				d.Arch = v
			case "SHA256":
				d.SHA256 = v
			}
		}
		if d.Name != "" {
			found[d.Name] = d
		}
	}
	debs := make([]deb, 0, len(names))
	for _, n := range names {
		d, ok := found[n]
		if !ok || d.Version == "" || d.Arch == "" || d.SHA256 == "" {
			return nil, fmt.Errorf("apt-cache show %s: no version, architecture or SHA256 (run apt-get update first)", n)
		}
		debs = append(debs, d)
	}
	sort.Slice(debs, func(i, j int) bool { return debs[i].Name < debs[j].Name })
	return debs, nil
}

// fetch makes sure every package is in dir (apt-get download), checks
// each file against apt's checksum, and returns their paths.
func fetch(debs []deb, dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("deb cache %s: %w", dir, err)
	}
	paths := make([]string, len(debs))
	for i, d := range debs {
		path := filepath.Join(dir, d.file())
		if _, err := os.Stat(path); err != nil {
			cmd := exec.Command("apt-get", "download", "-q", d.Name+"="+d.Version)
			cmd.Dir = dir
			if out, err := cmd.CombinedOutput(); err != nil {
				return nil, fmt.Errorf("apt-get download %s=%s: %w: %s", d.Name, d.Version, err, bytes.TrimSpace(out))
			}
		}
		if err := checkSum(path, d.SHA256); err != nil {
			os.Remove(path) // a damaged download is fetched again next time
			return nil, err
		}
		paths[i] = path
	}
	return paths, nil
}

func checkSum(path, want string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("deb %s: %w", path, err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return fmt.Errorf("deb %s: %w", path, err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != want {
		return fmt.Errorf("deb %s: sha256 %s, apt says %s", path, got, want)
	}
	return nil
}

// extract unpacks every package into its own directory (named as the
// package) of a tree under cache keyed by the packages' versions (made
// once; dpkg-deb -x, no maintainer scripts run) and returns the tree.
func extract(debs []deb, paths []string, cache string) (string, error) {
	h := sha256.New()
	for _, d := range debs {
		fmt.Fprintf(h, "%s %s %s %s\n", d.Name, d.Version, d.Arch, d.SHA256)
	}
	dir := filepath.Join(cache, "root-"+hex.EncodeToString(h.Sum(nil))[:16])
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err == nil {
		return dir, nil
	}
	os.RemoveAll(dir)
	tmp := dir + ".tmp"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return "", err
	}
	for i, p := range paths {
		if out, err := exec.Command("dpkg-deb", "-x", p, filepath.Join(tmp, debs[i].Name)).CombinedOutput(); err != nil {
			return "", fmt.Errorf("dpkg-deb -x %s: %w: %s", p, err, bytes.TrimSpace(out))
		}
	}
	if err := os.WriteFile(filepath.Join(tmp, ".complete"), nil, 0o644); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return "", err
	}
	return dir, nil
}

func exitDetail(err error) error {
	if ee, ok := err.(*exec.ExitError); ok && len(ee.Stderr) > 0 {
		return fmt.Errorf("%w: %s", err, bytes.TrimSpace(ee.Stderr))
	}
	return err
}
