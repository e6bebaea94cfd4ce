package cli

import (
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/sparsevol/sparsevol/internal/volume"
)

func newTrimCommand(g *globals) *cobra.Command {
	var all bool
	var out string
	cmd := &cobra.Command{
		Use: "trim VOLUME...|--all",
		Example: `  sparsevol trim data
  sparsevol trim --all -o json`,
		Short: "Give the free space of mounted volumes back to the store (FITRIM)",
		Long: `Run FITRIM on each mounted filesystem volume: the filesystem discards its
free blocks and the loop device punches them out of the sparse backing file.
Prints the bytes the backing file gave back (its allocated size before and
after) next to what the filesystem itself uses.

Volumes that are not mounted are not trimmed (nothing is mounted behind the
back of whoever owns the volume): named ones are an error, with --all they
are listed as skipped. Thick (--preallocate) volumes are never trimmed: their
backing file is re-allocated instead, filling any holes that discards from
inside punched, so they stay fully allocated.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := allOrArgs(all, args); err != nil {
				return err
			}
			if err := checkOutput(out); err != nil {
				return err
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			var results []*volume.TrimResult
			if all {
				results, err = s.TrimAll(cmd.Context())
			} else {
				err = eachVolume(cmd.Context(), s, args, func(ref string) error {
					res, err := s.Trim(cmd.Context(), ref)
					if res != nil && (err == nil || res.Skipped != "") {
						results = append(results, res)
					}
					return err
				})
			}
			if out == "json" {
				if werr := writeJSONList(g.stdout, results); werr != nil {
					return errors.Join(err, werr)
				}
				return err
			}
			writeTrimTable(g, results)
			return err
		},
	}
	cmd.Flags().BoolVar(&all, "all", false, "trim every mounted volume of the store")
	outputFlag(cmd, &out)
	return cmd
}

func writeTrimTable(g *globals, results []*volume.TrimResult) {
	w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "NAME\tMOUNTED AT\tALLOCATED BEFORE\tAFTER\tRECLAIMED\tFS USES\tNOTE")
	for _, r := range results {
		note, fsUses := r.Skipped, "-"
		switch {
		case r.Thick:
			note = "thick: re-allocated, not trimmed"
		case r.Skipped == "":
			fsUses = volume.FormatBytes(r.FilesystemUsedBytes)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, dash(volume.Shown(r.MountPoint)),
			volume.FormatBytes(r.AllocatedBefore), volume.FormatBytes(r.AllocatedAfter), volume.FormatBytes(r.ReclaimedBytes()), fsUses, dash(note))
	}
	w.Flush()
}
