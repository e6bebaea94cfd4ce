package vmrun

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// BuildDeb runs `make packages` in repo with its output under dir and
// returns the .deb. An empty version is the Makefile's (from the
// commit); another names a second build of the same source.
func BuildDeb(repo, dir, version string) (string, error) {
	out := filepath.Join(dir, "out")
	args := []string{"--no-print-directory", "-C", repo, "packages",
		"PKGROOT=" + filepath.Join(dir, "root"), "PKGDIR=" + out}
	if version != "" {
		args = append(args, "VERSION="+version)
	}
	cmd := exec.Command("make", args...)
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("make packages: %v\n%s", err, Tail(log.String(), 40))
	}
	if err := os.WriteFile(filepath.Join(dir, "make-packages.log"), log.Bytes(), 0o644); err != nil {
		return "", err
	}
	debs, _ := filepath.Glob(filepath.Join(out, "*.deb"))
	if len(debs) != 1 {
		return "", fmt.Errorf("make packages wrote %q, want one .deb\n%s", debs, Tail(log.String(), 40))
	}
	return debs[0], nil
}

// InstallDeb installs deb into the image mounted at root (with the chroot
// mounts, MountImage) the way a node installs it: the image's own
// `dpkg -i`, maintainer scripts included, in a chroot. systemd does not
// run there, so nothing is reloaded. dpkg's output goes to log.
func InstallDeb(root, deb string, log *bytes.Buffer) error {
	in := filepath.Join("/var/tmp", filepath.Base(deb))
	if err := CopyFile(deb, filepath.Join(root, in), 0o644); err != nil {
		return err
	}
	defer os.Remove(filepath.Join(root, in))
	cmd := exec.Command("chroot", root, "dpkg", "-i", in)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C", "DEBIAN_FRONTEND=noninteractive"}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("dpkg -i %s in the image: %v\n%s", filepath.Base(deb), err, Tail(log.String(), 40))
	}
	if !strings.Contains(log.String(), "Setting up sparsevol") {
		return fmt.Errorf("dpkg -i %s did not set up sparsevol:\n%s", filepath.Base(deb), Tail(log.String(), 40))
	}
	return nil
}
