package main

import (
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
)

// entry is one file of the image's root filesystem.
type entry struct {
	Path   string      // in the image, relative, e.g. usr/sbin/mke2fs
	Mode   fs.FileMode // type and permission bits (set-id bits dropped)
	Link   string      // symlink target, as the package has it
	Source string      // regular files: where the bytes are on the host
	Data   []byte      // regular files written by this program
	Pkg    string      // the Debian package it comes from, if any
}

// merged are the top directories that are links into /usr in the image
// (Debian's merged /usr); files the packages put there go below usr/.
var merged = []string{"bin", "sbin", "lib", "lib64"}

// libDirs are searched, in order, for a DT_NEEDED library.
var libDirs = []string{"usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib"}

// usrPath maps a path of a package to its place in the merged-/usr image.
func usrPath(p string) string {
	p = strings.TrimPrefix(path.Clean("/"+p), "/")
	top, _, _ := strings.Cut(p, "/")
	for _, m := range merged {
		if top == m {
			return "usr/" + p
		}
	}
	return p
}

// tree is an unpacked set of packages, indexed by image path.
type tree struct {
	files map[string]string // image path -> host path
	pkgs  map[string]string // image path -> package
}

// loadTree indexes root/<package>/..., as extract makes it.
func loadTree(root string, debs []deb) (*tree, error) {
	t := &tree{files: map[string]string{}, pkgs: map[string]string{}}
	for _, d := range debs {
		dir := filepath.Join(root, d.Name)
		err := filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(dir, p)
			if rel == "." || de.IsDir() {
				return nil
			}
			ip := usrPath(filepath.ToSlash(rel))
			if prev, ok := t.pkgs[ip]; ok {
				return fmt.Errorf("%s is in both %s and %s", ip, prev, d.Name)
			}
			t.files[ip], t.pkgs[ip] = p, d.Name
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	return t, nil
}

// collect returns want (image paths) and everything they need: symlink
// targets, shared libraries and the ELF interpreter, transitively.
func (t *tree) collect(want []string) (map[string]entry, error) {
	out := map[string]entry{}
	var add func(ip, why string) error
	add = func(ip, why string) error {
		if name, ok := strings.CutPrefix(ip, "lib:"); ok {
			lib, found := t.lookupLib(name)
			if !found {
				return fmt.Errorf("library %s (%s) is in none of the packages", name, why)
			}
			ip = lib
		}
		ip = usrPath(ip)
		if _, ok := out[ip]; ok {
			return nil
		}
		host, ok := t.files[ip]
		if !ok {
			return fmt.Errorf("%s (%s) is in none of the packages", ip, why)
		}
		fi, err := os.Lstat(host)
		if err != nil {
			return err
		}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(host)
			if err != nil {
				return err
			}
			out[ip] = entry{Path: ip, Mode: fs.ModeSymlink | 0o777, Link: target, Pkg: t.pkgs[ip]}
			resolved := target
			if !path.IsAbs(target) {
				resolved = path.Join(path.Dir(ip), target)
			}
			return add(resolved, "target of "+ip)
		case fi.Mode().IsRegular():
			out[ip] = entry{Path: ip, Mode: fi.Mode().Perm()&^0o022 | 0o444, Source: host, Pkg: t.pkgs[ip]}
			needs, err := elfNeeds(host)
			if err != nil {
				return fmt.Errorf("%s: %w", ip, err)
			}
			for _, n := range needs {
				if err := add(n, "needed by "+ip); err != nil {
					return err
				}
			}
			return nil
		default:
			return fmt.Errorf("%s: not a file or symlink (%s)", ip, fi.Mode())
		}
	}
	for _, w := range want {
		if err := add(w, "asked for"); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// elfNeeds returns what an executable or library needs: its interpreter
// (a path) and its DT_NEEDED libraries ("lib:NAME", found in libDirs by
// lookupLib). A script whose interpreter is not an image
// file is refused: the image has no shell.
func elfNeeds(host string) ([]string, error) {
	data, err := os.ReadFile(host)
	if err != nil {
		return nil, err
	}
	return elfNeedsData(data)
}

func elfNeedsData(data []byte) ([]string, error) {
	if bytes.HasPrefix(data, []byte("#!")) {
		return nil, errors.New("a script: the image has no interpreter for it")
	}
	f, err := elf.NewFile(bytes.NewReader(data))
	if err != nil {
		return nil, nil // data, e.g. a configuration file
	}
	defer f.Close()
	var needs []string
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			b := make([]byte, p.Filesz)
			if _, err := p.ReadAt(b, 0); err != nil {
				return nil, err
			}
			needs = append(needs, strings.TrimRight(string(b), "\x00"))
		}
	}
	libs, err := f.ImportedLibraries()
	if err != nil {
		return nil, err
	}
	for _, l := range libs {
		needs = append(needs, "lib:"+l)
	}
	return needs, nil
}

// lookupLib returns the first libDirs/name the tree has.
func (t *tree) lookupLib(name string) (string, bool) {
	for _, d := range libDirs {
		if _, ok := t.files[d+"/"+name]; ok {
			return d + "/" + name, true
		}
	}
	return "", false
}

// sortedEntries adds the parent directories of every entry and returns
// all of them in path order.
func sortedEntries(m map[string]entry) []entry {
	dirs := map[string]bool{}
	for p := range m {
		for d := path.Dir(p); d != "." && d != "/"; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	for d := range dirs {
		if _, ok := m[d]; !ok {
			m[d] = entry{Path: d, Mode: fs.ModeDir | 0o755}
		}
	}
	list := make([]entry, 0, len(m))
	for _, e := range m {
		list = append(list, e)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].Path < list[j].Path })
	return list
}
