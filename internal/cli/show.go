package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/sparsevol/sparsevol/internal/volume"
)

func outputFlag(cmd *cobra.Command, out *string) {
	cmd.Flags().StringVarP(out, "output", "o", "table", "table or json")
}

func checkOutput(out string) error {
	if out != "table" && out != "json" {
		return usagef("output format %s: want table or json", volume.Quote(out))
	}
	return nil
}

func newListCommand(g *globals) *cobra.Command {
	var out string
	cmd := &cobra.Command{
		Use: "list",
		Example: `  sparsevol list
  sparsevol list -o json | jq '.[] | select(.state != "ready")'`,
		Short: "List the store's volumes with their devices and allocation",
		Args:  exactArgs(0),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			sts, err := s.Statuses()
			if err != nil {
				return err
			}
			if out == "json" {
				return writeJSONList(g.stdout, sts)
			}
			w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "NAME\tUUID\tSIZE\tALLOCATED\tMODE\tFS\tSTATE\tDEVICE\tSTABLE PATH")
			var notes []string
			for _, st := range sts {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s (%.0f%%)\t%s\t%s\t%s\t%s\t%s\n",
					st.Name, st.UUID, sizeLabel(st), volume.FormatBytes(st.AllocatedBytes),
					100*st.AllocatedRatio(), modeLabel(st), dash(st.FSType), st.State, dash(st.Device), st.StablePath)
				if note := stateNote(st); note != "" {
					notes = append(notes, st.Name+": "+note)
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

func newStatusCommand(g *globals) *cobra.Command {
	var out string
	cmd := &cobra.Command{
		Use: "status VOLUME",
		Example: `  sparsevol status data
  sparsevol status 6f1c3a52-2f9e-4d7b-9a51-0c7f2d3e4b5a -o json`,
		Short: "Show one volume: metadata, device, stable path, allocation",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(out); err != nil {
				return err
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			st, err := s.Status(args[0])
			if err != nil {
				return err
			}
			if out == "json" {
				return writeJSON(g.stdout, st)
			}
			w := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
			row := func(k, v string) { fmt.Fprintf(w, "%s:\t%s\n", k, v) }
			row("Name", st.Name)
			row("UUID", st.UUID)
			row("State", string(st.State))
			if note := stateNote(st); note != "" {
				row("Note", note)
			}
			row("Size", fmt.Sprintf("%s (%d bytes)", volume.FormatSize(st.SizeBytes), st.SizeBytes))
			if st.ExpandingTo != 0 {
				row("Expanding to", fmt.Sprintf("%s (%d bytes; backing file %d bytes)", volume.FormatSize(st.ExpandingTo), st.ExpandingTo, st.FileSizeBytes))
			}
			row("Allocated", fmt.Sprintf("%s (%.1f%%)", volume.FormatBytes(st.AllocatedBytes), 100*st.AllocatedRatio()))
			if st.SharedBytes > 0 {
				row("Shared", volume.FormatBytes(st.SharedBytes)+" of it with snapshots or clones (counted once in the store's space)")
			}
			row("Mode", modeLabel(st))
			row("Filesystem", dash(st.FSType))
			row("Backing file", st.BackingFile)
			switch {
			case st.FromSnapshot != "":
				row("Made from", "snapshot "+st.FromSnapshot)
			case st.ClonedFrom != "":
				row("Made from", "volume "+st.ClonedFrom+" (clone)")
			}
			row("Attached", strconv.FormatBool(st.Attached))
			row("Device", dash(st.Device))
			row("Data device", dash(st.DataDevice))
			row("Direct I/O", fmt.Sprintf("%v (requested %v)", st.DirectIOActive, st.DirectIO))
			row("I/O limits", volume.FormatLimits(st.IOLimits))
			row("Stable path", fmt.Sprintf("%s (exists: %v)", st.StablePath, st.StablePathExists))
			for _, m := range st.MountPoints {
				row("Mounted at", volume.Shown(m))
			}
			for _, d := range st.ForeignDevices {
				row("Foreign device", d+" (bound to the volume's file by someone else; left alone)")
			}
			if st.Problem != "" {
				row("Problem", st.Problem)
			}
			return w.Flush()
		},
	}
	outputFlag(cmd, &out)
	return cmd
}

// sizeLabel is the size, and where an expansion is pending, its target.
func sizeLabel(st *volume.Status) string {
	if st.ExpandingTo != 0 {
		return volume.FormatSize(st.SizeBytes) + "->" + volume.FormatSize(st.ExpandingTo)
	}
	return volume.FormatSize(st.SizeBytes)
}

// stateNote says what a volume in a state that needs the operator is, and
// what to do about it; "" for the others.
func stateNote(st *volume.Status) string {
	switch st.State {
	case volume.StateBroken:
		return fmt.Sprintf("broken: %s (repair the file, or `sparsevol delete %s`)", st.Problem, st.UUID)
	case volume.StateNewer:
		return "written by a newer sparsevol: " + st.Problem
	case volume.StateExpanding:
		size := volume.FormatSize(st.ExpandingTo)
		return fmt.Sprintf("an expansion to %s is pending: `sparsevol expand %s --size %s` finishes it, `sparsevol expand %s --abandon` abandons it",
			size, st.UUID, size, st.UUID)
	}
	return ""
}

func modeLabel(st *volume.Status) string {
	switch {
	case st.Mode == volume.ModeBlock && st.Partitioned:
		return "block (GPT)"
	case st.Mode == volume.ModeBlock:
		return "block (whole)"
	}
	return dash(string(st.Mode))
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// writeJSONList writes a list as JSON; an empty list is `[]`, never `null`.
func writeJSONList[T any](w io.Writer, list []T) error {
	if list == nil {
		list = []T{}
	}
	return writeJSON(w, list)
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
