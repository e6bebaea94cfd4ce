package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/sparsevol/sparsevol/internal/systemd"
	"github.com/sparsevol/sparsevol/internal/volume"
)

func newCreateCommand(g *globals) *cobra.Command {
	var (
		size, fs, mode, uuid  string
		fromSnapshot, cloneOf string
		noPartition           bool
		mkfsOpts              []string
		preallocate, noStart  bool
		directIO              bool
		lf                    *limitFlags
	)
	cmd := &cobra.Command{
		Use: "create NAME --size SIZE",
		Example: `  sparsevol create data --size 10G
  sparsevol create pg --size 20G --fs xfs --mkfs-option "-m reflink=1"
  sparsevol create raw --size 5G --mode block
  sparsevol create scratch --size 10G --mode block --no-partition --preallocate
  sparsevol create noisy --size 10G --write-bps 10M --write-iops 500
  sparsevol create data-restored --from-snapshot data-monday
  sparsevol create data-copy --clone-of data --size 20G`,
		Short: "Create a volume, enable its unit and attach it",
		Long: `Create a sparse volume: the backing file, then ext4 or XFS whose UUID is the
volume UUID (filesystem mode), or a GPT whose single partition GUID is the
volume UUID (block mode; --no-partition for a whole-device raw volume).
Where systemd runs, sparsevol@<uuid>.service is enabled and started;
elsewhere the volume is attached directly. Prints the UUID.

With --from-snapshot or --clone-of the volume is a copy of a snapshot or of
another volume (a mounted source is frozen for the copy): mode and
filesystem are the source's, --size defaults to the source's and may only
be larger, and the copy gets a filesystem UUID (or partition GUID) of its
own. On an XFS (reflink) or btrfs store the copy shares the source's
extents and is instant; elsewhere it copies the data, never the holes.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			sourced := fromSnapshot != "" || cloneOf != ""
			if size == "" && !sourced {
				return usagef("--size is required")
			}
			var bytes int64
			var err error
			if size != "" {
				if bytes, err = volume.ParseSize(size); err != nil {
					return err
				}
			}
			if sourced && !cmd.Flags().Changed("mode") {
				mode = "" // the source's; a mode given must be it
			}
			// Defaults and the rules between mode, filesystem, partition
			// and mkfs options are volume's (Normalize).
			req := volume.CreateRequest{
				Name: args[0], UUID: uuid, SizeBytes: bytes, Mode: volume.Mode(mode),
				FSType: fs, NoPartition: noPartition, MkfsOptions: mkfsOpts,
				Preallocate: preallocate, KeepAttached: !noStart,
				FromSnapshot: fromSnapshot, CloneOf: cloneOf,
			}
			if sourced && isTerminal(os.Stderr) {
				req.Progress = progress(g, "copy")
			}
			if cmd.Flags().Changed("direct-io") {
				req.DirectIO = &directIO
			}
			limits, err := lf.change()
			if err != nil {
				return err
			}
			req.IOLimits = limits.Over(volume.IOLimits{})
			if err := req.Normalize(); err != nil {
				return err
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			v, err := s.Create(cmd.Context(), req)
			if err != nil {
				return err
			}
			fmt.Fprintln(g.stdout, v.UUID)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&size, "size", "", "logical size: bytes or a number with K, M, G, T (Ki, Mi, ... alike: powers of 1024); with a source, default the source's")
	f.StringVar(&fromSnapshot, "from-snapshot", "", "make the volume a copy of this snapshot (name or UUID)")
	f.StringVar(&cloneOf, "clone-of", "", "make the volume a copy of this volume (name or UUID)")
	f.StringVar(&fs, "fs", "", "filesystem: ext4 or xfs (filesystem mode; default ext4)")
	f.StringVar(&mode, "mode", string(volume.ModeFilesystem), "filesystem or block")
	f.BoolVar(&noPartition, "no-partition", false, "block mode: no partition table; the whole device is the volume")
	f.StringVar(&uuid, "uuid", "", "volume UUID (default: random)")
	f.StringArrayVar(&mkfsOpts, "mkfs-option", nil, "extra mkfs arguments, split on spaces (repeatable); an allow-list per filesystem: sizes, features, geometry, internal log, label; never paths, devices or the UUID")
	f.BoolVar(&preallocate, "preallocate", false, "allocate every block now (thick volume) instead of a sparse file")
	f.BoolVar(&noStart, "no-start", false, "enable the unit but do not attach now")
	f.BoolVar(&directIO, "direct-io", true, "direct I/O from the loop device to the backing file (falls back to buffered where refused)")
	lf = addLimitFlags(f)
	return cmd
}

func newAttachCommand(g *globals) *cobra.Command {
	var all, boot bool
	cmd := &cobra.Command{
		Use: "attach VOLUME...|--all",
		Example: `  sparsevol attach data
  sparsevol attach --all`,
		Short: "Attach volumes to loop devices (idempotent)",
		Long: `Attach each volume's backing file to a loop device, unless one is attached
already. Where udev runs, returns once the stable /dev/disk link exists.
VOLUME is a name or a UUID. This is the unit's ExecStart.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if boot {
				if all || len(args) > 0 {
					return usagef("--boot takes no volumes and no --all")
				}
				return g.attachBoot(cmd.Context())
			}
			if err := allOrArgs(all, args); err != nil {
				return err
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			switch {
			case all:
				return g.printAttached(s.AttachAll(cmd.Context()))
			case len(args) > 1:
				if err := resolveAll(s, args); err != nil {
					return err
				}
				// One pass for the lot: one scan, parallel binds, one udev wait.
				return g.printAttached(s.AttachMany(cmd.Context(), args))
			}
			v, device, err := s.AttachDevice(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			_, err = fmt.Fprintf(g.stdout, "%s\t%s\n", v.Name, device)
			return err
		},
	}
	cmd.Flags().BoolVar(&all, "all", false, "attach every volume of the store")
	cmd.Flags().BoolVar(&boot, "boot", false, "attach the volume of every enabled unit, whatever its store, and end boot mode ("+systemd.BootUnit+")")
	return cmd
}

func (g *globals) printAttached(sts []*volume.Status, err error) error {
	w := bufio.NewWriter(g.stdout) // a thousand lines at boot: one write
	for _, st := range sts {
		fmt.Fprintf(w, "%s\t%s\n", st.Name, st.Device)
	}
	return errors.Join(err, w.Flush())
}

// attachBoot is BootUnit's ExecStart: the volumes of the enabled units,
// whatever their store. It marks the boot done even when some volumes
// failed: their units fail their assertion, and later starts must run the
// units' own ExecStart.
func (g *globals) attachBoot(ctx context.Context) error {
	units := g.units()
	err := g.printAttached(volume.AttachEnabled(ctx, units, g.storeOptions()))
	return errors.Join(err, units.MarkBootDone())
}

func newDetachCommand(g *globals) *cobra.Command {
	var all, force bool
	cmd := &cobra.Command{
		Use:   "detach VOLUME...|--all",
		Short: "Detach volumes from their loop devices (idempotent)",
		Long: `Detach each volume's loop device — for a partitioned volume the parent
device of its partition. Refuses a mounted volume and says who holds it,
and an orphaned one (backing file gone, data only on its device) unless
--force. Devices someone else bound to a volume's file are left alone.
This is the unit's ExecStop.`,
		Example: `  sparsevol detach data
  sparsevol detach --all`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := allOrArgs(all, args); err != nil {
				return err
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			opts := volume.DetachOptions{Force: force}
			if all {
				return s.DetachAll(opts)
			}
			return eachVolume(cmd.Context(), s, args, func(ref string) error { return s.Detach(ref, opts) })
		},
	}
	cmd.Flags().BoolVar(&all, "all", false, "detach every volume of the store")
	cmd.Flags().BoolVar(&force, "force", false, "also detach orphaned volumes, losing the data only their device still holds (see recover)")
	return cmd
}

func newDeleteCommand(g *globals) *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "delete VOLUME...",
		Short: "Stop and disable the unit, detach, and remove the volume and its data",
		Long: `Stop and disable the volume's unit, detach it and remove its backing file and
metadata. Refuses, changing nothing, a volume that is mounted or open, whose
file someone else bound to a loop device or linked elsewhere, and an orphaned
one (backing file gone, data only on its device) unless --force.`,
		Example: `  sparsevol delete data
  sparsevol delete --force 5e90d14a-9185-417b-a333-51ec907297f0`,
		Args: minArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := g.store()
			if err != nil {
				return err
			}
			opts := volume.DetachOptions{Force: force}
			return eachVolume(cmd.Context(), s, args, func(ref string) error { return s.Delete(cmd.Context(), ref, opts) })
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "also delete orphaned volumes, losing the data only their device still holds (see recover)")
	return cmd
}

func newExpandCommand(g *globals) *cobra.Command {
	var size string
	var abandon bool
	cmd := &cobra.Command{
		Use: "expand VOLUME --size SIZE | --abandon",
		Example: `  sparsevol expand data --size 20G
  sparsevol expand data --abandon     # give up an expansion that did not finish`,
		Short: "Grow a volume: file, loop device, partition, filesystem",
		Long: `Grow a volume: its backing file, the loop device, the partition, the
filesystem. If a step after the first fails, the expansion stays pending
(state expanding): rerun with the same --size to finish it, or --abandon
to put the file back to the old size while nothing uses the new space.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if (size == "") == !abandon {
				return usagef("give --size or --abandon")
			}
			var bytes int64
			if !abandon {
				var err error
				if bytes, err = volume.ParseSize(size); err != nil {
					return err
				}
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			var v *volume.Volume
			if abandon {
				v, err = s.AbandonExpand(args[0])
			} else {
				v, err = s.Expand(cmd.Context(), args[0], bytes, volume.ExpandOptions{})
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(g.stdout, "%s\t%s\n", v.Name, volume.FormatSize(v.SizeBytes))
			return nil
		},
	}
	cmd.Flags().StringVar(&size, "size", "", "new logical size (must be larger)")
	cmd.Flags().BoolVar(&abandon, "abandon", false, "abandon a pending expansion: the backing file goes back to the volume's size")
	return cmd
}

func newAdoptCommand(g *globals) *cobra.Command {
	var dir string
	var noStart bool
	cmd := &cobra.Command{
		Use: "adopt PATH... | --dir DIR",
		Example: `  sparsevol adopt /var/lib/sparsevol-old/6f1c3a52-2f9e-4d7b-9a51-0c7f2d3e4b5a
  sparsevol --root /var/lib/metalk8s/storage/sparse adopt --dir /var/lib/metalk8s/storage/sparse`,
		Short: "Register existing sparse files and enable their units",
		Long: `Register sparse files made by an earlier install (for example
/var/lib/metalk8s/storage/sparse/<uuid>) without rewriting them: each is
renamed to <store>/<uuid> (the same inode), so it must lie on the store's
filesystem; to keep files where they are, make their directory the store
(--root). ext4 and XFS files keep their filesystem UUID; files with a GPT
of one partition keep its partition GUID. Symlinks, files with more than
one link, files a loop device is bound to and other stores' files are
refused. With --dir, every PATH must lie inside DIR, and without PATHs
every regular file of DIR is adopted.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if dir == "" && len(args) == 0 {
				return usagef("adopt needs PATHs or --dir")
			}
			s, err := g.store()
			if err != nil {
				return err
			}
			vols, err := s.Adopt(cmd.Context(), args, dir)
			if err != nil {
				return err
			}
			for _, v := range vols {
				fmt.Fprintf(g.stdout, "%s\t%s\t%s\n", v.UUID, v.Name, v.BackingFile)
			}
			if err := s.Activate(cmd.Context(), vols, !noStart); err != nil {
				return fmt.Errorf("adopted, but: %w", err)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory the files must lie in (all its files if no PATH is given)")
	cmd.Flags().BoolVar(&noStart, "no-start", false, "enable the units but do not attach now")
	return cmd
}

func allOrArgs(all bool, args []string) error {
	switch {
	case all && len(args) > 0:
		return usagef("give VOLUMEs or --all, not both")
	case !all && len(args) == 0:
		return usagef("give at least one VOLUME, or --all")
	}
	return nil
}

// eachVolume checks every reference first, then runs fn on each, going on
// past failures and reporting them all, until ctx is cancelled (a stop
// signal): the volumes not begun then are named and left alone.
func eachVolume(ctx context.Context, s *volume.Store, refs []string, fn func(ref string) error) error {
	if err := resolveAll(s, refs); err != nil {
		return err
	}
	var errs []error
	for i, ref := range refs {
		if err := notBegun(ctx, refs[i:]); err != nil {
			errs = append(errs, err)
			break
		}
		errs = append(errs, fn(ref))
	}
	return errors.Join(errs...)
}

// notBegun returns ctx's error, naming rest (the references a command
// was given and has not acted on yet), once ctx is cancelled; else nil.
func notBegun(ctx context.Context, rest []string) error {
	if ctx.Err() == nil {
		return nil
	}
	quoted := make([]string, len(rest))
	for i, r := range rest {
		quoted[i] = volume.Quote(r)
	}
	return fmt.Errorf("not begun, left as they are: %s: %w", strings.Join(quoted, ", "), ctx.Err())
}

// resolveAll is resolveRefs for volumes. A volume whose record a newer
// sparsevol wrote is refused here, before any of refs is acted on: every
// operation would refuse it, and knowing that up front is what keeps a
// command from having done half its work when it stops.
func resolveAll(s *volume.Store, refs []string) error {
	return resolveRefs("volume", refs, func(ref string) (string, error) {
		v, err := s.Get(ref)
		if err != nil {
			return "", err
		}
		if err := v.Refusal(); errors.Is(err, volume.ErrNewer) {
			return "", err
		}
		return v.UUID, nil
	})
}

// resolveRefs checks every reference to a kind of object (what: volume,
// snapshot) with get, which returns the UUID a reference names, before
// any is acted on, so a typo in the third name does not leave the first
// two changed, and refuses two references to one object (a name and its
// UUID, or one name twice), which would act on it twice: a delete, then a
// refusal of the second.
func resolveRefs(what string, refs []string, get func(ref string) (string, error)) error {
	var missing []string
	seen := make(map[string]string, len(refs))
	for _, ref := range refs {
		uuid, err := get(ref)
		switch {
		case errors.Is(err, volume.ErrNotFound):
			missing = append(missing, volume.Quote(ref))
			continue
		case err != nil:
			return err
		}
		if first, ok := seen[uuid]; ok {
			return usagef("%s and %s both name %s %s: name each %s once", volume.Quote(first), volume.Quote(ref), what, uuid, what)
		}
		seen[uuid] = ref
	}
	if len(missing) > 0 {
		return fmt.Errorf("no such %s: %s: %w", what, strings.Join(missing, ", "), volume.ErrNotFound)
	}
	return nil
}
