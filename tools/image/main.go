// Command image builds the sparsevol plugin image without a container
// daemon: the static plugin binary (sparsevol-csi) plus the tools it runs
// (mkfs for ext4 and XFS, e2fsck, resize2fs, blkid, sgdisk, sfdisk ...) with their shared
// libraries, taken from the host's Debian packages (apt-get download into
// a cache, dpkg-deb -x). It writes an archive that ctr images import,
// docker load and podman load all read, and pushes it when asked. Equal
// inputs (binary, package versions, SOURCE_DATE_EPOCH) give equal digests.
//
//	go run . -bin ../../bin/sparsevol-csi -out ../../bin/sparsevol-image.tar
//	go run . -bin ../../bin/sparsevol-csi -push registry.example/sparsevol:v1
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// DefaultName is the image deploy/kubernetes runs.
const DefaultName = "ghcr.io/sparsevol/sparsevol:latest"

func main() {
	var o options
	flag.StringVar(&o.bin, "bin", "", "the static plugin binary, sparsevol-csi (required)")
	flag.StringVar(&o.out, "out", "", "write the image archive here")
	flag.StringVar(&o.name, "name", DefaultName, "the image name in the archive")
	flag.StringVar(&o.push, "push", "", "push the image to this reference (credentials: docker's config)")
	flag.StringVar(&o.version, "version", "", "the image's version label (default: the binary's --version)")
	flag.StringVar(&o.cache, "cache", "/var/cache/sparsevol-image", "cache of the Debian packages and their unpacked trees")
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

type options struct {
	bin, out, name, push, version, cache string
}

func run(o options) error {
	if o.bin == "" || (o.out == "" && o.push == "") {
		return errors.New("need -bin and -out or -push (see -help)")
	}
	if _, err := name.ParseReference(o.name); err != nil {
		return fmt.Errorf("-name: %w", err)
	}
	bin, err := os.ReadFile(o.bin)
	if err != nil {
		return err
	}
	epoch, err := sourceDateEpoch()
	if err != nil {
		return err
	}
	if o.version == "" {
		if o.version, err = binaryVersion(o.bin); err != nil {
			return err
		}
	}
	debs, err := resolve(packages)
	if err != nil {
		return err
	}
	paths, err := fetch(debs, filepath.Join(o.cache, "debs"))
	if err != nil {
		return err
	}
	root, err := extract(debs, paths, o.cache)
	if err != nil {
		return err
	}
	t, err := loadTree(root, debs)
	if err != nil {
		return err
	}
	img, err := build(spec{Binary: bin, Tree: t, Debs: debs, Version: o.version, Epoch: epoch})
	if err != nil {
		return err
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	if o.out != "" {
		if err := writeFile(o.out, img, o.name, epoch); err != nil {
			return err
		}
		fi, _ := os.Stat(o.out)
		fmt.Printf("%s %s %s (%s, %d bytes)\n", o.out, o.name, digest, sizes(img), fi.Size())
	}
	if o.push != "" {
		ref, err := name.ParseReference(o.push)
		if err != nil {
			return fmt.Errorf("-push: %w", err)
		}
		if err := remote.Write(ref, img, remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
			return fmt.Errorf("push %s: %w", ref, err)
		}
		fmt.Printf("pushed %s@%s\n", ref, digest)
	}
	return nil
}

// writeFile writes the archive next to path and renames it into place.
func writeFile(path string, img v1.Image, name string, epoch time.Time) error {
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	if err := writeArchive(f, img, name, epoch); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// sizes says how big the image is: compressed (what a pull moves) and
// unpacked.
func sizes(img v1.Image) string {
	layers, err := img.Layers()
	if err != nil {
		return "?"
	}
	var packed, unpacked int64
	for _, l := range layers {
		if n, err := l.Size(); err == nil {
			packed += n
		}
		if rc, err := l.Uncompressed(); err == nil {
			var c counter
			c.ReadFrom(rc)
			rc.Close()
			unpacked += int64(c)
		}
	}
	return fmt.Sprintf("layers %.1f MiB compressed, %.1f MiB unpacked", float64(packed)/(1<<20), float64(unpacked)/(1<<20))
}

type counter int64

func (c *counter) ReadFrom(r interface{ Read([]byte) (int, error) }) {
	buf := make([]byte, 1<<16)
	for {
		n, err := r.Read(buf)
		*c += counter(n)
		if err != nil {
			return
		}
	}
}

// sourceDateEpoch is every timestamp of the image: SOURCE_DATE_EPOCH (the
// Makefile sets the commit's time), or 1970 when unset.
func sourceDateEpoch() (time.Time, error) {
	v := os.Getenv("SOURCE_DATE_EPOCH")
	if v == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH %q: want seconds since 1970", v)
	}
	return time.Unix(n, 0).UTC(), nil
}

// binaryVersion asks the binary for its version: `sparsevol-csi
// --version` prints "sparsevol VERSION (commit ..., go...)".
func binaryVersion(bin string) (string, error) {
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("%s --version: %w (or give -version)", bin, exitDetail(err))
	}
	f := strings.Fields(string(out))
	if len(f) < 2 || f[0] != "sparsevol" {
		return "", fmt.Errorf("%s --version printed %q (give -version)", bin, bytes.TrimSpace(out))
	}
	return f[1], nil
}
