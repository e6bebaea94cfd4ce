// Command packages packs a staged root (what `make install DESTDIR=...`
// wrote, with the packages' layout) into sparsevol's .deb and .rpm with
// nfpm. It decides nothing about the layout: every file and link of the
// root goes in as it is, empty directories (the store) are owned with
// their mode, and every entry is owned by root and dated -mtime, so two
// runs on the same root give the same bytes. `make packages` runs it.
//
// Its own module keeps nfpm's dependencies out of the main go.mod.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/goreleaser/nfpm/v2"
	_ "github.com/goreleaser/nfpm/v2/deb" // registers the "deb" packager
	"github.com/goreleaser/nfpm/v2/files"
	_ "github.com/goreleaser/nfpm/v2/rpm" // registers the "rpm" packager
)

// The tools sparsevol runs, by package name. Debian splits util-linux
// (losetup and mount are in "mount", sfdisk in "fdisk"); RPM distributions
// do not. XFS is optional: ext4 and block volumes work without it.
var depends = map[string]struct{ requires, recommends []string }{
	"deb": {[]string{"util-linux", "mount", "fdisk", "gdisk", "e2fsprogs"}, []string{"xfsprogs"}},
	"rpm": {[]string{"util-linux", "gdisk", "e2fsprogs"}, []string{"xfsprogs"}},
}

func main() {
	root := flag.String("root", "", "staged root to pack (make install DESTDIR=...)")
	scripts := flag.String("scripts", "", "directory of postinstall.sh and postremove.sh")
	version := flag.String("version", "", "package version (starts with a digit; no '-')")
	mtime := flag.Int64("mtime", 0, "time of every entry, in seconds since the epoch (SOURCE_DATE_EPOCH)")
	out := flag.String("out", "", "directory to write the packages to")
	arch := flag.String("arch", "amd64", "Go architecture of the binary")
	flag.Parse()
	if *root == "" || *scripts == "" || *version == "" || *out == "" {
		fmt.Fprintln(os.Stderr, "packages: -root, -scripts, -version and -out are required")
		os.Exit(2)
	}
	if err := run(*root, *scripts, *version, time.Unix(*mtime, 0).UTC(), *out, *arch); err != nil {
		fmt.Fprintln(os.Stderr, "packages:", err)
		os.Exit(1)
	}
}

func run(root, scripts, version string, mtime time.Time, out, arch string) error {
	contents, err := walk(root, mtime)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fmt.Errorf("make %s: %w", out, err)
	}
	for _, format := range []string{"deb", "rpm"} {
		path, err := pack(format, info(format, contents, scripts, version, mtime, arch), out)
		if err != nil {
			return fmt.Errorf("pack %s: %w", format, err)
		}
		fi, err := os.Stat(path)
		if err != nil {
			return err
		}
		fmt.Printf("%s\t%d bytes\n", path, fi.Size())
	}
	return nil
}

// walk lists the staged root as package contents.
func walk(root string, mtime time.Time) (files.Contents, error) {
	var contents files.Contents
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || path == root {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		c := &files.Content{Destination: "/" + filepath.ToSlash(rel),
			FileInfo: &files.ContentFileInfo{Owner: "root", Group: "root", Mode: fi.Mode().Perm(), MTime: mtime}}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(path)
			if err != nil {
				return err
			}
			c.Type, c.Source = files.TypeSymlink, target
		case fi.IsDir():
			// Parents are made as needed and not owned; an empty
			// directory is one the install means to ship.
			entries, err := os.ReadDir(path)
			if err != nil || len(entries) > 0 {
				return err
			}
			c.Type = files.TypeDir
		case fi.Mode().IsRegular():
			c.Source = path
		default:
			return fmt.Errorf("%s: neither a file, a directory nor a link", path)
		}
		contents = append(contents, c)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("walk %s: %w", root, err)
	}
	if len(contents) == 0 {
		return nil, errors.New("nothing staged in " + root)
	}
	sort.Sort(contents)
	return contents, nil
}

func info(format string, contents files.Contents, scripts, version string, mtime time.Time, arch string) *nfpm.Info {
	// Each packager rewrites the contents it is given: a copy each.
	own := make(files.Contents, len(contents))
	for i, c := range contents {
		cc, fi := *c, *c.FileInfo
		cc.FileInfo = &fi
		own[i] = &cc
	}
	in := &nfpm.Info{
		Name:          "sparsevol",
		Arch:          arch,
		Platform:      "linux",
		Version:       version,
		VersionSchema: "none",
		Release:       "1",
		Section:       "admin",
		Priority:      "optional",
		Maintainer:    "sparsevol developers <sparsevol@users.noreply.github.com>",
		Vendor:        "sparsevol",
		Homepage:      "https://github.com/sparsevol/sparsevol",
		Description: "Persistent sparse-file volumes behind loop devices\n" +
			"Volumes are sparse files on the node's own disk exposed through loop\n" +
			"devices; systemd units bring them back at every boot, before kubelet.\n" +
			"Also a CSI driver (sparsevol-csi).",
		MTime: mtime,
		Overridables: nfpm.Overridables{
			Contents:   own,
			Depends:    depends[format].requires,
			Recommends: depends[format].recommends,
			Scripts: nfpm.Scripts{
				PostInstall: filepath.Join(scripts, "postinstall.sh"),
				PostRemove:  filepath.Join(scripts, "postremove.sh"),
			},
			// gzip: every dpkg and rpm reads it, and it packs in seconds
			// (xz took minutes here for a package as big, zstd saves 5%).
			Deb: nfpm.Deb{Compression: "gzip"},
			RPM: nfpm.RPM{Compression: "gzip", BuildHost: "sparsevol", Group: "System Environment/Base",
				Summary: "Persistent sparse-file volumes behind loop devices"},
		},
	}
	return nfpm.WithDefaults(in)
}

// pack writes the package of format into dir under its conventional name.
func pack(format string, in *nfpm.Info, dir string) (string, error) {
	p, err := nfpm.Get(format)
	if err != nil {
		return "", err
	}
	if err := nfpm.PrepareForPackager(in, format); err != nil {
		return "", err
	}
	in.Target = filepath.Join(dir, p.ConventionalFileName(in))
	f, err := os.Create(in.Target)
	if err != nil {
		return "", err
	}
	if err := p.Package(in, f); err != nil {
		f.Close()
		os.Remove(in.Target)
		return "", err
	}
	if err := f.Close(); err != nil {
		os.Remove(in.Target)
		return "", err
	}
	return in.Target, nil
}
