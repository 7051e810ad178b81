//go:build !client

package main

import (
	"encoding/json"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/shoal-sandbox/shoal/internal/bench"
)

// benchClusterCmd is `shoal bench cluster`: the placement engine in front
// of simulated nodes (no server needed).
func benchClusterCmd() *cobra.Command {
	o := bench.ClusterOptions{}
	cmd := &cobra.Command{
		Use:   "cluster [--nodes 160] [--rate 5000] [--duration 10s] [--burst 32000]",
		Short: "Placement at fleet scale: the real placement engine in front of SIMULATED nodes (in-process fakes of node admission and capacity reports)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := bench.Cluster(cmd.Context(), o)
			if err != nil {
				return err
			}
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(res)
		},
	}
	f := cmd.Flags()
	f.IntVar(&o.Nodes, "nodes", 160, "simulated nodes")
	f.IntVar(&o.CPUs, "cpus", 192, "CPUs per node")
	f.IntVar(&o.MemoryGiB, "memory-gib", 1536, "memory per node, GiB")
	f.Float64Var(&o.CPUOvercommit, "cpu-overcommit", 16, "admitted CPU limits per node: this × its CPUs (sandboxes idle most of the time)")
	f.Float64Var(&o.MemoryOvercommit, "memory-overcommit", 2, "admitted memory limits per node: this × its memory")
	f.IntVar(&o.Prefill, "prefill", 380_000, "sandboxes placed first (as fast as placement goes: decisions/s)")
	f.IntVar(&o.Rate, "rate", 5000, "steady creates per second (each with a delete: constant population)")
	f.DurationVar(&o.Duration, "duration", 10*time.Second, "length of the steady phase")
	f.IntVar(&o.Burst, "burst", 32_000, "creates one tenant submits at once (while another creates at 100/s)")
	f.IntVar(&o.Concurrency, "concurrency", 64, "placements in flight")
	f.DurationVar(&o.Report, "report", time.Second, "node report (heartbeat) interval")
	f.IntVar(&o.Layers, "layers", 20, "distinct base layers (each node holds up to 3)")
	f.Uint64Var(&o.Seed, "seed", 1, "random seed")
	return cmd
}
