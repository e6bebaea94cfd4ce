package cli

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/sparsevol/sparsevol/internal/iolimit"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// limitFlags are the four I/O limit flags create and limit share.
type limitFlags struct {
	readBPS, writeBPS, readIOPS, writeIOPS string
	flags                                  *pflag.FlagSet
}

func addLimitFlags(f *pflag.FlagSet) *limitFlags {
	l := &limitFlags{flags: f}
	f.StringVar(&l.readBPS, "read-bps", "", "limit reads to this many bytes per second (a size: 10M, 1.5Gi; max for none)")
	f.StringVar(&l.writeBPS, "write-bps", "", "limit writes to this many bytes per second (a size; max for none)")
	f.StringVar(&l.readIOPS, "read-iops", "", "limit reads to this many operations per second (max for none)")
	f.StringVar(&l.writeIOPS, "write-iops", "", "limit writes to this many operations per second (max for none)")
	return l
}

// change parses the flags that were given into a change of the limits
// they name; the rules are volume's (ParseBPS, ParseIOPS) and iolimit's.
func (l *limitFlags) change() (volume.LimitChange, error) {
	var ch volume.LimitChange
	for _, f := range []struct {
		name  string
		val   string
		bytes bool
		dst   **uint64
	}{
		{"read-bps", l.readBPS, true, &ch.ReadBPS},
		{"write-bps", l.writeBPS, true, &ch.WriteBPS},
		{"read-iops", l.readIOPS, false, &ch.ReadIOPS},
		{"write-iops", l.writeIOPS, false, &ch.WriteIOPS},
	} {
		if !l.flags.Changed(f.name) {
			continue
		}
		parse := volume.ParseIOPS
		if f.bytes {
			parse = volume.ParseBPS
		}
		n, err := parse(f.val)
		if err != nil {
			return volume.LimitChange{}, fmt.Errorf("--%s: %w", f.name, err)
		}
		*f.dst = &n
	}
	return ch, nil
}

func newLimitCommand(g *globals) *cobra.Command {
	var clear bool
	var lf *limitFlags
	cmd := &cobra.Command{
		Use: "limit VOLUME [--read-bps SIZE] [--write-bps SIZE] [--read-iops N] [--write-iops N] | --clear",
		Example: `  sparsevol limit data --write-bps 10M --write-iops 500
  sparsevol limit data --write-bps max      # lift the write limit only
  sparsevol limit data --clear              # lift every limit
  sparsevol limit data                      # show the limits`,
		Short: "Change a volume's I/O limits, live",
		Long: `Set the I/O limits of a volume. Flags not given keep their value; max
lifts one limit, --clear all of them. The limits are an io.max entry for the
volume's loop device on the cgroup that holds all pods (kubepods; see
--pods-cgroup), changed at once on an attached volume and re-applied at every
attach. Needs cgroup v2 with the io controller: elsewhere setting a limit
fails (exit 1) and changes nothing.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := g.store()
			if err != nil {
				return err
			}
			v, err := s.Get(args[0])
			if err != nil {
				return err
			}
			if err := v.Refusal(); err != nil {
				return err // a stand-in's limits are not its record's
			}
			// The flags are a change, applied over the limits the volume
			// has under its lock (Store.Change): a concurrent change of
			// another limit stays.
			ch, err := lf.change()
			if err != nil {
				return err
			}
			if clear {
				if !ch.IsZero() {
					return usagef("--clear takes no other limit")
				}
				ch = volume.LimitsTo(volume.IOLimits{})
			}
			if !ch.IsZero() {
				st, err := s.Change(args[0], volume.Change{IOLimits: ch})
				if err != nil {
					return err
				}
				v = &st.Volume
			}
			fmt.Fprintf(g.stdout, "%s\t%s\n", v.Name, volume.FormatLimits(v.IOLimits))
			return nil
		},
	}
	cmd.Flags().BoolVar(&clear, "clear", false, "lift every limit")
	lf = addLimitFlags(cmd.Flags())
	return cmd
}

// addCgroupFlags adds the flags that say where I/O limits go; each
// defaults to its environment variable.
func addCgroupFlags(g *globals, pf *pflag.FlagSet) {
	pf.StringVar(&g.ioLimits.Mount, "cgroup-mount", envOr(iolimit.MountEnv, iolimit.DefaultMount),
		"the cgroup v2 mount I/O limits are written under (env "+iolimit.MountEnv+")")
	pf.StringVar(&g.ioLimits.Cgroup, "pods-cgroup", os.Getenv(iolimit.CgroupEnv),
		"the cgroup holding all pods, relative to --cgroup-mount (default: kubepods.slice or kubepods, whichever exists; env "+iolimit.CgroupEnv+")")
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// ioLimitFindings are doctor's checks of I/O limits: the host can enforce
// the limits volumes have, and each attached one's device carries them.
func (g *globals) ioLimitFindings(sts []*volume.Status) []finding {
	var limited []*volume.Status
	for _, st := range sts {
		if !st.IOLimits.IsZero() {
			limited = append(limited, st)
		}
	}
	supported := g.ioLimits.Supported()
	switch {
	case supported != nil && len(limited) > 0:
		return []finding{{"FAIL", "I/O limits", fmt.Sprintf("%d volume(s) have limits (%s first), which this host cannot enforce: %v", len(limited), limited[0].Name, supported),
			"boot with cgroup v2 (systemd.unified_cgroup_hierarchy=1), or lift them: sparsevol limit VOLUME --clear"}}
	case supported != nil:
		return []finding{{"OK", "I/O limits", "none set; this host could not enforce them: " + supported.Error(), ""}}
	}
	var out []finding
	for _, st := range limited {
		if !st.Attached {
			continue
		}
		n, err := iolimit.DeviceNumber(st.Device)
		var got volume.IOLimits
		if err == nil {
			got, err = g.ioLimits.Get(n)
		}
		if err != nil || got != st.IOLimits {
			out = append(out, finding{"WARN", "I/O limits of " + st.Name,
				fmt.Sprintf("%s carries %s, the volume has %s (%v)", st.Device, volume.FormatLimits(got), volume.FormatLimits(st.IOLimits), err),
				"sparsevol limit " + st.Name + " with the same values re-applies them"})
		}
	}
	return append(out, finding{"OK", "I/O limits", fmt.Sprintf("%d volume(s) limited, in %s", len(limited), g.ioLimits.Where()), ""})
}
