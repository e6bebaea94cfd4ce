package volume

import (
	"fmt"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// bindMany binds every volume of vols (none of them attached, their locks
// held by the caller) with loop.AttachMany: one hold of the loop-control
// lock and parallel bindings, which is what makes attach --all of a
// thousand volumes at boot take a fraction of a second. fds are their
// backing files from openBacking, which the caller closes afterwards. It
// returns the devices of those that were bound and the errors of the
// others.
func (s *Store) bindMany(vols []*Volume, fds map[*Volume]int) (map[*Volume]*loop.Device, []error) {
	reqs := make([]loop.AttachRequest, len(vols))
	for i, v := range vols {
		s.keepThick(v, fds[v])
		reqs[i] = loop.AttachRequest{FD: fds[v], Options: s.attachOptions(v),
			Bound: func(d *loop.Device) { s.writeIdentity(v, d) }}
	}
	devs := make(map[*Volume]*loop.Device, len(vols))
	var errs []error
	for i, r := range loop.AttachMany(reqs, loop.DefaultParallel) {
		v := vols[i]
		if r.Err != nil {
			errs = append(errs, fmt.Errorf("volume %s: %w", v.Name, r.Err))
			continue
		}
		if v.DirectIO && !r.Device.DirectIO() {
			s.log.Warn("direct I/O refused by the kernel, using buffered I/O", "volume", v.Name, "device", r.Device.Path)
		}
		s.log.Info("volume attached", "volume", v.Name, "uuid", v.UUID, "device", r.Device.Path, "directIO", r.Device.DirectIO())
		devs[v] = r.Device
	}
	return devs, errs
}

// publishWorkers is how many goroutines write the links, markers and
// statuses of a batch: filesystem metadata syscalls, CPU-bound in the
// kernel, so about the number of cores.
const publishWorkers = 4
