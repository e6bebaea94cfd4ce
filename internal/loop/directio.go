package loop

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// SetDirectIO turns direct I/O on the backing file on or off for the bound
// device at path, live (LOOP_SET_DIRECT_IO), after proving owner as Detach
// does. It returns the device as the kernel reports it afterwards: the
// kernel may refuse direct I/O (the file's filesystem or alignment), which
// is not an error here; the caller reads Device.DirectIO.
func SetDirectIO(path string, owner Owner, on bool) (*Device, error) {
	fd, dev, err := openBound(path, unix.O_RDONLY, &owner)
	if err != nil {
		return nil, fmt.Errorf("set direct I/O on %s: %w", path, err)
	}
	defer unix.Close(fd)
	if dev.DirectIO() == on {
		return dev, nil
	}
	arg := 0
	if on {
		arg = 1
	}
	if err := unix.IoctlSetInt(fd, unix.LOOP_SET_DIRECT_IO, arg); err != nil && !on {
		return nil, fmt.Errorf("set direct I/O on %s: LOOP_SET_DIRECT_IO: %w", path, err)
	}
	now, err := status(fd, dev.Number)
	if err != nil {
		return nil, fmt.Errorf("set direct I/O on %s: %w", path, err)
	}
	return now, nil
}
