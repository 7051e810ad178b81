package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// client builds an API client from the global flags.
func client(cmd *cobra.Command) (*shoal.Client, error) {
	url, _ := cmd.Flags().GetString("url")
	key, _ := cmd.Flags().GetString("api-key")
	ca, _ := cmd.Flags().GetString("ca")
	cert, _ := cmd.Flags().GetString("cert")
	certKey, _ := cmd.Flags().GetString("cert-key")
	return shoal.New(shoal.Options{URL: url, APIKey: key, CAFile: ca, CertFile: cert, KeyFile: certKey})
}

// cmdContext is cancelled by Ctrl-C.
func cmdContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}

func absPath(p string) (string, error) {
	if strings.HasPrefix(p, "/") {
		return p, nil
	}
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	return wd + "/" + p, nil
}

func kindString(k pb.LayerKind) string {
	return strings.ToLower(strings.TrimPrefix(k.String(), "LAYER_KIND_"))
}

// timeColumn is a time of a listing, local, to the second; "-" when
// there is none (a lost sandbox of a cluster has no expiry).
func timeColumn(ts *timestamppb.Timestamp) string {
	if ts == nil || (ts.Seconds <= 0 && ts.Nanos == 0) {
		return "-"
	}
	return ts.AsTime().Local().Format(time.DateTime)
}

func stateString(s pb.SandboxState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "SANDBOX_STATE_"))
}

func shortDigest(d string) string {
	if len(d) > 19 {
		return d[:19]
	}
	return d
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// parseBytes reads sizes such as 512M, 1G, 1.5G, 65536 (binary units).
func parseBytes(s string) (int64, error) {
	t := strings.TrimSuffix(strings.TrimSuffix(strings.ToUpper(strings.TrimSpace(s)), "B"), "I")
	mult := int64(1)
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'K':
			mult, t = 1<<10, t[:n-1]
		case 'M':
			mult, t = 1<<20, t[:n-1]
		case 'G':
			mult, t = 1<<30, t[:n-1]
		case 'T':
			mult, t = 1<<40, t[:n-1]
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || v < 0 {
		return 0, fmt.Errorf("size %q must look like 512M or 2G", s)
	}
	if v*float64(mult) >= 1<<63 {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return int64(v * float64(mult)), nil
}

func createCmd() *cobra.Command {
	var (
		req               pb.CreateSandboxRequest
		memory, disk, qos string
		logBudget         string
		cpus              float64
		timeout           time.Duration
		metadata, envVars []string
		internet          bool
		allowOut, denyOut []string
		autoPause         time.Duration
	)
	cmd := &cobra.Command{
		Use:   "create (--base REF | --template ENV) [--workspace REF]... [--toolkit REF]... [--internet] [--allow-out CIDR[:PORT]]... [--deny-out CIDR]...",
		Short: "Create a sandbox (prints its ID)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			if req.MemoryBytes, err = parseBytes(memory); err != nil {
				return fmt.Errorf("--memory: %w", err)
			}
			req.Qos = qos
			if disk != "" {
				if req.DiskBytes, err = parseBytes(disk); err != nil {
					return fmt.Errorf("--disk: %w", err)
				}
			}
			if logBudget != "" {
				if req.LogBudgetBytes, err = parseBytes(logBudget); err != nil {
					return fmt.Errorf("--log-budget: %w", err)
				}
			}
			if cpus < 0 {
				return errors.New("--cpus must be positive")
			}
			req.Millicpu = int64(cpus * 1000)
			req.TimeoutSeconds = int64(timeout / time.Second)
			if timeout > 0 && req.TimeoutSeconds == 0 {
				return errors.New("--timeout must be at least 1s")
			}
			if cmd.Flags().Changed("auto-pause") {
				if autoPause < 0 || autoPause > 0 && autoPause < time.Second {
					return errors.New("--auto-pause must be 0 (never) or at least 1s")
				}
				n := int64(autoPause / time.Second)
				req.AutoPauseSeconds = &n
			}
			if req.Metadata, err = keyValues(metadata, "--metadata"); err != nil {
				return err
			}
			if req.Env, err = keyValues(envVars, "--env"); err != nil {
				return err
			}
			if internet || len(allowOut) > 0 || len(denyOut) > 0 {
				req.Network = &pb.NetworkPolicy{Internet: internet, AllowOut: allowOut, DenyOut: denyOut}
			}
			ctx, cancel := cmdContext()
			defer cancel()
			if err := pullIfImage(ctx, c, req.Base); err != nil {
				return err
			}
			sb, err := c.Create(ctx, &req)
			if err != nil {
				return err
			}
			fmt.Println(sb.Id)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.Backend, "backend", "container", "backend: container")
	f.StringVar(&req.Base, "base", "", "base layer ref (NAME:VERSION or NAME@sha256:...), or an OCI image ([REGISTRY/]REPOSITORY[:TAG|@DIGEST]: a base that is no layer here is pulled, see layer pull)")
	f.StringVar(&req.Template, "template", "", "environment (shoal env ls) to take base, workspaces and toolkits from, resolved now")
	f.StringArrayVar(&req.Workspaces, "workspace", nil, "workspace layer ref (repeatable)")
	f.StringArrayVar(&req.Toolkits, "toolkit", nil, "toolkit layer ref (repeatable)")
	f.StringVar(&memory, "memory", "512M", "memory limit")
	f.StringVar(&qos, "qos", "", "CPU class: ls (latency-sensitive, default) or be (best effort: the lowest CPU weight, processes under SCHED_IDLE)")
	f.StringVar(&disk, "disk", "", "size of the writable layer, e.g. 4G (ENOSPC in the sandbox when full; default: the server's, 1G)")
	f.StringVar(&logBudget, "log-budget", "", "bytes of its commands' output logs kept on the node, e.g. 64M: past it the oldest output is pruned (default: the server's, a quarter of the disk)")
	f.Float64Var(&cpus, "cpus", 1, "CPU limit in cores")
	f.DurationVar(&timeout, "timeout", 30*time.Minute, "idle timeout (refreshed by activity)")
	f.StringArrayVar(&metadata, "metadata", nil, "KEY=VALUE metadata (repeatable)")
	f.StringArrayVar(&envVars, "env", nil, "KEY=VALUE environment for every command (repeatable)")
	f.StringVar(&req.ClientKey, "client-key", "", "idempotency key: repeating a create with it returns the same sandbox")
	f.BoolVar(&internet, "internet", false, "network egress to the public IPv4 internet (not private ranges, other sandboxes or the host); default: no network")
	f.StringArrayVar(&allowOut, "allow-out", nil, "network egress to CIDR, IP, CIDR:PORT or CIDR:LOW-HIGH (repeatable; may name a private range)")
	f.StringArrayVar(&denyOut, "deny-out", nil, "CIDR taken out of --internet (repeatable)")
	f.DurationVar(&autoPause, "auto-pause", 0, "pause the sandbox after this long with no request and no running command (0 = never; default: the server's --auto-pause)")
	cmd.MarkFlagsOneRequired("base", "template")
	cmd.MarkFlagsMutuallyExclusive("base", "template")
	return cmd
}

func keyValues(kvs []string, flag string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	out := map[string]string{}
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("%s %q must be KEY=VALUE", flag, kv)
		}
		out[k] = v
	}
	return out, nil
}

// remotePath splits "ID:PATH" when the part before the colon is a sandbox ID.
func remotePath(s string) (id, path string, ok bool) {
	id, path, ok = strings.Cut(s, ":")
	if !ok || len(id) != 20 || strings.Trim(id, "abcdefghijklmnopqrstuvwxyz234567") != "" {
		return "", "", false
	}
	return id, path, true
}

func cpCmd() *cobra.Command {
	var mode, user string
	cmd := &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy a file into or out of a sandbox (one side is ID:PATH; - is stdin/stdout)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			sid, spath, sremote := remotePath(args[0])
			did, dpath, dremote := remotePath(args[1])
			switch {
			case sremote && dremote:
				return errors.New("copy between two sandboxes is not supported: one side must be local")
			case sremote:
				var w io.Writer = os.Stdout
				if args[1] != "-" {
					f, err := os.Create(args[1])
					if err != nil {
						return err
					}
					defer f.Close()
					w = f
				}
				_, err := c.ReadFileAs(ctx, sid, spath, user, w)
				return err
			case dremote:
				var r io.Reader = os.Stdin
				perm := os.FileMode(0o644)
				if args[0] != "-" {
					f, err := os.Open(args[0])
					if err != nil {
						return err
					}
					defer f.Close()
					if fi, err := f.Stat(); err == nil {
						if fi.IsDir() {
							return fmt.Errorf("%s is a directory: copy files one at a time", args[0])
						}
						perm = fi.Mode().Perm()
					}
					r = f
				}
				if mode != "" {
					v, err := strconv.ParseUint(mode, 8, 32)
					if err != nil {
						return fmt.Errorf("--mode %q must be octal", mode)
					}
					perm = os.FileMode(v)
				}
				_, err := c.WriteFileAs(ctx, did, dpath, user, perm, r)
				return err
			}
			return errors.New("one side must be ID:PATH")
		},
	}
	cmd.Flags().StringVar(&mode, "mode", "", "permission bits of the file written into a sandbox (default: the source's)")
	cmd.Flags().StringVarP(&user, "user", "u", "", "read or write as this sandbox user: its permissions, and it owns what is written (default root)")
	return cmd
}

func lsCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List sandboxes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			sbs, err := c.List(ctx)
			if err != nil {
				return err
			}
			if asJSON {
				printJSONList(sbs)
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
			dash := func(s string) string { // a lost sandbox of a cluster has no backend or layers
				if s == "" {
					return "-"
				}
				return s
			}
			fmt.Fprintln(tw, "ID\tBACKEND\tSTATE\tBASE\tCREATED\tEXPIRES")
			for _, s := range sbs {
				base := ""
				if n := len(s.Layers); n > 0 {
					base = s.Layers[n-1].Ref
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", s.Id, dash(s.Backend), stateString(s.State), dash(base),
					timeColumn(s.CreatedAt), timeColumn(s.ExpiresAt))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func inspectCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "inspect ID",
		Short: "Show a sandbox as JSON",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			sb, err := c.Get(ctx, args[0])
			if err != nil {
				return err
			}
			printJSON(sb)
			return nil
		},
	}
}

func pauseCmd() *cobra.Command {
	var fsOnly bool
	cmd := &cobra.Command{
		Use:   "pause ID",
		Short: "Pause a sandbox: stop its processes in place and reclaim its memory",
		Long: "Pause a sandbox: its processes stop where they are and its memory is reclaimed\n" +
			"(into swap where the server has some). The next request that needs it (exec,\n" +
			"cp, files, ports, ...) resumes it, or shoal resume does. Prints what was reclaimed.\n" +
			"With --fs-only its processes end first (its commands and shells are closed) and\n" +
			"only its files are kept: it resumes with its files and none of its processes.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			pause := c.Pause
			if fsOnly {
				pause = c.PauseFSOnly
			}
			sb, paused, err := pause(ctx, args[0])
			if err != nil {
				return err
			}
			if !paused {
				fmt.Fprintf(os.Stderr, "shoal: sandbox %s was paused already\n", sb.Id)
			}
			if p := sb.Pause; p != nil {
				fmt.Printf("%s paused: memory %s -> %s (%s), freeze %.1f ms, reclaim %.1f ms\n", sb.Id,
					humanBytes(p.MemoryBeforeBytes), humanBytes(p.MemoryAfterBytes), p.Method,
					p.FreezeSeconds*1000, p.ReclaimSeconds*1000)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&fsOnly, "fs-only", false, "end its processes and keep only its files (E2B's keepMemory: false)")
	return cmd
}

func resetCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "reset ID",
		Short: "Reset a sandbox to its start, in place",
		Long: "Reset a sandbox to its start, in place: every process but its agent ends, its\n" +
			"writable layer is replaced by an empty one (files, /tmp, /dev/shm, SysV IPC and\n" +
			"listening sockets go), its commands and shells are closed with the reason\n" +
			"\"reset\", and it keeps its ID, limits and network. A paused sandbox is resumed first.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			sb, took, err := c.Reset(ctx, args[0])
			if err != nil {
				return err
			}
			fmt.Printf("%s reset in %.1f ms\n", sb.Id, float64(took.Microseconds())/1000)
			return nil
		},
	}
}

func resumeCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "resume ID",
		Short: "Resume a paused sandbox",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			sb, resumed, err := c.Resume(ctx, args[0])
			if err != nil {
				return err
			}
			if !resumed {
				fmt.Fprintf(os.Stderr, "shoal: sandbox %s was not paused\n", sb.Id)
			}
			fmt.Println(sb.Id)
			return nil
		},
	}
}

func rmCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "rm ID...",
		Short: "Delete sandboxes",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			failed := 0
			for _, id := range args {
				if err := c.Delete(ctx, id); err != nil {
					fmt.Fprintf(os.Stderr, "shoal: rm %s: %s\n", id, errMessage(err))
					failed++
					continue
				}
				fmt.Println(id)
			}
			if failed > 0 {
				return exitCode(1)
			}
			return nil
		},
	}
}
