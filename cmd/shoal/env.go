package main

import (
	"fmt"
	"os"
	"strings"
	"text/tabwriter"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

func envCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "env",
		Short: "Named environments (templates): saved stacks of layers for 'shoal create --template'",
	}
	cmd.AddCommand(envCreateCmd(), envLsCmd(), envInspectCmd(), envRmCmd())
	return cmd
}

func envCreateCmd() *cobra.Command {
	var req pb.CreateEnvironmentRequest
	cmd := &cobra.Command{
		Use:   "create NAME --base REF [--workspace REF]... [--toolkit REF]... [--backend B] [--replace [--if-revision N]]",
		Short: "Save a stack of layers under a name",
		Long: `Save a stack of layers under a name. The references are kept as given and
resolved each time a sandbox is created from the environment: moving a tag
(rebuilding toolkit pytest:8, say) upgrades every later sandbox, while
running ones keep the layers they were created on. --backend makes the
sandboxes created from it (and E2B sandboxes of this template) run on that
backend unless their create names one (microvm, say). On a cluster,
--replace --if-revision N replaces it only if it is still at revision N
('shoal env inspect' shows it): a change by someone else in between is
refused.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			req.Name = args[0]
			ctx, cancel := cmdContext()
			defer cancel()
			if err := pullIfImage(ctx, c, req.Base); err != nil {
				return err
			}
			res, err := c.Layers.CreateEnvironment(ctx, connect.NewRequest(&req))
			if err != nil {
				return err
			}
			fmt.Println(res.Msg.Name)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.Base, "base", "", "base layer ref, or an OCI image (a base that is no layer here is pulled: its layers below the workspaces, its config the sandboxes' defaults)")
	f.StringArrayVar(&req.Workspaces, "workspace", nil, "workspace layer ref (repeatable)")
	f.StringArrayVar(&req.Toolkits, "toolkit", nil, "toolkit layer ref (repeatable)")
	f.BoolVar(&req.Replace, "replace", false, "replace an environment of that name")
	f.StringVar(&req.Backend, "backend", "", "backend of its sandboxes unless a create names one (default: the node's)")
	f.Int64Var(&req.IfRevision, "if-revision", 0, "with --replace, on a cluster: replace only if the environment is still at this revision")
	cmd.MarkFlagRequired("base")
	return cmd
}

func envLsCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls [--json]",
		Short: "List environments",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Layers.ListEnvironments(ctx, connect.NewRequest(&pb.ListEnvironmentsRequest{}))
			if err != nil {
				return err
			}
			if asJSON {
				printJSONList(res.Msg.Environments)
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tOWNER\tBASE\tWORKSPACES\tTOOLKITS\tBACKEND")
			for _, e := range res.Msg.Environments {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", e.Name, ownerString(e.Tenant), e.Base, orDash(e.Workspaces), orDash(e.Toolkits), orDash1(e.Backend))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func orDash(ss []string) string {
	if len(ss) == 0 {
		return "-"
	}
	return strings.Join(ss, ",")
}

func envInspectCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "inspect NAME",
		Short: "Show an environment as JSON, with the layers its references resolve to now",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Layers.GetEnvironment(ctx, connect.NewRequest(&pb.GetEnvironmentRequest{Name: args[0]}))
			if err != nil {
				return err
			}
			printJSON(res.Msg)
			return nil
		},
	}
}

func envRmCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "rm NAME...",
		Short: "Remove environments (sandboxes created from them keep running)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			failed := 0
			for _, name := range args {
				if _, err := c.Layers.DeleteEnvironment(ctx, connect.NewRequest(&pb.DeleteEnvironmentRequest{Name: name})); err != nil {
					fmt.Fprintf(os.Stderr, "shoal: env rm %s: %s\n", name, errMessage(err))
					failed++
					continue
				}
				fmt.Println(name)
			}
			if failed > 0 {
				return exitCode(1)
			}
			return nil
		},
	}
}
