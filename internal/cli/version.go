package cli

import (
	"fmt"
	"runtime/debug"

	"github.com/spf13/cobra"
)

// build is what the binary knows of how it was built.
type build struct {
	Version  string // module version, or "devel"
	Commit   string // VCS revision, "" if unknown
	Modified bool   // built from a tree with uncommitted changes
	Go       string
}

// version is the release version the build stamps into the binary
// (make: -ldflags "-X <this package>.version=$(VERSION)"), the one the
// packages carry. Empty in a plain `go build`: the module version is used.
var version string

// readBuild reads the build information the Go toolchain embeds.
func readBuild() build {
	b := build{Version: "devel"}
	if version != "" {
		b.Version = version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	b.Go = bi.GoVersion
	if v := bi.Main.Version; v != "" && v != "(devel)" && version == "" {
		b.Version = v
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Commit = s.Value
		case "vcs.modified":
			b.Modified = s.Value == "true"
		}
	}
	return b
}

// Version is the release version of this binary, the one `sparsevol
// version` prints.
func Version() string { return readBuild().Version }

func (b build) String() string {
	commit := b.Commit
	if commit == "" {
		commit = "unknown"
	} else if len(commit) > 12 {
		commit = commit[:12]
	}
	if b.Modified {
		commit += "+modified"
	}
	return fmt.Sprintf("sparsevol %s (commit %s, %s)", b.Version, commit, b.Go)
}

func newVersionCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "version",
		Short:   "Print the version, commit and Go version of this binary",
		Example: "  sparsevol version\n  sparsevol --version",
		Args:    exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := fmt.Fprintln(g.stdout, readBuild())
			return err
		},
	}
}

// newMovedCSICommand is where `sparsevol csi` was: the plugin is the
// sparsevol-csi binary now, with the same flags. Hidden; it only says so.
func newMovedCSICommand() *cobra.Command {
	return &cobra.Command{
		Use:                "csi",
		Hidden:             true,
		DisableFlagParsing: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usagef("the CSI plugin is the sparsevol-csi binary: run `sparsevol-csi [--root DIR] --endpoint ... --node-id NODE` (the flags of `sparsevol [--root DIR] csi` before)")
		},
	}
}
