package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Where the plugin binary (sparsevol-csi) lives in the image
// (deploy/kubernetes runs it from there).
const binaryPath = "usr/local/bin/sparsevol-csi"

// packages are the Debian packages the image's files come from: the tools
// the plugin runs and the libraries they link. Only the files tools names
// (and what they need) are taken from them.
var packages = []string{
	// tools
	"e2fsprogs", "xfsprogs", "util-linux", "fdisk", "gdisk", "dash", "coreutils",
	// their shared libraries
	"libc6", "libblkid1", "libuuid1", "libsmartcols1", "libfdisk1",
	"libext2fs2", "libcom-err2", "libinih1", "liburcu8",
	"libstdc++6", "libgcc-s1", "libpopt0", "libtinfo6", "libreadline8",
	"libedit2", "libbsd0", "libmd0", // xfs_db's
}

// tools are the programs the plugin runs, by image path (internal/volume
// runs its programs by name, through PATH), and what they read; nothing
// else. Mounts, unmounts, trims and XFS grows are system calls.
var tools = []string{
	"usr/sbin/mkfs.ext4", "usr/sbin/e2fsck", "usr/sbin/resize2fs", "etc/mke2fs.conf",
	"usr/sbin/mkfs.xfs",
	"usr/sbin/blkid", "usr/bin/partx", "usr/sbin/sfdisk", "usr/sbin/sgdisk",
	// A snapshot's thaw guard (internal/volume/freeze.go): sh -c '...
	// fsfreeze --unfreeze ... rm -f -- NOTE'.
	"usr/bin/sh", "usr/sbin/fsfreeze", "usr/bin/rm",
	// A restored or cloned volume's new identity (internal/volume/
	// identity.go: tune2fs -U, and xfs_db as xfs_admin -U runs it).
	"usr/sbin/tune2fs", "usr/sbin/xfs_db",
}

// pathEnv is the image's PATH: the tools are found by name.
const pathEnv = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// spec is everything an image is made of; equal specs give equal digests.
type spec struct {
	Binary  []byte            // the static sparsevol-csi binary
	Tree    *tree             // the unpacked packages
	Debs    []deb             // their names and versions, for the label
	Version string            // org.opencontainers.image.version
	Epoch   time.Time         // every timestamp
	Labels  map[string]string // more labels
}

// build makes the image: a layer of tools from the packages, and a layer
// with the binary (so two plugin versions share the first).
func build(s spec) (v1.Image, error) {
	if err := checkStatic(s.Binary); err != nil {
		return nil, err
	}
	files, err := s.Tree.collect(tools)
	if err != nil {
		return nil, err
	}
	// Every package must give a file: the list stays what the tools need.
	used := map[string]bool{}
	for _, e := range files {
		used[e.Pkg] = true
	}
	for _, d := range s.Debs {
		if !used[d.Name] {
			return nil, fmt.Errorf("package %s gives none of the files the tools need: drop it from the list", d.Name)
		}
	}
	// Their copyright files go with them.
	docs, err := s.Tree.collect(copyrights(s.Tree, s.Debs))
	if err != nil {
		return nil, err
	}
	for p, e := range docs {
		files[p] = e
	}
	base := baseFiles()
	for p, e := range base {
		files[p] = e
	}
	toolsLayer, err := layer(sortedEntries(files), s.Epoch)
	if err != nil {
		return nil, err
	}
	binLayer, err := layer(sortedEntries(map[string]entry{
		binaryPath: {Path: binaryPath, Mode: 0o755, Data: s.Binary},
	}), s.Epoch)
	if err != nil {
		return nil, err
	}
	var pkgs []string
	for _, d := range s.Debs {
		pkgs = append(pkgs, d.Name+"="+d.Version)
	}
	labels := map[string]string{
		"org.opencontainers.image.title":       "sparsevol",
		"org.opencontainers.image.description": "sparsevol CSI plugin: the static sparsevol-csi binary and the Debian tools it runs",
		"org.opencontainers.image.source":      "https://github.com/sparsevol/sparsevol",
		"org.opencontainers.image.version":     s.Version,
		"io.sparsevol.debian-packages":         strings.Join(pkgs, " "),
	}
	for k, v := range s.Labels {
		labels[k] = v
	}
	created := v1.Time{Time: s.Epoch}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.ConfigFile(img, &v1.ConfigFile{
		Architecture: "amd64",
		OS:           "linux",
		Created:      created,
		Config: v1.Config{
			Entrypoint: []string{"/" + binaryPath},
			Env:        []string{pathEnv},
			WorkingDir: "/",
			Labels:     labels,
		},
	})
	if err != nil {
		return nil, err
	}
	return mutate.Append(img,
		mutate.Addendum{Layer: toolsLayer, History: v1.History{Created: created, CreatedBy: "tools/image: Debian " + strings.Join(pkgs, " ")}},
		mutate.Addendum{Layer: binLayer, History: v1.History{Created: created, CreatedBy: "tools/image: " + binaryPath + " " + s.Version}},
	)
}

// baseFiles are the few files a root filesystem needs besides the tools:
// Debian's merged-/usr links, the mount points, root's user and group.
func baseFiles() map[string]entry {
	m := map[string]entry{}
	for _, d := range merged {
		m[d] = entry{Path: d, Mode: fs.ModeSymlink | 0o777, Link: "usr/" + d}
	}
	for _, d := range []string{"dev", "proc", "sys", "run", "var/lib", "csi"} {
		m[d] = entry{Path: d, Mode: fs.ModeDir | 0o755}
	}
	m["tmp"] = entry{Path: "tmp", Mode: fs.ModeDir | fs.ModeSticky | 0o777}
	m["root"] = entry{Path: "root", Mode: fs.ModeDir | 0o700}
	m["etc/passwd"] = entry{Path: "etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0:root:/root:/usr/sbin/nologin\n")}
	m["etc/group"] = entry{Path: "etc/group", Mode: 0o644, Data: []byte("root:x:0:\n")}
	// libext2fs and xfsprogs read the mount table here where /proc/mounts
	// is unreadable.
	m["etc/mtab"] = entry{Path: "etc/mtab", Mode: fs.ModeSymlink | 0o777, Link: "../proc/self/mounts"}
	return m
}

// copyrights are the packages' copyright files: they go with the files.
func copyrights(t *tree, debs []deb) []string {
	var out []string
	for _, d := range debs {
		p := "usr/share/doc/" + d.Name + "/copyright"
		if _, ok := t.files[p]; ok {
			out = append(out, p)
		}
	}
	return out
}

// layer writes entries as a tar (every time epoch, owner root) and returns
// it as a gzip OCI layer.
func layer(entries []entry, epoch time.Time) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.Path, ModTime: epoch, Mode: int64(e.Mode.Perm()), Format: tar.FormatPAX}
		if e.Mode&fs.ModeSticky != 0 {
			h.Mode |= 0o1000
		}
		var data []byte
		switch {
		case e.Mode.IsDir():
			h.Typeflag, h.Name = tar.TypeDir, e.Path+"/"
		case e.Mode&fs.ModeSymlink != 0:
			h.Typeflag, h.Linkname = tar.TypeSymlink, e.Link
		default:
			data = e.Data
			if e.Source != "" {
				b, err := os.ReadFile(e.Source)
				if err != nil {
					return nil, err
				}
				data = b
			}
			h.Typeflag, h.Size = tar.TypeReg, int64(len(data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	raw := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(raw)), nil },
		tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
}

// checkStatic refuses a dynamically linked binary: the image has the
// tools' libraries only, and a glibc build would run on no other.
func checkStatic(bin []byte) error {
	if _, err := elf.NewFile(bytes.NewReader(bin)); err != nil {
		return fmt.Errorf("plugin binary: %w", err)
	}
	needs, err := elfNeedsData(bin)
	if err != nil {
		return fmt.Errorf("plugin binary: %w", err)
	}
	if len(needs) > 0 {
		sort.Strings(needs)
		return fmt.Errorf("plugin binary is dynamically linked (%s): build it with CGO_ENABLED=0 (make build)", strings.Join(needs, ", "))
	}
	return nil
}
