//go:build e2e

package k8s

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The node image is test/vm's base image (Debian, systemd, udev, Debian's
// kernel) plus what a Kubernetes node needs from Debian, installed with apt
// into a copy. It is cached under $SPARSEVOL_K8S_CACHE/node-<key>/, key =
// the base image's key, the package list and nodeRecipe.
const nodeRecipe = "v1"

var nodePackages = []string{
	"containerd", "runc", "containernetworking-plugins", "iptables", "conntrack",
	"ca-certificates", "busybox-static", "procps", "iproute2", "curl", "dbus",
}

type nodeImage struct {
	Dir, Disk, Kernel, Initrd string
	Built                     time.Duration
}

// baseImage asks test/vm for its cached base image (building it if needed).
func baseImage(t *testing.T, cfg config) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "image-dir")
	cmd := exec.Command(cfg.goCmd, "test", "-tags", "e2e", "-count=1", "-timeout", "30m",
		"-run", "^TestExportImage$", "./test/vm/")
	cmd.Dir = cfg.repo
	cmd.Env = append(os.Environ(), "SPARSEVOL_E2E_IMAGE_OUT="+out)
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	t0 := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("test/vm base image: %v\n%s", err, tail(buf.String(), 40))
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatalf("test/vm base image: no directory reported: %v\n%s", err, tail(buf.String(), 40))
	}
	dir := strings.TrimSpace(string(b))
	logf(t, "base image (test/vm): %s (%s)", dir, time.Since(t0).Round(time.Second))
	return dir
}

func buildNodeImage(t *testing.T, cfg config) nodeImage {
	t.Helper()
	base := baseImage(t, cfg)
	h := sha256.New()
	fmt.Fprintf(h, "recipe %s\nbase %s\npackages %s\n", nodeRecipe, filepath.Base(base), strings.Join(nodePackages, ","))
	key := hex.EncodeToString(h.Sum(nil))[:16]
	dir := filepath.Join(cfg.cache, "node-"+key)
	img := nodeImage{Dir: dir, Disk: filepath.Join(dir, "root.img"), Kernel: filepath.Join(dir, "vmlinuz"), Initrd: filepath.Join(dir, "initrd.img")}
	if err := os.MkdirAll(cfg.cache, 0o755); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(filepath.Join(cfg.cache, ".node-lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)
	if _, err := os.Stat(filepath.Join(dir, "complete")); err == nil {
		logf(t, "node image: cached %s", dir)
		return img
	}
	t0 := time.Now()
	tmp := dir + ".partial"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	logf(t, "node image: building %s from %s (apt: %s)", dir, base, strings.Join(nodePackages, " "))
	if err := buildNodeInto(t, base, tmp); err != nil {
		t.Fatalf("node image: %v (partial build kept in %s)", err, tmp)
	}
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		t.Fatal(err)
	}
	img.Built = time.Since(t0)
	logf(t, "node image: built in %s", img.Built.Round(time.Second))
	return img
}

func buildNodeInto(t *testing.T, base, dir string) error {
	logPath := filepath.Join(dir, "build.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	run := func(name string, args ...string) error {
		fmt.Fprintf(logFile, "+ %s %s\n", name, strings.Join(args, " "))
		cmd := exec.Command(name, args...)
		cmd.Stdout, cmd.Stderr = logFile, logFile
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C")
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s %s: %v; last lines of %s:\n%s", name, strings.Join(args, " "), err, logPath, tailFile(logPath, 30))
		}
		return nil
	}
	disk := filepath.Join(dir, "root.img")
	if err := run("cp", "--sparse=always", filepath.Join(base, "root.img"), disk); err != nil {
		return err
	}
	mnt := filepath.Join(dir, "mnt")
	os.MkdirAll(mnt, 0o755)
	if err := run("mount", "-o", "loop", disk, mnt); err != nil {
		return err
	}
	var mounted []string
	defer func() {
		for i := len(mounted) - 1; i >= 0; i-- {
			run("umount", "-l", mounted[i])
		}
		run("umount", mnt)
		os.Remove(mnt)
	}()
	for _, m := range []struct{ fstype, src, dst string }{
		{"proc", "proc", "proc"}, {"sysfs", "sysfs", "sys"}, {"", "/dev", "dev"}, {"", "/dev/pts", "dev/pts"},
	} {
		dst := filepath.Join(mnt, m.dst)
		os.MkdirAll(dst, 0o755)
		args := []string{"-t", m.fstype, m.src, dst}
		if m.fstype == "" {
			args = []string{"--bind", m.src, dst}
		}
		if err := run("mount", args...); err != nil {
			return err
		}
		mounted = append(mounted, dst)
	}
	// No service may start inside the chroot.
	policy := filepath.Join(mnt, "usr/sbin/policy-rc.d")
	if err := os.WriteFile(policy, []byte("#!/bin/sh\nexit 101\n"), 0o755); err != nil {
		return err
	}
	resolv := filepath.Join(mnt, "etc/resolv.conf")
	oldResolv, _ := os.ReadFile(resolv)
	if b, err := os.ReadFile("/etc/resolv.conf"); err == nil {
		os.Remove(resolv)
		os.WriteFile(resolv, b, 0o644)
	}
	if err := run("chroot", mnt, "apt-get", "update", "-q"); err != nil {
		return err
	}
	args := append([]string{mnt, "apt-get", "install", "-y", "-q", "--no-install-recommends"}, nodePackages...)
	if err := run("chroot", args...); err != nil {
		return err
	}
	run("chroot", mnt, "apt-get", "clean")
	os.RemoveAll(filepath.Join(mnt, "var/lib/apt/lists"))
	os.MkdirAll(filepath.Join(mnt, "var/lib/apt/lists/partial"), 0o755)
	os.Remove(policy)
	os.Remove(resolv)
	os.WriteFile(resolv, oldResolv, 0o644)

	// containerd: Debian's defaults, with the local pause image, systemd
	// cgroups and Debian's CNI plugin directory.
	var conf bytes.Buffer
	cmd := exec.Command("chroot", mnt, "containerd", "config", "default")
	cmd.Stdout, cmd.Stderr = &conf, logFile
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("containerd config default: %v", err)
	}
	edited, err := editContainerdConfig(conf.String())
	if err != nil {
		return err
	}
	os.MkdirAll(filepath.Join(mnt, "etc/containerd"), 0o755)
	if err := os.WriteFile(filepath.Join(mnt, "etc/containerd/config.toml"), []byte(edited), 0o644); err != nil {
		return err
	}
	// The kernel and initramfs, as installed now.
	for _, k := range []struct{ glob, dst string }{{"boot/vmlinuz-*", "vmlinuz"}, {"boot/initrd.img-*", "initrd.img"}} {
		m, _ := filepath.Glob(filepath.Join(mnt, k.glob))
		if len(m) != 1 {
			return fmt.Errorf("expected one %s, found %v", k.glob, m)
		}
		b, err := os.ReadFile(m[0])
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, k.dst), b, 0o644); err != nil {
			return err
		}
	}
	manifest := fmt.Sprintf("recipe %s\nbase %s\npackages %s\nbuilt %s\n", nodeRecipe, base, strings.Join(nodePackages, " "), time.Now().UTC().Format(time.RFC3339))
	return os.WriteFile(filepath.Join(dir, "complete"), []byte(manifest), 0o644)
}

// editContainerdConfig changes the three settings of a `containerd config
// default` that the node needs, and fails if one is not found.
func editContainerdConfig(conf string) (string, error) {
	edits := []struct {
		prefix, line string
		done         bool
	}{
		{prefix: "sandbox_image =", line: `sandbox_image = "localhost/pause:1"`},
		{prefix: "SystemdCgroup =", line: "SystemdCgroup = true"},
		{prefix: "bin_dir =", line: `bin_dir = "/usr/lib/cni"`},
	}
	var out strings.Builder
	sc := bufio.NewScanner(strings.NewReader(conf))
	for sc.Scan() {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		for i := range edits {
			if strings.HasPrefix(trimmed, edits[i].prefix) {
				line = line[:len(line)-len(strings.TrimLeft(line, " \t"))] + edits[i].line
				edits[i].done = true
			}
		}
		out.WriteString(line + "\n")
	}
	for _, e := range edits {
		if !e.done {
			return "", fmt.Errorf("containerd config: no %q line", e.prefix)
		}
	}
	return out.String(), nil
}
