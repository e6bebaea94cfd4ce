package attack

import (
	"os"
	"testing"

	"google.golang.org/grpc/codes"
)

// A NodeStage or NodePublish refused because the device does not hold the
// volume's own filesystem changes nothing: the device it attached to look
// is detached again and its /dev/sparsevol link removed (the contract's
// "FailedPrecondition, nothing changed", read strictly).
func TestStageRefusalLeavesNoDevice(t *testing.T) {
	for _, rpc := range []string{"stage", "publish"} {
		t.Run(rpc, func(t *testing.T) {
			t.Parallel()
			c := newCase(t)
			p := c.startPlugin("022")
			id := p.createVolume("pvc-refused", 16<<20, nil)
			file := p.backingFile(id)
			f, err := os.OpenFile(file, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt(make([]byte, 1024), 1024); err != nil {
				t.Fatal(err)
			}
			f.Close()
			c.watch(file)
			c.uuids = append(c.uuids, id)
			before := c.snapshot()
			if rpc == "stage" {
				err = p.stage(id, p.stagingPath(id))
			} else {
				err = p.publish(id, p.stagingPath(id), p.targetPath(id))
			}
			c.expectGRPC(err, codes.FailedPrecondition)
			c.unchanged(before)
		})
	}
}
