//go:build udevflock

package loop

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// The udev lock protocol instead of the private node, built only for the
// A/B measurement of docs/design.md (go build -tags udevflock): a
// QuietUdev attach binds through /dev/loopN itself while holding LOCK_EX on
// it, which udevd honours by holding back its probes of the device and its
// partitions until the lock is released. bindNumber's close releases it.
func init() { quietOpen = openLocked }

func openLocked(n int, flags int) (int, error) {
	fd, err := openDevice(n, flags)
	if err != nil {
		return -1, err
	}
	if err := flock(fd, unix.LOCK_EX); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("lock %s: %w", devicePath(n), err)
	}
	return fd, nil
}
