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

func benchImagesCmd() *cobra.Command {
	var o bench.ImagesOptions
	cmd := &cobra.Command{
		Use:   "images [-n 50] [--sample 5] [--base-mib 64] [--env-mib 32] [--top-mib 4]",
		Short: "Images from a registry: layers kept and shared vs flattened imports (bytes fetched and stored, time to first exec)",
		Long: `Pushes N images that share a base and an environment layer and differ in
a top layer (as SWE-bench's do) to a registry of its own (go-containerregistry's,
on --listen, which the server must reach), then pulls each through the
server (layer pull), creates a sandbox from it and runs 'true'. A sample
is also fetched whole and imported flattened (one layer each), as before
layer pull, and extrapolated to N. Prints bytes fetched from the registry
and stored on the node both ways, the time from "never seen" to the first
exec (first image, the others, flattened), a second pull of pulled images,
and the conversion of the environment layer against 'tar -xzf' of its blob
into a tmpfs. The layers it made are untagged afterwards (--keep keeps
them; 'shoal layer gc' frees them).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			o.Progress = func(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := bench.Images(ctx, c, o)
			if err != nil {
				return err
			}
			return printResult(res)
		},
	}
	f := cmd.Flags()
	f.IntVarP(&o.N, "number", "n", 50, "images")
	f.IntVar(&o.Sample, "sample", 5, "images also imported flattened (the rest extrapolated)")
	f.IntVar(&o.BaseMiB, "base-mib", 64, "data in the shared base layer (besides busybox)")
	f.IntVar(&o.EnvMiB, "env-mib", 32, "the shared environment layer")
	f.IntVar(&o.TopMiB, "top-mib", 4, "each image's own top layer")
	f.StringVar(&o.Listen, "listen", "127.0.0.1:0", "where the bench's registry listens")
	f.BoolVar(&o.Keep, "keep", false, "keep the layers")
	return cmd
}
