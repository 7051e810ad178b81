//go:build !client

package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/shoal-sandbox/shoal/internal/bench"
)

func benchLayersCmd() *cobra.Command {
	var o bench.LayersOptions
	cmd := &cobra.Command{
		Use:   "layers [-n 100] [--bases M] [--toolkits K] [--base-tree DIR]",
		Short: "Serving a toolkit upgrade to N combinations: one layer vs N monolithic images; EROFS builds vs tar czf",
		Long: `Builds M bases, K toolkits and N workspaces (N combinations that all use
toolkit 0), upgrades toolkit 0 and measures the time and bytes to serve the
upgrade: one toolkit image with layers, N images (base + workspace +
toolkits flattened) without. Monolithic images are built for a sample and
extrapolated to N (--sample N builds them all). Also times EROFS builds of
the base and a toolkit against 'tar czf' of the same trees. Trees are made
under --work on this machine and built by the server from there. With
--base-tree (a real root file system) it also times the first sandbox on
the new version. Everything it builds is removed afterwards (--keep keeps).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			if o.BaseTree != "" {
				if o.BaseTree, err = absPath(o.BaseTree); err != nil {
					return err
				}
			}
			o.Progress = func(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := bench.Layers(ctx, c, o)
			if err != nil {
				return err
			}
			return printResult(res)
		},
	}
	f := cmd.Flags()
	f.IntVarP(&o.N, "number", "n", 100, "combinations (workspaces) using the upgraded toolkit")
	f.IntVar(&o.Bases, "bases", 2, "bases (m)")
	f.IntVar(&o.Toolkits, "toolkits", 4, "toolkits (k)")
	f.StringVar(&o.BaseTree, "base-tree", "", "root file system for the bases (default: synthetic, --base-mib)")
	f.IntVar(&o.BaseMiB, "base-mib", 128, "size of the synthetic base")
	f.IntVar(&o.ToolkitMiB, "toolkit-mib", 32, "size of each synthetic toolkit")
	f.IntVar(&o.WorkspaceMiB, "workspace-mib", 4, "size of each synthetic workspace")
	f.IntVar(&o.MonolithicSample, "sample", 10, "monolithic images really built (the rest extrapolated); N or 0 for all")
	f.StringVar(&o.Compression, "compression", "none", "image compression: none, plain, lz4, lz4hc")
	f.StringVar(&o.WorkDir, "work", "", "directory for the trees (default: a temporary one under /var/tmp)")
	f.BoolVar(&o.Keep, "keep", false, "keep the layers built")
	return cmd
}
