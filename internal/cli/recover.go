package cli

import (
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/volume"
)

func newRecoverCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "recover VOLUME",
		Short: "Copy an orphaned volume's device back into a new backing file",
		Long: `An orphaned volume's backing file was removed while it was attached: its data
lives on only in the loop device, until that is detached or the node reboots.
recover copies the device into a new sparse backing file (blocks of zeroes
stay holes), detaches the old device and attaches the volume again from the
new file. Unmount the volume first: a copy of a mounted filesystem is not
consistent. It reads the device once for its data and refuses, changing
nothing, a copy the store's filesystem has not the room for; then it copies
that data. Shows progress of both when stderr is a terminal.`,
		Example: `  sparsevol status data        # State: orphaned, Device: /dev/loop3
  umount /mnt/data
  sparsevol recover data`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := g.store()
			if err != nil {
				return err
			}
			var opts volume.RecoverOptions
			if isTerminal(os.Stderr) {
				opts.Scan = progress(g, "recover "+args[0]+": reading")
				opts.Progress = progress(g, "recover "+args[0]+": copying")
			}
			st, err := s.Recover(cmd.Context(), args[0], opts)
			if err != nil {
				return err
			}
			fmt.Fprintf(g.stdout, "%s\t%s\t%s\n", st.Name, st.Device, st.BackingFile)
			return nil
		},
	}
}

// isTerminal reports whether f is a terminal.
func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// progress returns a callback that redraws one stderr line at most every
// 200 ms: what, bytes done of total, and percent.
func progress(g *globals, what string) func(done, total int64) {
	var last time.Time
	return func(done, total int64) {
		if done < total && time.Since(last) < 200*time.Millisecond {
			return
		}
		last = time.Now()
		pct := 100.0
		if total > 0 {
			pct = 100 * float64(done) / float64(total)
		}
		fmt.Fprintf(g.stderr, "\r%s: %s of %s (%.0f%%)", what, volume.FormatBytes(done), volume.FormatBytes(total), pct)
		if done >= total {
			fmt.Fprintln(g.stderr)
		}
	}
}
