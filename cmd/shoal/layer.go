package main

import (
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
)

func layerCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "layer", Short: "Build and list layers"}
	var compression string
	var kind string
	build := &cobra.Command{
		Use:   "build --kind base|workspace|toolkit NAME:VERSION SRC",
		Short: "Build an EROFS layer from a directory or tarball (prints its ref)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			k, ok := map[string]pb.LayerKind{"base": pb.LayerKind_LAYER_KIND_BASE, "workspace": pb.LayerKind_LAYER_KIND_WORKSPACE, "toolkit": pb.LayerKind_LAYER_KIND_TOOLKIT}[kind]
			if !ok {
				return fmt.Errorf("--kind must be base, workspace or toolkit (got %q)", kind)
			}
			src, err := absPath(args[1])
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			l, err := c.BuildLayer(ctx, &pb.BuildLayerRequest{Kind: k, Ref: args[0], Source: src, Compression: compression},
				func(line string) { fmt.Fprintln(os.Stderr, line) })
			if err != nil {
				return err
			}
			fmt.Printf("%s@%s\n", l.Name, l.Digest)
			return nil
		},
	}
	build.Flags().StringVar(&kind, "kind", "", "layer kind: base, workspace or toolkit")
	build.Flags().StringVar(&compression, "compression", "", "none (default), lz4 or lz4hc")
	build.MarkFlagRequired("kind")
	var asJSON bool
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List layers",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Layers.ListLayers(ctx, connect.NewRequest(&pb.ListLayersRequest{}))
			if err != nil {
				return err
			}
			if asJSON {
				printJSONList(res.Msg.Layers)
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "REF\tKIND\tDIGEST\tSIZE\tCREATED")
			for _, l := range res.Msg.Layers {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", l.Ref, kindString(l.Kind), shortDigest(l.Digest), humanBytes(l.Size), l.CreatedAt.AsTime().Local().Format(time.DateTime))
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.AddCommand(build, ls)
	return cmd
}
