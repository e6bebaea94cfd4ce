package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"
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

// newManCommand writes the manual pages of the command tree (section 8:
// sparsevol.8 and one page per subcommand); make install installs them.
func newManCommand(g *globals) *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:    "man --dir DIR",
		Short:  "Write the manual pages (section 8) into DIR",
		Hidden: true,
		Args:   exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return fmt.Errorf("man: %w", err)
			}
			header := &doc.GenManHeader{Title: "SPARSEVOL", Section: "8", Source: readBuild().Version, Manual: "sparsevol"}
			root := cmd.Root()
			root.DisableAutoGenTag = true
			if err := doc.GenManTree(root, header, dir); err != nil {
				return fmt.Errorf("man: %w", err)
			}
			pages, _ := filepath.Glob(filepath.Join(dir, "*.8"))
			fmt.Fprintf(g.stdout, "%d pages in %s\n", len(pages), dir)
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory to write the pages to")
	_ = cmd.MarkFlagRequired("dir")
	return cmd
}
