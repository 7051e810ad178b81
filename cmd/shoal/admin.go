package main

import (
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// Keys, tenants and the audit log (AdminService; admin keys only, but
// whoami).

func keyCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "key",
		Short: "API keys of tenants, with scopes (admin)",
	}
	var tenant, scopes string
	create := &cobra.Command{
		Use:   "create --name NAME --tenant T --scope sandboxes,layers:read",
		Short: "Make a key and print it (shown this once: only its hash is kept)",
		Long: `Make an API key for a tenant. Scopes: sandboxes (the tenant's own sandboxes:
create, exec, files, ports, shells, delete ...; FnCall), layers:read (list,
inspect and use layers and environments), layers:write (commit, tag, rm,
import, export, gc, environments), admin (keys, tenants, the audit log,
server-path layer builds, every tenant's sandboxes). The key is printed
alone on stdout.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			name, _ := cmd.Flags().GetString("name")
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Admin.CreateKey(ctx, connect.NewRequest(&pb.CreateKeyRequest{Name: name, Tenant: tenant, Scopes: strings.Split(scopes, ",")}))
			if err != nil {
				return err
			}
			fmt.Println(res.Msg.Secret)
			return nil
		},
	}
	create.Flags().String("name", "", "key name (unique)")
	create.Flags().StringVar(&tenant, "tenant", "", "tenant the key belongs to (empty only with the admin scope)")
	create.Flags().StringVar(&scopes, "scope", "sandboxes,layers:read", "comma-separated scopes")
	create.MarkFlagRequired("name")

	var asJSON bool
	ls := &cobra.Command{
		Use:   "ls [--json]",
		Short: "List keys (never their secrets)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Admin.ListKeys(ctx, connect.NewRequest(&pb.ListKeysRequest{}))
			if err != nil {
				return err
			}
			if asJSON {
				printJSONList(res.Msg.Keys)
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tTENANT\tSCOPES\tCREATED")
			for _, k := range res.Msg.Keys {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", k.Name, orDash1(k.Tenant), strings.Join(k.Scopes, ","), k.CreatedAt.AsTime().Format(time.RFC3339))
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	rm := &cobra.Command{
		Use:   "rm NAME...",
		Short: "Remove keys: requests made with them fail from now on",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			for _, n := range args {
				if _, err := c.Admin.DeleteKey(ctx, connect.NewRequest(&pb.DeleteKeyRequest{Name: n})); err != nil {
					return err
				}
			}
			return nil
		},
	}
	cmd.AddCommand(create, ls, rm)
	return cmd
}

func orDash1(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func tenantCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "tenant",
		Short: "Tenants' quotas and usage (admin)",
	}
	set := &cobra.Command{
		Use:   "set TENANT [--max-sandboxes N] [--max-memory 8G] [--max-cpus 16] [--creates-per-second 50] [--burst N]",
		Short: "Set a tenant's quota: on this node, or the cluster's through a control replica (flags not given keep their value; 0: no bound)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			q := &pb.Quota{}
			cur, err := c.Admin.ListTenants(ctx, connect.NewRequest(&pb.ListTenantsRequest{}))
			if err != nil {
				return err
			}
			for _, t := range cur.Msg.Tenants {
				if t.Name == args[0] && t.Quota != nil {
					q = t.Quota
				}
			}
			f := cmd.Flags()
			if f.Changed("max-sandboxes") {
				q.MaxSandboxes, _ = f.GetInt64("max-sandboxes")
			}
			if f.Changed("max-memory") {
				v, _ := f.GetString("max-memory")
				if q.MaxMemoryBytes, err = parseBytes(v); err != nil {
					return fmt.Errorf("--max-memory: %w", err)
				}
			}
			if f.Changed("max-cpus") {
				v, _ := f.GetFloat64("max-cpus")
				if v < 0 || v > 1e9 || math.IsNaN(v) {
					return fmt.Errorf("--max-cpus %g: want 0 (no bound) or a number of cpus", v)
				}
				q.MaxMillicpu = int64(math.Round(v * 1000))
			}
			if f.Changed("creates-per-second") {
				q.CreatesPerSecond, _ = f.GetFloat64("creates-per-second")
			}
			if f.Changed("burst") {
				q.Burst, _ = f.GetInt64("burst")
			}
			res, err := c.Admin.SetTenant(ctx, connect.NewRequest(&pb.SetTenantRequest{Name: args[0], Quota: q}))
			if err != nil {
				return err
			}
			printJSON(res.Msg)
			return nil
		},
	}
	set.Flags().Int64("max-sandboxes", 0, "sandboxes at once")
	set.Flags().String("max-memory", "0", "total memory of its sandboxes (e.g. 8G)")
	set.Flags().Float64("max-cpus", 0, "total cpus of its sandboxes")
	set.Flags().Float64("creates-per-second", 0, "creates a second (token bucket)")
	set.Flags().Int64("burst", 0, "creates at once above the rate (0: max(1, the rate))")
	var asJSON bool
	ls := &cobra.Command{
		Use:   "ls [--json]",
		Short: "List tenants with their quotas and usage: on this node, or across the cluster through a control replica",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Admin.ListTenants(ctx, connect.NewRequest(&pb.ListTenantsRequest{}))
			if err != nil {
				return err
			}
			if asJSON {
				printJSONList(res.Msg.Tenants)
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "TENANT\tKEYS\tSANDBOXES\tMEMORY\tCPUS\tCREATES/S")
			bound := func(used, max string, has bool) string {
				if !has {
					return used
				}
				return used + "/" + max
			}
			for _, t := range res.Msg.Tenants {
				q := t.Quota
				if q == nil {
					q = &pb.Quota{}
				}
				rate := "-"
				if q.CreatesPerSecond > 0 {
					rate = strconv.FormatFloat(q.CreatesPerSecond, 'g', -1, 64)
				}
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\n", t.Name, t.Keys,
					bound(strconv.FormatInt(t.Sandboxes, 10), strconv.FormatInt(q.MaxSandboxes, 10), q.MaxSandboxes > 0),
					bound(humanBytes(t.MemoryBytes), humanBytes(q.MaxMemoryBytes), q.MaxMemoryBytes > 0),
					bound(strconv.FormatFloat(float64(t.Millicpu)/1000, 'g', -1, 64), strconv.FormatFloat(float64(q.MaxMillicpu)/1000, 'g', -1, 64), q.MaxMillicpu > 0),
					rate)
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.AddCommand(set, ls)
	return cmd
}

func auditCmd() *cobra.Command {
	var tail int32
	var tenant string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "audit [--tail N] [--tenant T] [--json]",
		Short: "Show the audit log: who created, exec'd, committed, deleted what (admin)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := c.Admin.ReadAudit(ctx, connect.NewRequest(&pb.ReadAuditRequest{Tail: tail, Tenant: tenant}))
			if err != nil {
				return err
			}
			if asJSON {
				printJSONList(res.Msg.Entries)
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "TIME\tKEY\tTENANT\tACTION\tOBJECT\tRESULT\tDETAIL")
			for _, e := range res.Msg.Entries {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", e.Time.AsTime().Format(time.RFC3339Nano), e.Key, orDash1(e.Tenant), e.Action, orDash1(e.Object), e.Result, e.Detail)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().Int32Var(&tail, "tail", 100, "the last N entries (at most 10000)")
	cmd.Flags().StringVar(&tenant, "tenant", "", "only this tenant's entries")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func whoamiCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "whoami",
		Short: "Show the API key in use: its name, tenant and scopes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			k, err := c.WhoAmI(ctx)
			if err != nil {
				return err
			}
			printJSON(k)
			return nil
		},
	}
}
