package volume

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// runner runs external programs (mkfs, sgdisk, blkid, ...) without a shell,
// with an argument vector. Tests may substitute it.
type runner interface {
	run(ctx context.Context, name string, args ...string) ([]byte, error)
}

type execRunner struct{}

// run returns the program's standard output; standard error goes into
// the error message, so that warnings never corrupt parsed output.
//
// The program dies with us: it gets SIGKILL when the thread that started
// it ends (Pdeathsig), and the calling goroutine keeps that thread until
// the program is reaped, so the thread ends only when the process does. A
// killed CLI thus leaves no mkfs or e2fsck writing to, or holding, a
// device that a rerun or delete must then use.
func (execRunner) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	runtime.LockOSThread()
	err := cmd.Run()
	runtime.UnlockOSThread()
	if err != nil {
		msg := strings.TrimSpace(stderr.String() + "\n" + stdout.String())
		if len(msg) > 2000 {
			msg = msg[len(msg)-2000:]
		}
		err = fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, msg)
		if errno := reportedErrno(msg); errno != 0 {
			err = reportedError{err, errno}
		}
		return stdout.Bytes(), err
	}
	return stdout.Bytes(), nil
}

// reportedErrno is ENOSPC or EDQUOT where a program's output reports it
// in strerror's words (LC_ALL=C: "No space left on device", "Disk quota
// exceeded"), else 0: a program that ran out of room says so only there.
func reportedErrno(output string) unix.Errno {
	output = strings.ToLower(output)
	for _, errno := range []unix.Errno{unix.ENOSPC, unix.EDQUOT} {
		if strings.Contains(output, errno.Error()) {
			return errno
		}
	}
	return 0
}

// reportedError is a program's failure whose output reports errno:
// errors.Is finds it as it finds a system call's, its message is the
// program's.
type reportedError struct {
	error
	errno unix.Errno
}

func (e reportedError) Unwrap() []error { return []error{e.error, e.errno} }
