package attack

import (
	"testing"

	"google.golang.org/grpc/codes"
)

// NodeStage of a volume whose file carries a foreign loop device is
// FailedPrecondition: the window is neither formatted nor mounted, the
// foreign device stays.
func TestStageWithForeignLoop(t *testing.T) {
	for _, fb := range foreignBindings {
		t.Run(fb.name, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			id := p.createVolume("pvc-foreign", 64<<20, nil)
			file := p.backingFile(id)
			c.bindForeign(file, id, fb)
			c.watch(file)
			before := c.snapshot()
			c.expectGRPC(p.stage(id, p.stagingPath(id)), codes.FailedPrecondition)
			c.unchanged(before)
		})
	}
}
