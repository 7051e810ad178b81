//go:build !client

package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/shoal-sandbox/shoal/internal/bench"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func benchDensityCmd() *cobra.Command {
	var o bench.DensityOptions
	var memory, disk string
	cmd := &cobra.Command{
		Use:   "density [-n N] [--base REF] [--restart CMD]",
		Short: "Host memory per sandbox running and paused, create/pause times, resume→first exec, recovery after a restart, over N sandboxes each with a resident shell (run it on the server's machine; SIGUSR1 stops the creates and measures what is there)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if memory != "" {
				if o.Memory, err = parseBytes(memory); err != nil {
					return fmt.Errorf("--memory: %w", err)
				}
			}
			if disk != "" {
				if o.Disk, err = parseBytes(disk); err != nil {
					return fmt.Errorf("--disk: %w", err)
				}
			}
			return runBench(func(ctx context.Context, c *shoal.Client) (any, error) {
				o.URL = c.URL()
				logf := func(format string, args ...any) {
					fmt.Fprintf(os.Stderr, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
				}
				o.Log = logf
				stop := make(chan struct{})
				usr1 := make(chan os.Signal, 1)
				signal.Notify(usr1, syscall.SIGUSR1)
				defer signal.Stop(usr1)
				go func() {
					<-usr1
					logf("SIGUSR1: no more creates; measuring the sandboxes there are")
					close(stop)
				}()
				o.StopCreating = stop
				return bench.Density(ctx, c, o)
			})(cmd, args)
		},
	}
	f := cmd.Flags()
	f.IntVarP(&o.N, "number", "n", 3200, "sandboxes")
	f.IntVarP(&o.Concurrency, "concurrency", "c", 4, "creates and deletes in flight")
	f.IntVar(&o.Pausers, "pausers", 2, "pauses in flight")
	f.IntVar(&o.Sample, "sample", 200, "paused sandboxes resumed by a first exec (chosen at random)")
	f.IntVar(&o.MiB, "mib", 0, "MiB of random data each resident shell holds besides itself (0: a bare shell)")
	f.StringVar(&memory, "memory", "", "memory limit of each sandbox (default: the node's)")
	f.StringVar(&disk, "disk", "", "disk of each sandbox (default: the node's)")
	f.StringVar(&o.Base, "base", "debian:12", "base layer (needs sh and mkfifo)")
	f.StringVar(&o.CgroupParent, "cgroup-parent", "shoal", "the server's --cgroup-parent (its sandboxes' memory cgroups are read there)")
	f.StringVar(&o.Restart, "restart", "", "shell command that restarts the server (stops it, starts it again detached); the recovery is timed")
	f.BoolVar(&o.Keep, "keep", false, "leave the sandboxes running at the end")
	return cmd
}
