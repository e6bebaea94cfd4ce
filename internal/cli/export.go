package cli

import (
	"bufio"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/volume"
)

func newExportCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "export VOLUME|SNAPSHOT > FILE",
		Short: "Write a volume or snapshot to stdout as a sparse stream",
		Long: `Write the volume or snapshot (a name or UUID; volumes are looked up first)
to stdout as a sparse stream: a header with size, mode and filesystem, the
data extents with their offsets (never the holes), and a CRC-32C checksum.
` + "`sparsevol import`" + ` reads it on this or another node. A volume is
exported only while nothing uses it: one used or written while it is read
fails the export, and the stream, left without its end, fails the import.
For a volume in use, take a snapshot and export that. Refuses a terminal
as stdout, and a file of the store (which the stream would overwrite).
Shows progress when stderr is a terminal.`,
		Example: `  sparsevol export data | ssh node2 sparsevol import data
  sparsevol snapshot create data nightly && sparsevol export nightly | zstd > /backup/data.svs.zst
  zstd -dc /backup/data.svs.zst | sparsevol import data-restored`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if isTerminal(os.Stdout) {
				ref := args[0]
				if !volume.PlainName(ref) {
					ref = "VOLUME"
				}
				return usagef("export writes a binary stream; redirect stdout to a file or a pipe (`sparsevol export %s | ssh node2 sparsevol import NAME`)", ref)
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			if err := s.CheckStreamTarget(os.Stdout); err != nil {
				return err
			}
			var opts volume.StreamOptions
			if isTerminal(os.Stderr) {
				opts.Progress = progress(g, "export "+args[0])
			}
			growPipe(os.Stdout)
			w := bufio.NewWriterSize(g.stdout, 1<<20)
			if _, err := s.Export(cmd.Context(), args[0], w, opts); err != nil {
				return err
			}
			return w.Flush()
		},
	}
}

func newImportCommand(g *globals) *cobra.Command {
	var keepUUID, noStart bool
	cmd := &cobra.Command{
		Use:   "import NAME < STREAM",
		Short: "Create a volume from a sparse stream on stdin",
		Long: `Read a stream written by ` + "`sparsevol export`" + ` from stdin and create the volume
NAME from it. Everything is checked (format, bounds, order of the extents,
checksum) before the volume appears; a stream that fails leaves nothing.
The volume gets a filesystem UUID (or partition GUID) of its own, unless
--keep-uuid and no volume, snapshot, filesystem or partition of this node
has the stream's. Prints the UUID. Shows progress when stderr is a
terminal.`,
		Example: `  ssh node1 sparsevol export data | sparsevol import data
  sparsevol import data --keep-uuid < data.svs`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := volume.ValidateName(args[0]); err != nil {
				return err
			}
			if isTerminal(os.Stdin) {
				return usagef("import reads a stream from stdin; pipe one in (`ssh node1 sparsevol export VOLUME | sparsevol import %s`)", args[0])
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			req := volume.ImportRequest{Name: args[0], KeepUUID: keepUUID, KeepAttached: !noStart}
			if isTerminal(os.Stderr) {
				req.Progress = progress(g, "import "+args[0])
			}
			growPipe(os.Stdin)
			v, err := s.Import(cmd.Context(), bufio.NewReaderSize(os.Stdin, 1<<20), req)
			if err != nil {
				return err
			}
			fmt.Fprintln(g.stdout, v.UUID)
			return nil
		},
	}
	cmd.Flags().BoolVar(&keepUUID, "keep-uuid", false, "keep the stream's UUID (refused if this node has it)")
	cmd.Flags().BoolVar(&noStart, "no-start", false, "enable the unit but do not attach now")
	return cmd
}

// growPipe gives f, if it is a pipe, a buffer as large as the stream's
// largest record, so that a stream costs fewer context switches than with
// the kernel's default; anything else is left as it is.
func growPipe(f *os.File) {
	var st unix.Stat_t
	if unix.Fstat(int(f.Fd()), &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFIFO {
		_, _ = unix.FcntlInt(f.Fd(), unix.F_SETPIPE_SZ, 1<<20)
	}
}
