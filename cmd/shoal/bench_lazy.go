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
	"github.com/shoal-sandbox/shoal/internal/layer/remote/s3server"
)

func benchLazyCmd() *cobra.Command {
	var o bench.LazyOptions
	cmd := &cobra.Command{
		Use:   "lazy [-n 64] [-c 32] [--rate 200mbit] [--base-tree DIR]",
		Short: "N sandboxes from an S3 layer store behind a shaped link: whole images pulled first (eager) against lazy loading",
		Long: `Starts its own S3 server (gofakes3) in a network namespace joined by a
veth whose server side is shaped with tc (tbf --rate; netem --delay if the kernel has it),
a builder node that builds a Debian base (--base-tree, made with
debootstrap if absent: minbase + python3 + gcc + libc6-dev, ~330 MB) and a
workspace and pushes them, then, per mode, a fresh node (own data dir and
port) on that store, eager (--lazy=false: the whole images are pulled
before the first sandbox starts) or lazy. N sandboxes (base + workspace),
-c at a time, each import ~100 Python modules and compile and run a C
file. Reports wall time until every workload ended, bytes received over
the link, layer bytes written to the node's disk, and (lazy) fetched
bytes over the distinct bytes of the base the kernel read. Runs as root
(ip netns, tc, runc, FUSE, loop devices); needs no running server.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			o.Progress = func(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
			ctx, cancel := cmdContext()
			defer cancel()
			res, err := bench.Lazy(ctx, o)
			if err != nil {
				return err
			}
			return printResult(res)
		},
	}
	f := cmd.Flags()
	f.IntVarP(&o.N, "number", "n", 64, "sandboxes per mode")
	f.IntVarP(&o.Concurrency, "concurrency", "c", 32, "sandboxes in flight")
	f.StringVar(&o.BaseTree, "base-tree", "", "root file system of the base (default WORK/base-tree, made with debootstrap if absent)")
	f.StringVar(&o.Mirror, "mirror", "http://deb.debian.org/debian", "Debian mirror for debootstrap")
	f.StringVar(&o.WorkDir, "work", "/var/tmp/shoal-bench-lazy", "directory for the S3 data, the nodes' data dirs and logs")
	f.StringVar(&o.Rate, "rate", "200mbit", "rate of the link from the S3 server (tc tbf)")
	f.StringVar(&o.Delay, "delay", "", "delay on the link from the S3 server (tc netem; needs sch_netem)")
	f.DurationVar(&o.Latency, "latency", 2*time.Millisecond, "the S3 server's time to first byte of each request")
	f.StringVar(&o.ChunkSize, "chunk-size", "16K", "--lazy-chunk-size the layers are pushed with")
	f.StringSliceVar(&o.Modes, "modes", []string{"eager", "lazy"}, "modes to run, in order")
	f.Int64Var(&o.MemoryMiB, "memory-mib", 256, "memory of each sandbox")
	return cmd
}

// benchS3ServerCmd serves S3 (gofakes3 over a directory) for bench lazy,
// which runs it in its network namespace.
func benchS3ServerCmd() *cobra.Command {
	var dir, bucket, listen string
	var latency time.Duration
	cmd := &cobra.Command{
		Use:    "s3-server --dir DIR --bucket B --listen HOST:PORT",
		Short:  "An S3-compatible server over a directory (for bench lazy)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer cancel()
			return s3server.ServeLatency(ctx, listen, dir, bucket, latency, func(a string) { fmt.Println("listening", a) })
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory of the buckets")
	cmd.Flags().StringVar(&bucket, "bucket", "", "bucket to create")
	cmd.Flags().StringVar(&listen, "listen", "127.0.0.1:9000", "address")
	cmd.Flags().DurationVar(&latency, "latency", 0, "delay before answering each request")
	return cmd
}
