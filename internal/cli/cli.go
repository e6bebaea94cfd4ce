// Package cli is the sparsevol command line: flags, output and exit codes.
// Volume commands call internal/volume, handing it systemd.Manager as the
// store's Lifecycle where systemd runs. It also gives the CSI plugin's
// binary (package plugincli) the flags, exit codes and version every
// sparsevol binary shares, and imports nothing of the plugin's: what it
// links is what every node command pays for at start. It holds no volume
// logic.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/sys/unix"

	"github.com/sparsevol/sparsevol/internal/iolimit"
	"github.com/sparsevol/sparsevol/internal/systemd"
	"github.com/sparsevol/sparsevol/internal/udev"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// Exit codes of the contract.
const (
	ExitOK      = 0
	ExitFailure = 1
	ExitInvalid = 2
)

// usageError marks errors in how the command was called (flags, args).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error {
	return usageError{fmt.Errorf(format, args...)}
}

// ExitCode maps an error to the contract's exit codes: 2 for input that
// was rejected before anything changed, 1 for anything else.
func ExitCode(err error) int {
	var ue usageError
	switch {
	case err == nil:
		return ExitOK
	case errors.As(err, &ue),
		errors.Is(err, volume.ErrInvalid),
		errors.Is(err, volume.ErrNotFound),
		errors.Is(err, volume.ErrExists),
		errors.Is(err, volume.ErrNoSpace):
		return ExitInvalid
	}
	return ExitFailure
}

// globals are the flags every command shares.
type globals struct {
	root       string
	overcommit float64
	unitDir    string
	udevWait   time.Duration
	runDir     string
	verbose    bool
	ioLimits   iolimit.Config
	stdout     io.Writer
	stderr     io.Writer
}

func (g *globals) logger() *slog.Logger {
	level := slog.LevelWarn
	if g.verbose {
		level = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(g.stderr, &slog.HandlerOptions{Level: level}))
}

func (g *globals) store() (*volume.Store, error) { return volume.Open(g.root, g.storeOptions()) }

func (g *globals) storeOptions() volume.Options {
	return volume.Options{
		OvercommitRatio: g.overcommit,
		UdevTimeout:     g.udevWait,
		AttachedDir:     g.attachedDir(),
		UdevIdentityDir: g.udevIdentityDir(),
		Udev:            g.udev(),
		Logger:          g.logger(),
		Lifecycle:       g.lifecycle(),
		IOLimits:        g.ioLimits,
	}
}

// lifecycle is the service manager of the store's volumes: the units
// where systemd runs, else none.
func (g *globals) lifecycle() volume.Lifecycle {
	if !systemd.Running() {
		return nil
	}
	return g.units()
}

// attachedDir is where attach marks what it brought up: only where the
// units' boot mode asserts it (systemd runs), or where --run-dir asks.
func (g *globals) attachedDir() string {
	if g.runDir == "" && !systemd.Running() {
		return ""
	}
	return g.units().AttachedDir()
}

// udevIdentityDir is where attach leaves volumes' identities for udev's
// rule: where udev runs, or where --run-dir asks.
func (g *globals) udevIdentityDir() string {
	if g.runDir == "" && !udev.Host.Running() {
		return ""
	}
	return g.units().UdevIdentityDir()
}

// udev is udevd's runtime directory where udev runs on this node.
func (g *globals) udev() udev.Dir {
	if !udev.Host.Running() {
		return ""
	}
	return udev.Host
}

func (g *globals) units() systemd.Manager {
	return systemd.Manager{Dir: g.unitDir, RunDir: g.runDir}
}

// NewRootCommand builds the node command tree: what operators and the
// units run (the sparsevol binary). The CSI plugin is another binary
// (package plugincli), so that gRPC, protobuf and Prometheus are not linked
// into, nor initialised by, every short-lived node command.
func NewRootCommand(stdout, stderr io.Writer) (*cobra.Command, *globals) {
	root, g := newCommand(stdout, stderr)
	root.Use = "sparsevol"
	root.Short = "Persistent sparse-file volumes behind loop devices"
	root.Long = `sparsevol makes volumes from sparse files on the node's own disk, exposed
through loop devices, and brings them back at every boot with a systemd
template unit (sparsevol@<uuid>.service) — no network, no API server.
The CSI plugin for Kubernetes is the sparsevol-csi binary.`
	root.AddCommand(
		newCreateCommand(g), newAttachCommand(g), newDetachCommand(g),
		newDeleteCommand(g), newExpandCommand(g), newListCommand(g),
		newStatusCommand(g), newPVCommand(g), newAdoptCommand(g),
		newUnitsCommand(g), newDoctorCommand(g), newTrimCommand(g),
		newRecoverCommand(g), newVersionCommand(g),
		newLimitCommand(g),
		newSnapshotCommand(g), newExportCommand(g), newImportCommand(g),
		newMovedCSICommand(),
	)
	refuseUnknownCommands(root)
	return root, g
}

// StoreFlags is what the shared flags say about the store, for a binary
// whose command is built outside this package (the CSI plugin's).
type StoreFlags struct {
	Root    string
	Options volume.Options
	Stderr  io.Writer
}

// NewStoreCommand is the root command of a binary that does one thing
// with the store: it takes the flags every sparsevol command takes
// (--root, --overcommit-ratio, ...) and, once they are parsed and
// checked, calls run with what they say. The caller adds its own flags,
// Use and help. Execute runs it with the contract's exit codes.
func NewStoreCommand(stdout, stderr io.Writer, run func(cmd *cobra.Command, s StoreFlags) error) *cobra.Command {
	root, g := newCommand(stdout, stderr)
	root.Args = exactArgs(0)
	root.RunE = func(cmd *cobra.Command, _ []string) error {
		return run(cmd, StoreFlags{
			Root: g.root,
			// Volumes the plugin serves have no units and no boot marks.
			Options: volume.Options{OvercommitRatio: g.overcommit, UdevTimeout: g.udevWait, IOLimits: g.ioLimits},
			Stderr:  g.stderr,
		})
	}
	return root
}

// newCommand is the frame both binaries share: the flags every command
// takes, with their environment defaults, usage errors for bad flags, and
// --version.
func newCommand(stdout, stderr io.Writer) (*cobra.Command, *globals) {
	g := &globals{stdout: stdout, stderr: stderr}
	root := &cobra.Command{
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{flagError(err)} })

	defRoot := os.Getenv(volume.RootEnv)
	if defRoot == "" {
		defRoot = volume.DefaultRoot
	}
	g.overcommit = 1
	var envErr error
	if v := os.Getenv(OvercommitEnv); v != "" {
		if err := (*ratioValue)(&g.overcommit).Set(v); err != nil {
			envErr = usagef("%s: %w", OvercommitEnv, err)
		}
	}
	// A bad environment counts only where the flag does not override it.
	// An empty --unit-dir (an unset variable in a staging script) would
	// be the host's unit directory: refused, not read as the default.
	root.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
		if envErr != nil && !cmd.Flags().Changed(overcommitFlag) {
			return envErr
		}
		if cmd.Flags().Changed(unitDirFlag) && g.unitDir == "" {
			return usagef("--%s is empty: give the unit directory, or leave the flag out for %s", unitDirFlag, systemd.DefaultUnitDir)
		}
		return nil
	}
	pf := root.PersistentFlags()
	pf.StringVar(&g.root, "root", defRoot, "store directory (env "+volume.RootEnv+")")
	pf.Var((*ratioValue)(&g.overcommit), overcommitFlag,
		"how much the volumes' logical sizes may exceed what the store's filesystem can give them; 1 = never (env "+OvercommitEnv+")")
	pf.StringVar(&g.unitDir, unitDirFlag, systemd.DefaultUnitDir, "systemd unit directory")
	pf.StringVar(&g.runDir, "run-dir", "", "where attach marks what it brought up since boot (default "+systemd.DefaultRunDir+" where systemd runs)")
	_ = pf.MarkHidden("run-dir") // for tests; must match what the units assert
	pf.DurationVar(&g.udevWait, "udev-timeout", 30*time.Second, "how long attach waits for udev's /dev/disk link")
	pf.BoolVarP(&g.verbose, "verbose", "v", false, "log each step to stderr")
	addCgroupFlags(g, pf)

	root.Version = readBuild().String()
	root.SetVersionTemplate("{{.Version}}\n")
	return root, g
}

// flagError is pflag's error for a bad command line with what the command
// line gave shown through volume.Quote: pflag's own text echoes an
// unknown flag and a refused value whole and raw, and the parser's error
// it wraps echoes the value again. Where the flag checks its value itself
// (its error wraps volume.ErrInvalid and quotes the value), that error is
// the reason; else the kind of value the flag wants is.
func flagError(err error) error {
	var (
		invalid  *pflag.InvalidValueError
		notExist *pflag.NotExistError
		syntax   *pflag.InvalidSyntaxError
	)
	switch {
	case errors.As(err, &invalid) && errors.Is(invalid, volume.ErrInvalid):
		return fmt.Errorf("--%s: %w", invalid.GetFlag().Name, invalid.Unwrap())
	case errors.As(err, &invalid):
		return fmt.Errorf("invalid value %s for --%s: want a %s", volume.Quote(invalid.GetValue()), invalid.GetFlag().Name, invalid.GetFlag().Value.Type())
	case errors.As(err, &notExist) && notExist.GetSpecifiedShortnames() != "":
		return fmt.Errorf("unknown shorthand flag %s in %s", volume.Quote(notExist.GetSpecifiedName()), volume.Quote("-"+notExist.GetSpecifiedShortnames()))
	case errors.As(err, &notExist):
		return fmt.Errorf("unknown flag %s", volume.Quote("--"+notExist.GetSpecifiedName()))
	case errors.As(err, &syntax):
		return fmt.Errorf("bad flag syntax %s", volume.Quote(syntax.GetSpecifiedFlag()))
	}
	return err
}

// OvercommitEnv names the environment variable that sets the default of
// --overcommit-ratio.
const OvercommitEnv = "SPARSEVOL_OVERCOMMIT_RATIO"

const (
	overcommitFlag = "overcommit-ratio"
	unitDirFlag    = "unit-dir"
)

// ratioValue is the --overcommit-ratio flag; volume parses and checks it.
type ratioValue float64

func (r *ratioValue) String() string { return strconv.FormatFloat(float64(*r), 'g', -1, 64) }
func (r *ratioValue) Type() string   { return "float" }

func (r *ratioValue) Set(s string) error {
	f, err := volume.ParseOvercommitRatio(s)
	if err != nil {
		return err
	}
	*r = ratioValue(f)
	return nil
}

// refuseUnknownCommands makes every command that only groups subcommands
// (the root, units, ...) refuse an unknown subcommand as a usage error;
// cobra's own error for it is not one. Called alone, such a command prints
// its help as before.
func refuseUnknownCommands(c *cobra.Command) {
	for _, sub := range c.Commands() {
		refuseUnknownCommands(sub)
	}
	if !c.HasSubCommands() || c.Runnable() {
		return
	}
	c.Args = cobra.ArbitraryArgs
	c.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			return cmd.Help()
		}
		return usagef("unknown command %s for %q", volume.Quote(args[0]), cmd.CommandPath())
	}
}

// Main runs the node command line and returns the process exit code. The
// first SIGINT or SIGTERM cancels the command's context (stopSignals):
// the operation stops where it next looks at it and undoes what it began,
// as on any failure, and the command exits 1 with its error and the
// signal's name.
func Main(args []string, stdout, stderr io.Writer) int {
	root, _ := NewRootCommand(stdout, stderr)
	ctx, stop := stopSignals(stderr)
	defer stop()
	return execute(ctx, root, args, stderr)
}

// Execute runs a command tree built here (NewRootCommand,
// NewStoreCommand) with args, reports its error on stderr, and returns the
// process exit code (ExitCode).
func Execute(root *cobra.Command, args []string, stderr io.Writer) int {
	return execute(context.Background(), root, args, stderr)
}

// execute is Execute with ctx, which a stop signal may cancel
// (stopSignals): an error then is the signal's, exit 1, whatever it
// wraps.
func execute(ctx context.Context, root *cobra.Command, args []string, stderr io.Writer) int {
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	var stopped *stopError
	if err != nil && errors.As(context.Cause(ctx), &stopped) {
		err = fmt.Errorf("%w: %w", stopped, err)
	}
	if err != nil {
		var space *volume.SpaceError
		if stopped == nil && errors.As(err, &space) {
			fmt.Fprintf(stderr, "%s: %v; %s\n", root.Name(), err, space.Advice("--overcommit-ratio"))
		} else {
			fmt.Fprintf(stderr, "%s: %v\n", root.Name(), err)
		}
	}
	if stopped != nil {
		return ExitFailure
	}
	return ExitCode(err)
}

// stopError is the cause of a context that a stop signal cancelled.
type stopError struct{ sig os.Signal }

func (e *stopError) Error() string { return "stopped by " + signalName(e.sig) }

func signalName(sig os.Signal) string {
	if s, ok := sig.(syscall.Signal); ok {
		return unix.SignalName(s)
	}
	return sig.String()
}

// stopSignals returns a context that the first SIGINT or SIGTERM (an
// operator's Ctrl-C, a service manager's stop) cancels, with a stopError
// as its cause, and a stop func that the caller defers. At that first
// signal it says on stderr that the command is stopping and restores the
// signals' default, so that a second one ends the process at once,
// leaving what a crash leaves for a rerun or delete (docs/design.md,
// crash safety). A signal the process was started with ignored (a
// background job of a script) stays ignored.
func stopSignals(stderr io.Writer) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(context.Background())
	var sigs []os.Signal
	for _, sig := range []os.Signal{syscall.SIGINT, syscall.SIGTERM} {
		if !signal.Ignored(sig) {
			sigs = append(sigs, sig)
		}
	}
	if len(sigs) == 0 {
		return ctx, func() { cancel(nil) }
	}
	got := make(chan os.Signal, 1)
	done := make(chan struct{})
	signal.Notify(got, sigs...)
	go func() {
		select {
		case sig := <-got:
			signal.Reset(sigs...)
			fmt.Fprintf(stderr, "sparsevol: %s: stopping: what this command began is undone, or left as a crash leaves it for a rerun or delete (`sparsevol list` says which); send it again to stop at once\n", signalName(sig))
			cancel(&stopError{sig})
		case <-done:
		}
	}()
	return ctx, func() {
		signal.Stop(got)
		close(done)
		cancel(nil)
	}
}

// Usagef is an error in how a command was called (exit 2), for commands
// built outside this package.
func Usagef(format string, args ...any) error { return usagef(format, args...) }

// SetProcessDefaults sets what the whole process shares, for every
// sparsevol binary (both mains call it first):
//
//   - PATH gains the sbin directories where mkfs, blkid, sgdisk and
//     friends live, which minimal environments and some units lack (the
//     external programs are found through PATH);
//   - a heap goal of 50% unless GOGC says otherwise: the node commands
//     run as short-lived processes, by the hundred at boot on small
//     nodes, and the plugin lives on the same nodes, where a few extra
//     collections cost less than the memory.
func SetProcessDefaults() {
	path := os.Getenv("PATH")
	for _, dir := range []string{"/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"} {
		if !strings.Contains(":"+path+":", ":"+dir+":") {
			path += ":" + dir
		}
	}
	os.Setenv("PATH", strings.TrimPrefix(path, ":"))
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(50)
	}
}

// exactArgs is cobra.ExactArgs with the contract's exit code.
func exactArgs(n int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return usagef("%s takes %d argument(s), got %d", cmd.CommandPath(), n, len(args))
		}
		return nil
	}
}

func minArgs(n int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) < n {
			return usagef("%s needs at least %d argument(s)", cmd.CommandPath(), n)
		}
		return nil
	}
}
