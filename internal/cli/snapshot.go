package cli

import (
	"fmt"
	"os"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/sparsevol/sparsevol/internal/volume"
)

func newSnapshotCommand(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "snapshot",
		Short: "Create, list and delete point-in-time copies of volumes",
		Long: `A snapshot is a file of the store (<root>/.snapshots/<uuid>) holding a copy
of a volume at one point in time. On an XFS (reflink=1) or btrfs store it
shares every extent with the volume and is instant; elsewhere the volume's
data is copied (holes stay holes). A mounted filesystem is frozen for the
copy; a block volume in use is copied as it is: crash-consistent on a
reflink store, torn (parts from different moments) elsewhere. A
snapshot has no device or unit; make a volume of it with
` + "`sparsevol create NAME --from-snapshot SNAPSHOT`" + `, or move it with
` + "`sparsevol export`" + `. Snapshots are independent of their volume, which
may be deleted while they stay.`,
		Example: `  sparsevol snapshot create data data-monday
  sparsevol snapshot list
  sparsevol snapshot delete data-monday`,
	}
	cmd.AddCommand(newSnapshotCreateCommand(g), newSnapshotListCommand(g), newSnapshotDeleteCommand(g))
	return cmd
}

func newSnapshotCreateCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "create VOLUME NAME",
		Short: "Take a snapshot of a volume (idempotent)",
		Long: `Take a snapshot named NAME of VOLUME (a name or UUID) and print its UUID.
A mounted filesystem is frozen while its file is copied (at most the
freeze timeout); an unmounted volume needs nothing; a block volume in use
is copied crash-consistent on a reflink store and torn elsewhere (a copy
read over time: stop its writer first). Rerunning it returns the same
snapshot. Shows progress on the copy path when stderr is a terminal.`,
		Example: `  sparsevol snapshot create data data-monday
  sparsevol snapshot create 6f1c3a52-2f9e-4d7b-9a51-0c7f2d3e4b5a before-upgrade`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := volume.ValidateName(args[1]); err != nil {
				return err
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			var opts volume.SnapshotOptions
			if isTerminal(os.Stderr) {
				opts.Progress = progress(g, "snapshot "+args[1])
			}
			sn, err := s.CreateSnapshot(cmd.Context(), args[0], args[1], opts)
			if err != nil {
				return err
			}
			fmt.Fprintln(g.stdout, sn.UUID)
			return nil
		},
	}
}

func newSnapshotListCommand(g *globals) *cobra.Command {
	var out string
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List the store's snapshots",
		Long: `List the snapshots: source volume, size, what the snapshot's file holds and
what of it is its own (not shared with the volume or other snapshots:
what deleting it gives back), how it was taken (TAKEN: frozen, quiet,
crash-consistent, or torn: copied over time while written, parts from
different moments), and its state.`,
		Example: `  sparsevol snapshot list
  sparsevol snapshot list -o json | jq '.[] | select(.sourceName == "data")'`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			sns, err := s.ListSnapshots(cmd.Context())
			if err != nil {
				return err
			}
			if out == "json" {
				return writeJSONList(g.stdout, sns)
			}
			w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "NAME\tUUID\tSOURCE\tSIZE\tHOLDS\tOWN\tTAKEN\tSTATE\tCREATED")
			var notes []string
			for _, sn := range sns {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n",
					sn.Name, sn.UUID, dash(sn.SourceName), volume.FormatSize(sn.SizeBytes),
					volume.FormatBytes(sn.AllocatedBytes), volume.FormatBytes(sn.OwnBytes),
					dash(string(sn.Consistency)), sn.State, sn.CreatedAt.Format("2006-01-02T15:04:05Z"))
				switch {
				case sn.Problem != "":
					notes = append(notes, sn.Name+": "+sn.Problem)
				case sn.State != volume.StateReady:
					notes = append(notes, fmt.Sprintf("%s: unfinished (%s); rerun the snapshot create or `sparsevol snapshot delete %s`", sn.Name, sn.State, sn.UUID))
				}
			}
			if err := w.Flush(); err != nil {
				return err
			}
			for _, n := range notes {
				fmt.Fprintln(g.stdout, n)
			}
			return nil
		},
	}
	outputFlag(cmd, &out)
	return cmd
}

func newSnapshotDeleteCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "delete SNAPSHOT...",
		Short: "Delete snapshots",
		Long: `Delete each snapshot (a name or UUID): its file, then its metadata. Volumes
made from it are copies and stay. Every snapshot is looked up first: if one
does not exist or is named twice, none is deleted.`,
		Example: `  sparsevol snapshot delete data-monday
  sparsevol snapshot delete 0b9d5a10-8c5e-4a57-b1a3-7f3e9c2d4e61 data-tuesday`,
		Args: minArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := g.store()
			if err != nil {
				return err
			}
			err = resolveRefs("snapshot", args, func(ref string) (string, error) {
				sn, err := s.GetSnapshot(cmd.Context(), ref)
				if err != nil {
					return "", err
				}
				return sn.UUID, nil
			})
			if err != nil {
				return err
			}
			for i, ref := range args {
				if err := notBegun(cmd.Context(), args[i:]); err != nil {
					return err
				}
				if err := s.DeleteSnapshot(cmd.Context(), ref); err != nil {
					return err
				}
			}
			return nil
		},
	}
}
