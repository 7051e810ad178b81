//go:build !client

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/spf13/cobra"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/bench"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

func benchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Benchmarks against a running shoal serve on this machine (JSON on stdout)",
	}
	var co bench.CreateOptions
	create := &cobra.Command{
		Use:   "create [-n N] [-c C] [--base REF]",
		Short: "Create→first exec latency and creates/s, against plain `runc run`; how many creates the warm pool served (a serve fills it from its start)",
		Args:  cobra.NoArgs,
		RunE:  runBench(func(ctx context.Context, c *shoal.Client) (any, error) { return bench.Create(ctx, c, co) }),
	}
	create.Flags().IntVarP(&co.N, "number", "n", 100, "sandboxes to create")
	create.Flags().IntVarP(&co.Concurrency, "concurrency", "c", 4, "creates in flight")
	create.Flags().StringVar(&co.Base, "base", "debian:12", "base layer")
	create.Flags().StringVar(&co.DataDir, "data", "/var/lib/shoal", "the server's data dir (for the runc baseline)")
	create.Flags().StringVar(&co.Runtime, "runtime", "runc", "OCI runtime for the baseline")
	create.Flags().StringArrayVar(&co.AllowOut, "allow-out", nil, "create every sandbox with network egress to this CIDR[:PORT] (repeatable; measures the cost of egress)")

	var eo bench.ExecOptions
	execb := &cobra.Command{
		Use:   "exec [-n N] [--base REF]",
		Short: "Exec round trip through the API and the agent, against `runc exec`",
		Args:  cobra.NoArgs,
		RunE:  runBench(func(ctx context.Context, c *shoal.Client) (any, error) { return bench.Exec(ctx, c, eo) }),
	}
	execb.Flags().IntVarP(&eo.N, "number", "n", 200, "commands to run")
	execb.Flags().StringVar(&eo.Base, "base", "debian:12", "base layer")
	execb.Flags().StringVar(&eo.DataDir, "data", "/var/lib/shoal", "the server's data dir")
	execb.Flags().StringVar(&eo.Runtime, "runtime", "runc", "OCI runtime for the baseline")
	var vo bench.VMOptions
	vmb := &cobra.Command{
		Use:   "vm [--backend microvm|fullvm] [--boots N] [--execs N] [--base REF] [--read-file PATH]",
		Short: "VM sandboxes: create to first exec, exec round trips, host memory of an idle VM",
		Args:  cobra.NoArgs,
		RunE:  runBench(func(ctx context.Context, c *shoal.Client) (any, error) { return bench.VM(ctx, c, vo) }),
	}
	vmb.Flags().StringVar(&vo.Backend, "backend", "microvm", "VM backend")
	vmb.Flags().IntVar(&vo.Boots, "boots", 5, "sandboxes created one after another")
	vmb.Flags().IntVar(&vo.Execs, "execs", 50, "`true` round trips in the first sandbox")
	vmb.Flags().StringVar(&vo.Base, "base", "debian:12", "base layer")
	vmb.Flags().Int64Var(&vo.MemoryMiB, "memory-mib", 256, "guest memory in MiB")
	vmb.Flags().IntVar(&vo.Pauses, "pauses", 3, "rounds of pausing every booted VM (as the server pauses them: serve --vm-pause) and resuming each by an exec (restore → first exec); 0: none")
	vmb.Flags().StringVar(&vo.ReadFile, "read-file", "", "a file (or directory: all its files) of the base that every VM reads after its boot; then the host memory of the VMs and of the layers' page cache (blk vs pmem layers: serve --vm-layers)")
	var qo bench.QoSOptions
	qosb := &cobra.Command{
		Use:   "qos [-n N] [--burners B] [--duration D] [--base REF]",
		Short: "Exec latency of a latency-sensitive sandbox while best-effort (then latency-sensitive) sandboxes burn every CPU, beside the host's own fork+exec as the floor",
		Args:  cobra.NoArgs,
		RunE:  runBench(func(ctx context.Context, c *shoal.Client) (any, error) { return bench.QoS(ctx, c, qo) }),
	}
	qosb.Flags().IntVarP(&qo.N, "number", "n", 100, "execs of true per phase")
	qosb.Flags().IntVar(&qo.Burners, "burners", 0, "sandboxes burning CPU (default: 2 per CPU)")
	qosb.Flags().DurationVar(&qo.Duration, "duration", 10*time.Second, "how long the burners burn per phase")
	qosb.Flags().StringVar(&qo.Base, "base", "debian:12", "base layer")
	var so bench.SessionOptions
	sess := &cobra.Command{
		Use:   "session [--base REF]",
		Short: "Output streaming throughput, re-attach latency, trajectory fast-forward",
		Args:  cobra.NoArgs,
		RunE:  runBench(func(ctx context.Context, c *shoal.Client) (any, error) { return bench.Session(ctx, c, so) }),
	}
	sess.Flags().StringVar(&so.Base, "base", "debian:12", "base layer")
	sess.Flags().Int64Var(&so.StreamBytes, "bytes", 48<<20, "output bytes of the streaming run (keep it under the server's --command-log-cap)")
	sess.Flags().IntVar(&so.Reattaches, "reattaches", 50, "re-attaches to time")
	sess.Flags().IntVar(&so.Steps, "steps", 100, "trajectory steps")
	var fo bench.FnCallOptions
	fnb := &cobra.Command{
		Use:   "fncall [-n N] [--batch N] [--isolation cgroup|sandbox|both]",
		Short: "FnCall latency (python print(1), C++ hello) against bare runs on the host, and batch calls/s",
		Args:  cobra.NoArgs,
		RunE:  runBench(func(ctx context.Context, c *shoal.Client) (any, error) { return bench.FnCall(ctx, c, fo) }),
	}
	fnb.Flags().IntVarP(&fo.N, "number", "n", 200, "latency samples (python; C++ gets a quarter)")
	fnb.Flags().IntVar(&fo.BatchN, "batch", 2000, "calls in the throughput batch (0: none)")
	fnb.Flags().IntVarP(&fo.Concurrency, "concurrency", "c", 0, "batch calls in flight (0: the server's capacity)")
	fnb.Flags().StringVar(&fo.Isolation, "isolation", "cgroup", "cgroup, sandbox or both")
	fnb.Flags().StringVar(&fo.Python, "python", "/usr/bin/python3", "host python3 for the baseline")
	fnb.Flags().StringVar(&fo.Gxx, "gxx", "/usr/bin/g++", "host g++ for the baseline")
	var bo bench.BurstOptions
	burst := &cobra.Command{
		Use:   "burst [-n N] [-c C] [--base REF] [--python-bench bench.py]",
		Short: "Rollouts (create, one command, delete) in a burst: failures, hangs, create→first exec, creates/s, pool vs cold, against `runc run` at the same concurrency",
		Args:  cobra.NoArgs,
		RunE: runBench(func(ctx context.Context, c *shoal.Client) (any, error) {
			// A bar on stderr (on a terminal; elsewhere a line per
			// quarter): the JSON result goes to stdout at the end.
			bar := newProgressBar(os.Stderr)
			bo.Progress = func(done, total int) {
				bar.update("", &pb.BuildProgress{Stage: "burst", Done: int64(done), Total: int64(total), Unit: "rollouts"})
			}
			defer bar.clear()
			return bench.Burst(ctx, c, bo)
		}),
	}
	burst.Flags().IntVarP(&bo.N, "number", "n", 1000, "rollouts")
	burst.Flags().IntVarP(&bo.Concurrency, "concurrency", "c", 64, "rollouts in flight")
	burst.Flags().StringVar(&bo.Base, "base", "debian:12", "base layer")
	burst.Flags().DurationVar(&bo.HangAfter, "hang-after", time.Minute, "a create not answered by then counts as a hang")
	burst.Flags().StringVar(&bo.DataDir, "data", "/var/lib/shoal", "the server's data dir (for the runc baseline)")
	burst.Flags().StringVar(&bo.Runtime, "runtime", "runc", "OCI runtime for the baseline")
	burst.Flags().IntVar(&bo.BaselineN, "baseline-n", 0, "`runc run`s in the baseline (0: min(N, 200))")
	burst.Flags().StringVar(&bo.PythonBench, "python-bench", "", "the Python SDK's bench.py: also run the burst from the asyncio SDK")
	var cho bench.ChaosOptions
	var chaosSandbox bool
	chaos := &cobra.Command{
		Use:   "fuzz [-n N] [-c C] [--seed S] [--sandbox]",
		Short: "Send N random and malformed requests to serve; count 5xx and check it still serves",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			cho.URL, cho.APIKey = c.URL(), c.APIKey()
			if chaosSandbox {
				sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: cho.Base})
				if err != nil {
					return err
				}
				defer c.Delete(context.Background(), sb.Id)
				cho.SandboxID = sb.Id
			}
			bar := benchProgress(os.Stderr)
			res, err := bench.Chaos(bench.WithProgress(ctx, bar.update), cho)
			bar.clear()
			if err != nil {
				return err
			}
			if err := printResult(res); err != nil {
				return err
			}
			if res.ServerErrors > 0 || !res.HealthyAfter {
				return fmt.Errorf("%d server errors, healthy after: %v", res.ServerErrors, res.HealthyAfter)
			}
			return nil
		},
	}
	chaos.Flags().IntVarP(&cho.N, "number", "n", 10000, "requests to send")
	chaos.Flags().IntVarP(&cho.Concurrency, "concurrency", "c", 8, "requests in flight")
	chaos.Flags().Uint64Var(&cho.Seed, "seed", 0, "random seed (0: from the clock; printed)")
	chaos.Flags().BoolVar(&chaosSandbox, "sandbox", true, "create a sandbox that some requests name (so they reach an agent)")
	chaos.Flags().StringVar(&cho.Base, "base", "debian:12", "base layer of that sandbox")

	var po bench.PauseOptions
	pauseb := &cobra.Command{
		Use:   "pause [-n N] [--mib M] [--base REF]",
		Short: "Pause+reclaim time per GiB and resume→first exec latency over N sandboxes each holding M MiB",
		Args:  cobra.NoArgs,
		RunE:  runBench(func(ctx context.Context, c *shoal.Client) (any, error) { return bench.Pause(ctx, c, po) }),
	}
	pauseb.Flags().IntVarP(&po.N, "number", "n", 50, "sandboxes")
	pauseb.Flags().IntVar(&po.MiB, "mib", 32, "random MiB each sandbox's resident shell holds (as base64 text)")
	pauseb.Flags().IntVarP(&po.Concurrency, "concurrency", "c", 2, "creates in flight while setting up")
	pauseb.Flags().IntVar(&po.Pausers, "pausers", 1, "pauses in flight (the node reclaims each on the CPU that serves its call: 1 measures one pause's cost, the host's core count the node's throughput)")
	pauseb.Flags().StringVar(&po.Base, "base", "debian:12", "base layer (needs sh, head, base64, tr)")
	var ro bench.ResetOptions
	resetb := &cobra.Command{
		Use:   "reset [-n N] [--dirty-mib M] [--base REF]",
		Short: "Reset→first exec latency against delete + (pooled) create→first exec, interleaved, in the same run",
		Args:  cobra.NoArgs,
		RunE:  runBench(func(ctx context.Context, c *shoal.Client) (any, error) { return bench.Reset(ctx, c, ro) }),
	}
	resetb.Flags().IntVarP(&ro.N, "number", "n", 50, "rounds (one reset and one delete + create each)")
	resetb.Flags().IntVar(&ro.DirtyMiB, "dirty-mib", 1, "MiB each round writes into the sandbox before it is reset or replaced")
	resetb.Flags().StringVar(&ro.Base, "base", "debian:12", "base layer (needs sh, head)")
	cmd.AddCommand(create, execb, qosb, sess, benchLayersCmd(), benchImagesCmd(), fnb, burst, chaos, pauseb, resetb, vmb, benchDensityCmd(), benchLazyCmd(), benchS3ServerCmd(), benchClusterCmd())
	return cmd
}

// runBench is the RunE of a benchmark against the API: it runs run with a
// client and a context cancelled by Ctrl-C, and prints its result as JSON.
func runBench(run func(context.Context, *shoal.Client) (any, error)) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		c, err := client(cmd)
		if err != nil {
			return err
		}
		ctx, cancel := cmdContext()
		defer cancel()
		bar := benchProgress(os.Stderr)
		res, err := run(bench.WithProgress(ctx, bar.update), c)
		bar.clear()
		if err != nil {
			return err
		}
		return printResult(res)
	}
}

// benchBar draws a benchmark's progress (bench.ProgressFunc) on a
// progressBar: a line as each stage starts, then its steps (on a terminal
// redrawn at most every 100 ms but for the stage's end; elsewhere a line
// per quarter). Safe for concurrent use (mu guards the rest).
type benchBar struct {
	mu    sync.Mutex
	bar   *progressBar
	stage string
	last  time.Time
}

func benchProgress(w *os.File) *benchBar { return &benchBar{bar: newProgressBar(w)} }

func (b *benchBar) update(stage string, done, total int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if stage != b.stage {
		b.stage = stage
		b.bar.update(fmt.Sprintf("%s: %d steps", stage, total), nil)
	}
	if now := time.Now(); !b.bar.tty || done >= total || now.Sub(b.last) >= 100*time.Millisecond {
		b.last = now
		b.bar.update("", &pb.BuildProgress{Stage: stage, Done: int64(done), Total: int64(total), Unit: "steps"})
	}
}

func (b *benchBar) clear() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.bar.clear()
}

func printResult(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
