package volume

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// Write-behind: a copy into a file (a snapshot's, a restored or imported
// volume's) hands what it wrote to the kernel's writeback as it goes, so
// that the disk works while the copy proceeds and the one flush at the end
// (the caller's fsync) finds little left to write, instead of writing
// everything after the copy. Waiting for ranges far behind the copy
// bounds the dirty pages a copy leaves in the page cache.

const (
	// writeBehindKick is how much written data is gathered before its
	// writeback is started.
	writeBehindKick = 8 << 20
	// writeBehindWindow is how much data may be under writeback, not
	// waited for, behind the copy.
	writeBehindWindow = 128 << 20
)

type span struct{ off, n int64 }

// writeBehind starts the writeback of the file fd as it is written. It
// only orders I/O: durability stays the caller's fsync, which follows.
// The caller owns fd; a writeBehind is used by one goroutine.
type writeBehind struct {
	fd           int
	kick, window int64  // writeBehindKick, writeBehindWindow
	cur          span   // written, writeback not started yet
	started      []span // writeback started, not waited for
	inFlight     int64
	off          bool // the file takes no sync_file_range: writeback is left to the fsync
}

func newWriteBehind(fd int) *writeBehind {
	return &writeBehind{fd: fd, kick: writeBehindKick, window: writeBehindWindow}
}

// wrote notes n bytes written at off.
func (wb *writeBehind) wrote(off, n int64) error {
	if wb.off || n <= 0 {
		return nil
	}
	if wb.cur.n > 0 && off != wb.cur.off+wb.cur.n {
		if err := wb.start(); err != nil {
			return err
		}
	}
	if wb.cur.n == 0 {
		wb.cur.off = off
	}
	wb.cur.n += n
	if wb.cur.n >= wb.kick {
		return wb.start()
	}
	return nil
}

// start starts the writeback of cur, then waits for the oldest ranges
// while more than the window is in flight.
func (wb *writeBehind) start() error {
	r := wb.cur
	wb.cur = span{}
	if err := wb.sync(r, unix.SYNC_FILE_RANGE_WRITE); err != nil || wb.off {
		return err
	}
	wb.started = append(wb.started, r)
	wb.inFlight += r.n
	for wb.inFlight > wb.window {
		old := wb.started[0]
		wb.started = wb.started[1:]
		wb.inFlight -= old.n
		// WAIT_BEFORE: writeback another started on these pages (the
		// kernel's flusher) is waited for before they are written.
		if err := wb.sync(old, unix.SYNC_FILE_RANGE_WAIT_BEFORE|unix.SYNC_FILE_RANGE_WRITE|unix.SYNC_FILE_RANGE_WAIT_AFTER); err != nil {
			return err
		}
	}
	return nil
}

// sync calls sync_file_range on r. A file that does not take it turns
// write-behind off. Any other error is the copy's: a wait consumes the
// writeback error it sees, which the final fsync would then not report.
func (wb *writeBehind) sync(r span, flags int) error {
	err := unix.SyncFileRange(wb.fd, r.off, r.n, flags)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.ESPIPE) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP):
		wb.off = true
		return nil
	}
	return fmt.Errorf("write back %d bytes at %d: %w", r.n, r.off, err)
}
