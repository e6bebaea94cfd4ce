// Command man writes the manual pages (section 8) of the sparsevol
// binaries, generated from their command trees: sparsevol.8 and one page
// per subcommand, and sparsevol-csi.8. `make man` runs it; the generator
// (cobra/doc and its Markdown renderer) is not linked into what ships.
//
//	go run ./tools/man -dir bin/man
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"

	"github.com/sparsevol/sparsevol/internal/cli"
	"github.com/sparsevol/sparsevol/internal/plugincli"
)

func main() {
	dir := flag.String("dir", "", "directory to write the pages to (required)")
	flag.Parse()
	if *dir == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: man -dir DIR")
		os.Exit(2)
	}
	if err := write(*dir); err != nil {
		fmt.Fprintf(os.Stderr, "man: %v\n", err)
		os.Exit(1)
	}
}

func write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	node, _ := cli.NewRootCommand(io.Discard, io.Discard)
	for _, root := range []*cobra.Command{node, plugincli.NewCommand(io.Discard, io.Discard)} {
		header := &doc.GenManHeader{Title: "SPARSEVOL", Section: "8", Source: cli.Version(), Manual: "sparsevol"}
		root.DisableAutoGenTag = true
		if err := doc.GenManTree(root, header, dir); err != nil {
			return fmt.Errorf("%s: %w", root.Name(), err)
		}
	}
	pages, err := filepath.Glob(filepath.Join(dir, "*.8"))
	if err != nil {
		return err
	}
	fmt.Printf("%d pages in %s\n", len(pages), dir)
	return nil
}
