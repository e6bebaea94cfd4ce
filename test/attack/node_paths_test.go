package attack

import (
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"
)

// Node paths must be absolute, clean, free of symlinks and under
// --kubelet-dir: InvalidArgument, and nothing is mounted or created.
func TestNodePathsRefused(t *testing.T) {
	type pathCase struct {
		name string
		path func(p *plugin, c *kase) string
	}
	paths := []pathCase{
		{"/etc", func(*plugin, *kase) string { return "/etc" }},
		{"relative", func(*plugin, *kase) string { return "pods/p/volumes/mount" }},
		{"dot-dot out of the kubelet dir", func(p *plugin, _ *kase) string { return p.kubelet + "/pods/p/../../../outside/mount" }},
		{"not clean inside the kubelet dir", func(p *plugin, _ *kase) string { return p.kubelet + "/pods/p/./volumes/mount" }},
		{"outside the kubelet dir", func(_ *plugin, c *kase) string { return c.path("outside", "mount") }},
		{"the kubelet dir itself", func(p *plugin, _ *kase) string { return p.kubelet }},
		{"through a symlink", func(p *plugin, c *kase) string {
			if err := os.MkdirAll(filepath.Join(p.kubelet, "pods"), 0o750); err != nil {
				c.t.Fatal(err)
			}
			if err := os.Symlink(c.path("outside"), filepath.Join(p.kubelet, "pods", "evil")); err != nil {
				c.t.Fatal(err)
			}
			return filepath.Join(p.kubelet, "pods", "evil", "mount")
		}},
	}
	for _, pc := range paths {
		t.Run("publish/"+pc.name, func(t *testing.T) {
			c := newCase(t) // not parallel: a regression mounts over /etc of this namespace
			p := c.startPlugin("022")
			id := p.createVolume("pvc-paths", 16<<20, nil)
			staging := p.mustStage(id)
			c.mkdir("outside")
			c.watch(c.path("outside"))
			c.watchMountPoint("/etc")
			target := pc.path(p, c)
			before := c.snapshot()
			c.expectGRPC(p.publish(id, staging, target), codes.InvalidArgument)
			c.unchanged(before)
		})
		t.Run("stage/"+pc.name, func(t *testing.T) {
			c := newCase(t)
			p := c.startPlugin("022")
			id := p.createVolume("pvc-paths", 16<<20, nil)
			c.mkdir("outside")
			c.watch(c.path("outside"))
			c.watchMountPoint("/etc")
			staging := pc.path(p, c)
			before := c.snapshot()
			c.expectGRPC(p.stage(id, staging), codes.InvalidArgument)
			c.unchanged(before)
		})
	}
}

// NodeUnpublish and NodeUnstage of an unknown volume id are NotFound and
// touch nothing; with a known id they unmount or remove only what is
// proven the volume's.
func TestNodeTeardownTouchesOnlyTheVolume(t *testing.T) {
	unknown := "3d3c1b0e-5a0f-4c61-9d6e-2b7a8f9e0c1d"
	for _, tc := range []struct {
		name  string
		known bool
		op    string
		setup func(c *kase, path string)
		codes []codes.Code
	}{
		{"unpublish unknown id, file at target", false, "unpublish", func(c *kase, path string) {
			if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
				c.t.Fatal(err)
			}
			if err := os.WriteFile(path, []byte("someone's file"), 0o600); err != nil {
				c.t.Fatal(err)
			}
			c.watch(path)
		}, []codes.Code{codes.NotFound}},
		{"unpublish unknown id, directory at target", false, "unpublish", func(c *kase, path string) {
			if err := os.MkdirAll(path, 0o750); err != nil {
				c.t.Fatal(err)
			}
			c.watch(path)
		}, []codes.Code{codes.NotFound}},
		{"unpublish unknown id, tmpfs at target", false, "unpublish", func(c *kase, path string) { c.mountForeignTmpfs(path) }, []codes.Code{codes.NotFound}},
		{"unstage unknown id, tmpfs at staging", false, "unstage", func(c *kase, path string) { c.mountForeignTmpfs(path) }, []codes.Code{codes.NotFound}},
		{"unpublish known id, file at target", true, "unpublish", func(c *kase, path string) {
			if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
				c.t.Fatal(err)
			}
			if err := os.WriteFile(path, []byte("someone's file"), 0o600); err != nil {
				c.t.Fatal(err)
			}
			c.watch(path)
		}, []codes.Code{codes.OK, codes.FailedPrecondition}},
		{"unpublish known id, directory with a file at target", true, "unpublish", func(c *kase, path string) {
			if err := os.MkdirAll(path, 0o750); err != nil {
				c.t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(path, "keep"), []byte("someone's file"), 0o600); err != nil {
				c.t.Fatal(err)
			}
			c.watch(path)
		}, []codes.Code{codes.OK, codes.FailedPrecondition}},
		{"unpublish known id, tmpfs at target", true, "unpublish", func(c *kase, path string) { c.mountForeignTmpfs(path) }, []codes.Code{codes.OK, codes.FailedPrecondition}},
		{"unstage known id, tmpfs at staging", true, "unstage", func(c *kase, path string) { c.mountForeignTmpfs(path) }, []codes.Code{codes.OK, codes.FailedPrecondition}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			id := unknown
			if tc.known {
				id = p.createVolume("pvc-teardown", 16<<20, nil)
			}
			path := p.targetPath(id)
			if tc.op == "unstage" {
				path = p.stagingPath(id)
			}
			tc.setup(c, path)
			before := c.snapshot()
			var err error
			if tc.op == "unstage" {
				err = p.unstage(id, path)
			} else {
				err = p.unpublish(id, path)
			}
			c.expectGRPC(err, tc.codes...)
			c.unchanged(before)
		})
	}
}
