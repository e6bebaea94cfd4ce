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
		return stdout.Bytes(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, msg)
	}
	return stdout.Bytes(), nil
}
