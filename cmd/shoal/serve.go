//go:build !client

package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	_ "net/http/pprof" // on --pprof only: DefaultServeMux is not the API's mux
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/audit"
	"github.com/shoal-sandbox/shoal/internal/backend/container"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/control"
	"github.com/shoal-sandbox/shoal/internal/e2b"
	"github.com/shoal-sandbox/shoal/internal/egress"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/layer/lazy"
	"github.com/shoal-sandbox/shoal/internal/layer/remote"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/metrics"
	"github.com/shoal-sandbox/shoal/internal/node"
	"github.com/shoal-sandbox/shoal/internal/reclaim"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
	"github.com/shoal-sandbox/shoal/internal/session"
	"github.com/shoal-sandbox/shoal/internal/tenant"
	"github.com/shoal-sandbox/shoal/internal/zram"
)

// closeInheritedOnExec marks every descriptor serve inherited from its
// own parent (a shell, a supervisor) close-on-exec: Go's os/exec passes an
// unlisted descriptor without that flag to every child, and so to runc,
// QEMU and the agents of sandboxes. What serve opens itself is
// close-on-exec already.
func closeInheritedOnExec() error {
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return fmt.Errorf("mark inherited descriptors close-on-exec: %w", err)
	}
	return nil
}

// serveConfig is the configuration of the all-in-one server.
type serveConfig struct {
	DataDir string
	Listen  string
	TLS     apiTLS // serve_tls.go
	Agent   string
	Runtime string
	Debug   bool
	// LogFormat: text (logfmt-like) or json (one object a line).
	LogFormat string
	LogCap    int64
	// Caps on concurrent streams (limits.Streams).
	StreamsPerSandbox, StreamsPerKey int
	// Retention of ended commands (session.Config.KeepEnded, KeepFor).
	KeepCommands    int
	KeepCommandsFor time.Duration
	// CommitMaxBytes bounds what a layer commit copies from a sandbox.
	CommitMaxBytes int64
	// PoolSize: pre-started blank containers kept ready (0: none).
	PoolSize int
	// PoolMax: how far demand may grow the pool.
	PoolMax     int
	RuncSeccomp bool
	// Launcher: container.Config.Launcher (runc or native).
	Launcher string
	// CgroupParent: container.Config.CgroupParent.
	CgroupParent string
	Pprof        string
	// UserNS and UserNSBase: container.Config's.
	UserNS     string
	UserNSBase uint32
	// EgressSubnet: the sandboxes' links (internal/egress), every backend's.
	EgressSubnet string
	// Per-sandbox limits and the node's budgets (node.Config); the strings
	// are sizes or counts as given, parsed by Validate.
	DefaultDisk, MaxDisk, DiskBudget, PidsBudget string
	LogBudget, MaxLogBudget                      string
	// Capacity: node.Capacity's ratios, and --min-available as given.
	MemoryOvercommit, CPUOvercommit float64
	MinAvailable                    string
	PidsLimit                       int64
	Nofile                          uint64
	E2B                             e2bConfig
	// BuildRoots: the directories builds from a server path may read
	// (none: clients upload every source).
	BuildRoots []string
	// BuildUploadMax bounds an uploaded build source, in bytes.
	BuildUploadMax    int64
	buildUploadMaxArg string
	buildRoots        *layer.BuildRoots
	// AutoPause: sandboxes idle this long are paused (0: never), unless
	// their create says otherwise.
	AutoPause time.Duration
	// PausedTimeout: a sandbox paused this long is deleted.
	PausedTimeout time.Duration
	// DeleteBacklog: deleted sandboxes that may wait, frozen, for their
	// teardown after the delete answered (0: none wait).
	DeleteBacklog int
	// ZramSize: the zram swap Shoal sets up for paused sandboxes' memory:
	// "auto" (the flag's default) one of half the host's memory when the
	// host has no swap; a size, one of that size unless a zram swap is
	// active; "" or "0": leave the host's swap alone.
	ZramSize string
	// ResumePrefetch: MADV_WILLNEED before thawing (measured slower).
	ResumePrefetch bool
	// ReclaimBelow (auto, none or a size) and ReclaimMinIdle: memory
	// pressure pauses idle sandboxes, longest idle first (node.Pressure).
	ReclaimBelow   string
	ReclaimMinIdle time.Duration
	// ReclaimPSI: node.Pressure.PSI (percent; 0: off).
	ReclaimPSI float64
	// LayerStore: where layers live beyond this node (file:///dir or
	// s3://bucket/prefix; "" none) and how to reach and cache it.
	LayerStore layerStoreConfig
	// Registry: how pulls reach OCI registries (serve_registry.go).
	Registry registryConfig
	registry layer.RegistryConfig // from Registry, by Validate
	// VM: the microvm backend (serve_vm.go).
	VM vmConfig
	// Cluster: the role, etcd and the node's name (serve_cluster.go).
	Cluster clusterConfig
}

// layerStoreConfig configures the node's layer store and lazy loader.
type layerStoreConfig struct {
	URL          string
	S3           remote.Options
	WriteThrough bool
	Lazy         bool // s3://: load images on demand (else pull whole on first use)
	CacheMaxArg  string
	CacheMax     int64
	// Whole copies of store images (pulled on first use): a bounded cache.
	ImageCacheMaxArg string
	ImageCacheMax    int64
	FetchTimeout     time.Duration
	ChunkSizeArg     string
	ChunkSize        int64
}

// e2bConfig configures the E2B-compatible endpoint (internal/e2b).
type e2bConfig struct {
	Listen          string // "" disables it
	ListenSet       bool   // --e2b-listen was given: failing to listen is fatal
	Domain          string // default shoal.localhost:<port of Listen>
	DefaultTemplate string
	Pause           string
	User            string   // default sandbox user of E2B requests
	TemplateUsers   []string // TEMPLATE=USER
}

// Validate fills defaults and checks the configuration.
func (c *serveConfig) Validate() error {
	if c.DataDir == "" {
		return errors.New("--data is required")
	}
	if c.LogFormat != "text" && c.LogFormat != "json" {
		return fmt.Errorf("--log-format %q: want text or json", c.LogFormat)
	}
	abs, err := filepath.Abs(c.DataDir)
	if err != nil {
		return err
	}
	c.DataDir = abs
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		return fmt.Errorf("--listen %q must be HOST:PORT: %w", c.Listen, err)
	}
	if err := c.TLS.validate(); err != nil {
		return err
	}
	if c.registry, err = c.Registry.layerConfig(); err != nil {
		return err
	}
	c.Cluster.scheme, c.Cluster.e2bClosed = c.TLS.scheme(), c.nodeE2BClosed()
	if err := c.Cluster.validate(c.Listen); err != nil { // serve_cluster.go
		return err
	}
	if c.E2B.Listen != "" {
		if _, _, err := net.SplitHostPort(c.E2B.Listen); err != nil {
			return fmt.Errorf("--e2b-listen %q must be HOST:PORT (or empty to disable): %w", c.E2B.Listen, err)
		}
	}
	if c.Cluster.Role == roleControl {
		return nil // a control replica runs no node
	}
	if c.KeepCommands == 0 || c.KeepCommands < -1 {
		return fmt.Errorf("--command-retention %d: want the number of ended commands kept per sandbox (at least 1), or -1 for no limit", c.KeepCommands)
	}
	if c.KeepCommandsFor < 0 {
		return fmt.Errorf("--command-retention-age %s: want a duration such as 24h, or 0 for no limit", c.KeepCommandsFor)
	}
	if c.buildUploadMaxArg != "" {
		n, err := parseBytes(c.buildUploadMaxArg)
		if err != nil || n <= 0 {
			return fmt.Errorf("--build-upload-max %q: want a size such as 32G", c.buildUploadMaxArg)
		}
		c.BuildUploadMax = n
	}
	if c.LayerStore.URL != "" {
		n, err := parseBytes(c.LayerStore.CacheMaxArg)
		if err != nil || n < 1<<20 {
			return fmt.Errorf("--lazy-cache-max %q: want a size of at least 1M, such as 20G", c.LayerStore.CacheMaxArg)
		}
		c.LayerStore.CacheMax = n
		if c.LayerStore.ImageCacheMaxArg != "none" {
			if n, err = parseBytes(c.LayerStore.ImageCacheMaxArg); err != nil || n < 1<<20 {
				return fmt.Errorf("--layer-cache-max %q: want a size of at least 1M, such as 100G, or none", c.LayerStore.ImageCacheMaxArg)
			}
			c.LayerStore.ImageCacheMax = n
		}
		if n, err = parseBytes(c.LayerStore.ChunkSizeArg); err != nil || n < lazy.MinChunkSize || n > lazy.MaxChunkSize || n&(n-1) != 0 {
			return fmt.Errorf("--lazy-chunk-size %q: want a power of two from 4K to 16M", c.LayerStore.ChunkSizeArg)
		}
		c.LayerStore.ChunkSize = n
		if c.LayerStore.FetchTimeout < time.Second || c.LayerStore.FetchTimeout > 10*time.Minute {
			return fmt.Errorf("--lazy-fetch-timeout %s: want 1s to 10m", c.LayerStore.FetchTimeout)
		}
	}
	if c.buildRoots, err = layer.NewBuildRoots(c.BuildRoots); err != nil {
		return fmt.Errorf("--build-root: %w", err)
	}
	data := c.DataDir
	if real, err := filepath.EvalSymlinks(data); err == nil {
		data = real
	}
	for _, r := range c.buildRoots.Dirs() {
		if within(data, r) || within(r, data) {
			return fmt.Errorf("--build-root %s overlaps the data directory %s (its keys, database and the sandboxes' files): give a directory of build sources", r, c.DataDir)
		}
	}
	if c.AutoPause < 0 {
		return fmt.Errorf("--auto-pause %s: want 0 (off) or a duration such as 60s", c.AutoPause)
	}
	if c.PausedTimeout < 0 {
		return fmt.Errorf("--paused-timeout %s: want a duration such as 24h", c.PausedTimeout)
	}
	if c.DeleteBacklog < 0 || c.DeleteBacklog > maxDeleteBacklog {
		return fmt.Errorf("--delete-backlog %d: want 0 (every delete tears down before it answers) up to %d", c.DeleteBacklog, maxDeleteBacklog)
	}
	if c.ZramSize != "" && c.ZramSize != "auto" {
		if _, err := parseBytes(c.ZramSize); err != nil {
			return fmt.Errorf("--zram-size %q: want auto, 0 or a size such as 8GiB: %w", c.ZramSize, err)
		}
	}
	if c.Agent == "" {
		c.Agent = findAgent()
	}
	if c.Agent == "" {
		return errors.New("shoal-agent not found next to the shoal binary nor in /usr/local/lib/shoal: build it (see README) or pass --agent")
	}
	// Bundles and VM images name the agent by this path from elsewhere
	// (runc resolves a mount source from the bundle directory).
	abs, err = filepath.Abs(c.Agent)
	if err != nil {
		return fmt.Errorf("--agent %q: %w", c.Agent, err)
	}
	c.Agent = abs
	if err := node.CheckAgentBinary(c.Agent); err != nil {
		return err
	}
	return nil
}

// maxDeleteBacklog bounds --delete-backlog: what a backlog holds (memory,
// disks, user namespace ranges) is not counted by admission.
const maxDeleteBacklog = 4096

// pidsMax is --pids-budget: the bound of all sandboxes' tasks together
// (pids.max of their parent cgroup), 0 for none.
func (c *serveConfig) pidsMax() (int64, error) {
	switch c.PidsBudget {
	case "none":
		return 0, nil
	case "auto", "":
		n, err := node.HostPidsBudget()
		if err != nil {
			return 0, fmt.Errorf("--pids-budget auto: %w", err)
		}
		return n, nil
	}
	n, err := strconv.ParseInt(c.PidsBudget, 10, 64)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("--pids-budget %q: want auto, none or a positive number", c.PidsBudget)
	}
	return n, nil
}

// nodeConfig is the node manager's configuration: limits and budgets
// parsed, "auto" budgets computed from the host.
func (c *serveConfig) nodeConfig() (node.Config, error) {
	nc := node.Config{DataDir: c.DataDir, AgentBinary: c.Agent, CommitMaxBytes: c.CommitMaxBytes, PidsLimit: c.PidsLimit,
		AutoPause: c.AutoPause, PausedTimeout: c.PausedTimeout, DeleteBacklog: c.DeleteBacklog}
	if c.DeleteBacklog == 0 {
		nc.DeleteBacklog = -1 // node.Config's 0 is its default
	}
	if c.MemoryOvercommit < 0 || c.CPUOvercommit < 0 {
		return nc, fmt.Errorf("--memory-overcommit and --cpu-overcommit must not be negative")
	}
	nc.Capacity = node.Capacity{MemoryOvercommit: c.MemoryOvercommit, CPUOvercommit: c.CPUOvercommit}
	switch c.MinAvailable {
	case "none", "0":
	case "auto", "":
		// 5% of the host's memory, at least 512 MiB.
		nc.Capacity.MinAvailable = 512 << 20
		if total, _, _, err := node.HostCapacity(); err == nil {
			nc.Capacity.MinAvailable = max(nc.Capacity.MinAvailable, total/20)
		}
	default:
		n, err := parseBytes(c.MinAvailable)
		if err != nil || n < 0 {
			return nc, fmt.Errorf("--min-available %q: want auto, none or a size such as 2G", c.MinAvailable)
		}
		nc.Capacity.MinAvailable = n
	}
	nc.Pressure.MinIdle = c.ReclaimMinIdle
	if c.ReclaimPSI < 0 || c.ReclaimPSI > 100 {
		return nc, fmt.Errorf("--reclaim-psi %v: want a share of time from 0 (off) to 100", c.ReclaimPSI)
	}
	nc.Pressure.PSI = c.ReclaimPSI
	switch c.ReclaimBelow {
	case "none", "0":
	case "auto", "":
		// 10% of the host's memory, at least 1 GiB: above the admission
		// floor (--min-available auto, 5%), so idle sandboxes make room
		// before creates are refused.
		nc.Pressure.Below = 1 << 30
		if total, _, _, err := node.HostCapacity(); err == nil {
			nc.Pressure.Below = max(nc.Pressure.Below, total/10)
		}
	default:
		n, err := parseBytes(c.ReclaimBelow)
		if err != nil || n < 0 {
			return nc, fmt.Errorf("--reclaim-below %q: want auto, none or a size such as 2G", c.ReclaimBelow)
		}
		nc.Pressure.Below = n
	}
	if c.PidsLimit < 1 || c.PidsLimit > 1<<22 {
		return nc, fmt.Errorf("--pids-limit %d: want 1 to %d", c.PidsLimit, 1<<22)
	}
	size := func(flag, v string) (int64, error) {
		n, err := parseBytes(v)
		if err != nil {
			return 0, fmt.Errorf("--%s: %w", flag, err)
		}
		return n, nil
	}
	var err error
	if c.DefaultDisk == "none" {
		nc.DefaultDisk = -1
	} else if nc.DefaultDisk, err = size("default-disk", c.DefaultDisk); err != nil {
		return nc, err
	}
	if nc.MaxDisk, err = size("max-disk", c.MaxDisk); err != nil {
		return nc, err
	}
	if c.LogBudget != "" && c.LogBudget != "auto" {
		if nc.DefaultLog, err = size("log-budget", c.LogBudget); err != nil {
			return nc, err
		}
	}
	if nc.MaxLog, err = size("max-log-budget", c.MaxLogBudget); err != nil {
		return nc, err
	}
	switch c.DiskBudget {
	case "none":
	case "auto", "":
		if nc.DiskBudget, err = node.DiskBudgetFor(c.DataDir, 4); err != nil {
			return nc, err
		}
	default:
		if nc.DiskBudget, err = size("disk-budget", c.DiskBudget); err != nil {
			return nc, err
		}
	}
	return nc, nc.Validate()
}

// within reports whether path p is dir or below it (both clean, absolute).
func within(p, dir string) bool {
	rel, err := filepath.Rel(dir, p)
	return err == nil && (rel == "." || filepath.IsLocal(rel))
}

// findAgent looks for shoal-agent beside this executable, then in the
// install location.
func findAgent() string {
	var cands []string
	if exe, err := os.Executable(); err == nil {
		cands = append(cands, filepath.Join(filepath.Dir(exe), "shoal-agent"))
	}
	cands = append(cands, "/usr/local/lib/shoal/shoal-agent", "/usr/local/bin/shoal-agent")
	for _, c := range cands {
		if fi, err := os.Stat(c); err == nil && fi.Mode().IsRegular() {
			return c
		}
	}
	return ""
}

func serveCmd() *cobra.Command {
	var cfg serveConfig
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the API, a node agent and the local layer store (all in one)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := cfg.Validate(); err != nil {
				return err
			}
			cfg.E2B.ListenSet = cmd.Flags().Changed("e2b-listen")
			return serve(cfg)
		},
	}
	cmd.Flags().StringVar(&cfg.DataDir, "data", "/var/lib/shoal", "data directory")
	cmd.Flags().StringVar(&cfg.Listen, "listen", "127.0.0.1:7480", "API listen address")
	cmd.Flags().StringVar(&cfg.Agent, "agent", "", "path of the shoal-agent binary (default: beside shoal)")
	cmd.Flags().StringVar(&cfg.Runtime, "runtime", "runc", "OCI runtime for the container backend")
	cmd.Flags().BoolVar(&cfg.Debug, "debug", false, "debug logging")
	cmd.Flags().StringVar(&cfg.LogFormat, "log-format", "text", "log format on stderr: text or json (slog's; stable keys such as sandbox_id, tenant, layer)")
	cmd.Flags().IntVar(&cfg.PoolSize, "pool-size", container.DefaultPoolSize, "pre-started blank containers kept ready for creates (0: none)")
	cmd.Flags().IntVar(&cfg.PoolMax, "pool-max", container.DefaultPoolMax, fmt.Sprintf("how many ready containers demand may grow the pool to (each holds about %d MiB)", container.PoolMemberBytes>>20))
	cmd.Flags().StringVar(&cfg.EgressSubnet, "egress-subnet", egress.DefaultSubnet, "IPv4 subnet of the links of sandboxes created with network egress (a /31 each; nodes sharing a host need their own); empty disables egress")
	cmd.Flags().StringVar(&cfg.Launcher, "launcher", container.LauncherNative, "how pool containers start: native (the node and the agent set the container up themselves, with runc's isolation; a create that finds the pool empty starts one instead of running runc), or runc (runc run)")
	cmd.Flags().StringVar(&cfg.CgroupParent, "cgroup-parent", container.DefaultCgroupParent, "the cgroup (in every hierarchy, from its root) under which each sandbox gets its own; nodes sharing a host need their own")
	cmd.Flags().BoolVar(&cfg.RuncSeccomp, "runc-seccomp", false, "let runc compile docker's seccomp profile per container instead of once per node (slower; disables the pool)")
	cmd.Flags().StringVar(&cfg.DefaultDisk, "default-disk", "1G", "size of a sandbox's writable layer when its create gives none (its own file system: ENOSPC when full); \"none\": no limit")
	cmd.Flags().StringVar(&cfg.MaxDisk, "max-disk", "1T", "largest disk a create may ask for")
	cmd.Flags().StringVar(&cfg.LogBudget, "log-budget", "auto", "bytes of its commands' output logs (trajectories and shells included) a sandbox keeps on the node when its create gives none; past it its oldest output is pruned; \"auto\": a quarter of its disk (at least 1M; 256M without a disk limit). Counted in --disk-budget")
	cmd.Flags().StringVar(&cfg.MaxLogBudget, "max-log-budget", "64G", "largest log budget a create may ask for")
	cmd.Flags().StringVar(&cfg.DiskBudget, "disk-budget", "auto", "the sum of the sandboxes' disk sizes this node admits; \"auto\": 4 x the data dir's free space less a reserve (a tenth of the file system, at least 1 GiB); a size (e.g. the free space) to guarantee it; \"none\"")
	cmd.Flags().Int64Var(&cfg.PidsLimit, "pids-limit", container.DefaultPids, "tasks (processes and threads) per sandbox")
	cmd.Flags().Float64Var(&cfg.MemoryOvercommit, "memory-overcommit", 0, "admit sandboxes whose memory limits add up to this many times the host's memory (paused ones count nothing); 0: no bound (--min-available guards the real memory)")
	cmd.Flags().Float64Var(&cfg.CPUOvercommit, "cpu-overcommit", 0, "admit sandboxes whose CPU limits add up to this many times the host's CPUs (paused ones count nothing); 0: no bound")
	cmd.Flags().StringVar(&cfg.MinAvailable, "min-available", "auto", "refuse creates (unavailable: node full) while the host's MemAvailable is below this; \"auto\": 5% of its memory, at least 512 MiB; \"none\"")
	cmd.Flags().StringVar(&cfg.PidsBudget, "pids-budget", "auto", "how many tasks all sandboxes together may run (pids.max of their parent cgroup; each sandbox also has --pids-limit); \"auto\": 3/4 of the smaller of kernel.pid_max and kernel.threads-max; a number; \"none\"")
	cmd.Flags().Uint64Var(&cfg.Nofile, "sandbox-nofile", container.DefaultNofile, "RLIMIT_NOFILE (open files per process) in sandboxes")
	cmd.Flags().StringVar(&cfg.UserNS, "userns", container.UserNSAuto, "run each sandbox in a user namespace of its own mapped to an unprivileged host range: auto (when the kernel supports idmapped layers), on (fail to start otherwise) or off (sandbox root is host root)")
	cmd.Flags().Uint32Var(&cfg.UserNSBase, "userns-base", container.DefaultUserNSBase, "first host uid/gid of the sandboxes' ranges (65536 ids each)")
	cmd.Flags().StringVar(&cfg.Pprof, "pprof", "", "serve Go profiles (net/http/pprof) on this HOST:PORT, unauthenticated: keep it on localhost")
	cmd.Flags().IntVar(&cfg.StreamsPerSandbox, "max-streams-per-sandbox", limits.DefaultStreamsPerSandbox, "concurrent streams (commands attached, watches, PTYs, port forwards, proxied port connections, E2B's public ones included) a sandbox may hold; past it: resource_exhausted (429 on the E2B face)")
	cmd.Flags().IntVar(&cfg.StreamsPerKey, "max-streams-per-key", limits.DefaultStreamsPerKey, "concurrent streams an API key may hold, over all its sandboxes")
	cmd.Flags().Int64Var(&cfg.LogCap, "command-log-cap", session.DefaultLogCap, "bytes of output kept per command (the rest is dropped and reported)")
	cmd.Flags().IntVar(&cfg.KeepCommands, "command-retention", session.DefaultKeepEnded, "ended commands kept per sandbox (records and output logs; older ones are pruned), besides trajectory steps and shells, which are kept as long as the sandbox lives; -1: no limit")
	cmd.Flags().DurationVar(&cfg.KeepCommandsFor, "command-retention-age", 0, "also prune ended commands older than this (e.g. 24h); 0: no age limit")
	cmd.Flags().Int64Var(&cfg.CommitMaxBytes, "commit-max-bytes", layer.DefaultCommitMaxBytes, "bytes of files a layer commit copies from a sandbox at most (a bigger writable layer is refused)")
	cmd.Flags().StringArrayVar(&cfg.BuildRoots, "build-root", nil, "a directory `layer build --server-path` may read from (repeatable; none by default: clients upload their sources)")
	cmd.Flags().StringVar(&cfg.buildUploadMaxArg, "build-upload-max", "32G", "largest build source a client may upload (a bigger one is refused with 413)")
	addRegistryFlags(cmd, &cfg.Registry)
	cmd.Flags().StringVar(&cfg.LayerStore.URL, "layer-store", "", "layer store shared by nodes: file:///dir (a local or shared file system: images are mounted straight from it) or s3://bucket/prefix (loaded lazily); a node resolves layers it does not hold from it. S3 credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
	cmd.Flags().StringVar(&cfg.LayerStore.S3.Endpoint, "s3-endpoint", "", "S3 endpoint, http(s)://host:port or host:port (default $SHOAL_S3_ENDPOINT, else s3.amazonaws.com)")
	cmd.Flags().StringVar(&cfg.LayerStore.S3.Region, "s3-region", "", "S3 region (default $AWS_REGION)")
	cmd.Flags().BoolVar(&cfg.LayerStore.S3.PathStyle, "s3-path-style", false, "S3 path-style requests (bucket in the path; most on-premise servers)")
	cmd.Flags().BoolVar(&cfg.LayerStore.WriteThrough, "layer-store-write-through", false, "push every layer built, committed or imported to the layer store")
	cmd.Flags().BoolVar(&cfg.LayerStore.Lazy, "lazy", true, "load s3:// images on demand through FUSE (false: pull a whole image on its first use)")
	cmd.Flags().StringVar(&cfg.LayerStore.ImageCacheMaxArg, "layer-cache-max", "100G", "bytes of whole images copied from the layer store kept on disk (LRU over images no sandbox uses; layers built or pulled here never count), or none")
	cmd.Flags().StringVar(&cfg.LayerStore.CacheMaxArg, "lazy-cache-max", "20G", "bytes of lazily fetched chunks kept on disk (DATA/layers/lazy-cache, LRU)")
	cmd.Flags().DurationVar(&cfg.LayerStore.FetchTimeout, "lazy-fetch-timeout", 30*time.Second, "a chunk the store does not deliver within this (retries included) fails its read with EIO")
	cmd.Flags().StringVar(&cfg.LayerStore.ChunkSizeArg, "lazy-chunk-size", "16K", "chunk size of the digest lists push writes (lazy fetches use the size a layer was pushed with)")
	cmd.Flags().IntVar(&cfg.DeleteBacklog, "delete-backlog", node.DefaultDeleteBacklog, "deleted sandboxes that may wait, frozen, for their teardown after the delete answered (it runs when creates pause); 0: every delete tears down before it answers")
	cmd.Flags().DurationVar(&cfg.AutoPause, "auto-pause", 0, "pause sandboxes idle this long (no request, no running command) and reclaim their memory; 0: never; a create's auto_pause_seconds overrides it")
	cmd.Flags().DurationVar(&cfg.PausedTimeout, "paused-timeout", 24*time.Hour, "delete sandboxes paused this long (a paused sandbox's idle timeout is suspended)")
	cmd.Flags().StringVar(&cfg.ZramSize, "zram-size", "auto", "the compressed swap in RAM (zram) that paused sandboxes' memory goes to: auto sets one up of half the host's memory when the host has no swap; a size (e.g. 8GiB) sets one up of that size unless a zram swap is active already; 0 leaves the host's swap alone (without swap a pause reclaims file pages only)")
	cmd.Flags().StringVar(&cfg.ReclaimBelow, "reclaim-below", "auto", "when the host's MemAvailable falls below this, pause idle sandboxes (and reclaim their memory), longest idle first, until it is a quarter above it; \"auto\": 10% of its memory, at least 1 GiB; \"none\": never")
	cmd.Flags().Float64Var(&cfg.ReclaimPSI, "reclaim-psi", 20, "also when tasks on the host stall on memory this share of the time (percent, /proc/pressure/memory some avg10), pause up to 4 idle sandboxes, longest idle first, every 10 s while it lasts; 0: never")
	cmd.Flags().DurationVar(&cfg.ReclaimMinIdle, "reclaim-min-idle", node.DefaultPressureMinIdle, "memory pressure pauses only sandboxes idle (no request, no running command) at least this long")
	cmd.Flags().BoolVar(&cfg.ResumePrefetch, "resume-prefetch", false, "before thawing a paused sandbox, ask the kernel to read its swapped-out memory back (MADV_WILLNEED); measured slower")
	cmd.Flags().StringVar(&cfg.E2B.Listen, "e2b-listen", "127.0.0.1:7481", "E2B-compatible endpoint (API and sandbox traffic, HTTP and HTTPS on one port); empty disables it")
	cmd.Flags().StringVar(&cfg.E2B.Domain, "e2b-domain", "", "sandbox domain for E2B clients: getHost(port) is PORT-ID.DOMAIN (default shoal.localhost:<e2b port>)")
	addVMFlags(cmd, &cfg.VM)
	cmd.Flags().StringVar(&cfg.E2B.DefaultTemplate, "e2b-default-template", "debian:12", "environment or base layer used for E2B's default template \"base\" when none is named base")
	cmd.Flags().StringVar(&cfg.E2B.User, "e2b-user", "user", "sandbox user of E2B requests that name none (root when a sandbox has no such user)")
	cmd.Flags().StringArrayVar(&cfg.E2B.TemplateUsers, "e2b-template-user", nil, "TEMPLATE=USER: the default E2B user of sandboxes of that template (repeatable)")
	cmd.Flags().StringVar(&cfg.E2B.Pause, "e2b-pause", e2b.PauseOn, "E2B pause: on (pauses the sandbox for real; connect resumes it) or refuse (501)")
	addClusterFlags(cmd, &cfg.Cluster) // serve_cluster.go
	addTLSFlags(cmd, &cfg.TLS, &cfg.Cluster.TLS)
	return cmd
}

// newLogger is serve's logger on stderr, every role's: --log-format and
// --debug.
func newLogger(cfg serveConfig) *slog.Logger {
	opts := &slog.HandlerOptions{Level: slog.LevelInfo}
	if cfg.Debug {
		opts.Level = slog.LevelDebug
	}
	if cfg.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

func serve(cfg serveConfig) error {
	if err := closeInheritedOnExec(); err != nil {
		return err
	}
	if cfg.Cluster.Role == roleControl {
		return serveControl(cfg) // serve_cluster.go
	}
	log := newLogger(cfg)
	if cfg.Cluster.Role == roleNode {
		// Every line says which node wrote it: logs of a fleet are read
		// together.
		log = log.With("node", cfg.Cluster.NodeName)
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return err
	}
	auth, err := control.LoadOrCreateAdminKey(cfg.DataDir)
	if err != nil {
		return err
	}
	db, err := bbolt.Open(filepath.Join(cfg.DataDir, "shoal.db"), 0o600, &bbolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return fmt.Errorf("open store %s (is another shoal serve using this data dir?): %w", filepath.Join(cfg.DataDir, "shoal.db"), err)
	}
	defer db.Close()
	layers, err := layer.Open(filepath.Join(cfg.DataDir, "layers"), db, log)
	if err != nil {
		return err
	}
	applyRegistry(cfg.registry, cfg.Registry, layers, log)
	mt := metrics.New()
	if cfg.LayerStore.URL != "" {
		lz, err := openLayerStore(cfg, layers, mt, log)
		if err != nil {
			return err
		}
		if lz != nil {
			defer lz.Unmount()
		}
	}
	setUpSwap(cfg, log)
	poolSize := cfg.PoolSize
	if poolSize == 0 {
		poolSize = -1 // container.Config: 0 means its default, -1 none
	}
	node.RaiseHostLimits(log)
	// After the raise: the node's cap on streams keeps a reserve of its
	// open files limit for everything else.
	streams, err := limits.NewStreams(cfg.StreamsPerSandbox, cfg.StreamsPerKey, 0)
	if err != nil {
		return fmt.Errorf("--max-streams-per-sandbox, --max-streams-per-key: %w", err)
	}
	{
		ps, pk, total := streams.Caps()
		log.Info("stream caps", "per_sandbox", ps, "per_key", pk, "per_node", total)
	}
	nodeCfg, err := cfg.nodeConfig()
	if err != nil {
		return err
	}
	pidsMax, err := cfg.pidsMax()
	if err != nil {
		return err
	}
	// One egress for every backend (one allocator of links, one table).
	var eg *egress.Egress
	if cfg.EgressSubnet != "" {
		if eg, err = egress.New(cfg.EgressSubnet, filepath.Join(cfg.DataDir, "runc"), "/run/shoal", log); err != nil {
			return err
		}
	}
	ctr, err := container.New(container.Config{
		DiskDir:        filepath.Join(cfg.DataDir, "disk"),
		PremadeDisk:    max(nodeCfg.DefaultDisk, 0),
		Nofile:         cfg.Nofile,
		PidsMax:        pidsMax,
		PoolSize:       poolSize,
		PoolMax:        cfg.PoolMax,
		RuncSeccomp:    cfg.RuncSeccomp,
		Launcher:       cfg.Launcher,
		CgroupParent:   cfg.CgroupParent,
		ResumePrefetch: cfg.ResumePrefetch,
		Runtime:        cfg.Runtime,
		StateDir:       filepath.Join(cfg.DataDir, "runc"),
		Log:            log,
		Egress:         eg,
		UserNS:         cfg.UserNS,
		UserNSBase:     cfg.UserNSBase,
	})
	if err != nil {
		return err
	}
	if ok, how := ctr.DiskLimits(); ok {
		log.Info("sandbox disks: limited", "how", how, "default", nodeCfg.DefaultDisk, "max", nodeCfg.MaxDisk, "budget", nodeCfg.DiskBudget)
	} else {
		log.Error("sandbox disks: NOT limited: a sandbox can fill the host's disk", "why", how)
	}
	log.Info("sandbox tasks", "pids_limit", nodeCfg.PidsLimit, "pids_budget", pidsMax, "nofile", cfg.Nofile)
	nodeCfg.Metrics = mt
	if cfg.Cluster.Role == roleNode {
		nodeCfg.IDPrefix = cluster.Tag(cfg.Cluster.NodeName) // its sandbox IDs name it
	}
	// Tenants' keys and quotas (the admin key stays the admin), and the
	// audit log of who did what (DATA/audit.log).
	localKeys, err := tenant.Open(db)
	if err != nil {
		return err
	}
	var keys control.KeyStore = localKeys
	if cfg.Cluster.Role == roleNode {
		// A node of a cluster: the cluster's keys and quotas (etcd), so
		// that a tenant's key works at every node and replica.
		ten, closeTen, err := nodeTenancy(cfg.Cluster, localKeys, log) // serve_cluster.go
		if err != nil {
			return err
		}
		defer closeTen()
		keys = ten
	}
	auth.SetKeys(keys)
	nodeCfg.Quotas = keys
	auditLog, err := audit.Open(filepath.Join(cfg.DataDir, "audit.log"), 0, log, mt.AuditDropped)
	if err != nil {
		return err
	}
	defer auditLog.Close()
	vms, err := vmBackends(cfg.VM, cfg.DataDir, cfg.Agent, cfg.CgroupParent, eg, log)
	if err != nil {
		return err
	}
	mgr, err := node.New(nodeCfg, db, layers, append([]sandbox.Backend{ctr}, vms...), log)
	if err != nil {
		return err
	}
	registerGauges(mt, mgr, ctr)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	sessions, err := session.New(session.Config{LogCap: cfg.LogCap, KeepEnded: cfg.KeepCommands, KeepFor: cfg.KeepCommandsFor}, db, mgr, log)
	if err != nil {
		return err
	}
	defer sessions.Close()
	mgr.OnDelete(sessions.DropSandbox)
	mgr.OnReset(sessions.ResetSandbox)
	mgr.OnEndProcesses(sessions.PauseSandboxFSOnly)
	var e2bSrv *e2b.Server
	var e2bLn net.Listener
	if cfg.E2B.Listen != "" {
		if e2bLn, err = net.Listen("tcp", cfg.E2B.Listen); err != nil {
			if cfg.E2B.ListenSet {
				return fmt.Errorf("--e2b-listen: %w", err)
			}
			// The default port is taken (another serve, a test): go on without.
			log.Warn("E2B endpoint disabled: its default address is taken (pass --e2b-listen to choose one)", "listen", cfg.E2B.Listen, "err", err)
			e2bLn = nil
		}
	}
	if e2bLn != nil {
		domain := cfg.E2B.Domain
		if domain == "" {
			domain = "shoal.localhost:" + strconv.Itoa(e2bLn.Addr().(*net.TCPAddr).Port)
		}
		if !cfg.nodeE2BClosed() {
			if e2bLn, err = e2b.Serve(e2bLn, cfg.DataDir, domain); err != nil {
				return err
			}
		}
		defer e2bLn.Close()
		tusers, err := keyValues(cfg.E2B.TemplateUsers, "--e2b-template-user")
		if err != nil {
			return err
		}
		e2bSrv, err = e2b.New(e2b.Config{DataDir: cfg.DataDir, Domain: domain, DefaultTemplate: cfg.E2B.DefaultTemplate, Pause: cfg.E2B.Pause, Audit: auditLog,
			DefaultUser: cfg.E2B.User, TemplateUsers: tusers},
			db, mgr, sessions, func(h http.Handler) http.Handler { return auth.Middleware(h, "/health") }, log)
		if err != nil {
			return err
		}
		defer e2bSrv.Close()
		e2bSrv.CountRequests(mt.E2BRequest)
		e2bSrv.SetStreams(streams)
		mgr.OnDelete(e2bSrv.OnDelete)
		sessions.OnPrune(e2bSrv.OnPrune)
	}
	// None of the recoveries waits for a sandbox's agent (one may be
	// stopped, traced, wedged): the API listens promptly. Run checks the
	// agents in the background and shows those that do not answer in
	// error until they do; the session layer re-attaches to commands in
	// the background.
	if err := mgr.Recover(ctx); err != nil {
		return fmt.Errorf("recover sandboxes: %w", err)
	}
	if err := sessions.Recover(ctx); err != nil {
		return fmt.Errorf("recover commands: %w", err)
	}
	if e2bSrv != nil {
		if err := e2bSrv.Recover(); err != nil {
			return fmt.Errorf("recover e2b state: %w", err)
		}
	}
	go mgr.Run(ctx)
	// The warm pool fills from now (at the lowest priority), not from the
	// first create: the first creates after a start or restart are warm.
	ctr.StartPool(cfg.Agent)

	if cfg.Pprof != "" {
		go func() { log.Warn("pprof", "err", http.ListenAndServe(cfg.Pprof, nil)) }()
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true) // gRPC clients
	api := control.New(mgr, sessions, auth, log)
	api.SetMetrics(mt)
	api.SetStreams(streams)
	api.SetBuildPolicy(control.BuildPolicy{Roots: cfg.buildRoots, UploadMax: cfg.BuildUploadMax})
	api.SetTenancy(keys, auditLog)
	if cfg.Cluster.Role == roleNode {
		api.SetNodeName(cfg.Cluster.NodeName)
	}
	ln, handler, err := cfg.TLS.wrap(ln, api.Handler(), "/healthz")
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler:           handler,
		Protocols:         &protocols,
		ReadHeaderTimeout: 10 * time.Second,
	}
	if cfg.Cluster.Role == roleNode {
		var e2bAddr net.Addr
		if e2bSrv != nil {
			e2bAddr = e2bLn.Addr()
		}
		leave, err := registerNode(ctx, cfg.Cluster, e2bAddr, mgr, layers, api, log) // serve_cluster.go
		if err != nil {
			return err
		}
		defer leave()
	}
	log.Info("shoal serving", "listen", ln.Addr().String(), "tls", cfg.TLS.Cert != "", "client_certs", cfg.TLS.ClientCA != "", "data", cfg.DataDir,
		"admin_key", filepath.Join(cfg.DataDir, control.AdminKeyFile), "build_roots", cfg.buildRoots.Dirs())
	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(ln) }()
	if e2bSrv != nil {
		var e2bHandler http.Handler = e2bSrv
		if cfg.nodeE2BClosed() {
			if e2bLn, e2bHandler, err = cfg.TLS.wrap(e2bLn, e2bSrv, "/health"); err != nil {
				return err
			}
		}
		e2bHTTP := &http.Server{Handler: e2bHandler, Protocols: &protocols, ReadHeaderTimeout: 10 * time.Second}
		defer e2bHTTP.Close()
		log.Info("e2b endpoint serving", "listen", e2bLn.Addr().String(), "ca", filepath.Join(cfg.DataDir, e2b.CAFile))
		go func() { errc <- e2bHTTP.Serve(e2bLn) }()
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	// Sandboxes keep running: only the API stops, and the pool of blank
	// containers and FnCall's pools (nobody's sandboxes) are drained.
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = srv.Shutdown(shutdown)
	if cerr := api.Close(shutdown); cerr != nil {
		log.Warn("stop the FnCall pools", "err", cerr)
	}
	if cerr := ctr.Close(shutdown); cerr != nil {
		log.Warn("drain the container pool", "err", cerr)
	}
	if eg != nil {
		// The rules go only when no sandbox has egress (they outlive us).
		if cerr := eg.Close(); cerr != nil {
			log.Warn("egress rules", "err", cerr)
		}
	}
	return err
}

// registerGauges adds what /metrics reads at each scrape: sandboxes by
// backend and state, the node's capacity and oversubscription, and the
// warm pool's sizes and counters.
func registerGauges(mt *metrics.Metrics, mgr *node.Manager, ctr *container.Backend) {
	mt.Gauges("shoal_sandboxes", "Sandboxes on this node by backend and state.", []string{"backend", "state"}, func() []metrics.Gauge {
		var out []metrics.Gauge
		for k, n := range mgr.StateCounts() {
			out = append(out, metrics.Gauge{Labels: []string{k[0], k[1]}, Value: float64(n)})
		}
		return out
	})
	mt.Gauges("shoal_node_capacity", "The node's CPU (millicpu) and memory (memory_bytes): the host's (kind host; memory also available: MemAvailable), what admission admits in all after --cpu-overcommit and --memory-overcommit (admitted; absent when unbounded), and the limits of its sandboxes that are not paused (used).", []string{"resource", "kind"}, func() []metrics.Gauge {
		l := mgr.Load()
		out := []metrics.Gauge{{Labels: []string{"memory_bytes", "used"}, Value: float64(l.UsedMemory)}, {Labels: []string{"millicpu", "used"}, Value: float64(l.UsedMilliCPU)}}
		if l.Memory > 0 {
			out = append(out, metrics.Gauge{Labels: []string{"memory_bytes", "admitted"}, Value: float64(l.Memory)})
		}
		if l.MilliCPU > 0 {
			out = append(out, metrics.Gauge{Labels: []string{"millicpu", "admitted"}, Value: float64(l.MilliCPU)})
		}
		if total, avail, cpus, err := node.HostCapacity(); err == nil {
			out = append(out, metrics.Gauge{Labels: []string{"memory_bytes", "host"}, Value: float64(total)},
				metrics.Gauge{Labels: []string{"memory_bytes", "available"}, Value: float64(avail)},
				metrics.Gauge{Labels: []string{"millicpu", "host"}, Value: float64(cpus * 1000)})
		}
		return out
	})
	mt.Gauges("shoal_node_oversubscription", "The limits of the node's sandboxes that are not paused over the host's capacity, by resource (cpu, memory): above 1, oversubscribed.", []string{"resource"}, func() []metrics.Gauge {
		total, _, cpus, err := node.HostCapacity()
		if err != nil || total <= 0 || cpus <= 0 {
			return nil
		}
		l := mgr.Load()
		return []metrics.Gauge{{Labels: []string{"memory"}, Value: float64(l.UsedMemory) / float64(total)},
			{Labels: []string{"cpu"}, Value: float64(l.UsedMilliCPU) / float64(cpus*1000)}}
	})
	mt.Gauges("shoal_host_swap_bytes", "The host's swap, where a pause pages sandboxes' anonymous memory out (zram if serve set it up): total and free. 0 total: pauses reclaim file pages only.", []string{"kind"}, func() []metrics.Gauge {
		total, free, err := reclaim.HostSwap()
		if err != nil {
			return nil
		}
		return []metrics.Gauge{{Labels: []string{"total"}, Value: float64(total)}, {Labels: []string{"free"}, Value: float64(free)}}
	})
	mt.Gauges("shoal_pause_file_pages_only", "1 when the host has no swap: a pause reclaims file pages only, the anonymous memory of paused sandboxes stays resident (serve --zram-size); 0 when it goes to swap.", nil, func() []metrics.Gauge {
		v := 0.0
		if reclaim.FilePagesOnly() {
			v = 1
		}
		return []metrics.Gauge{{Value: v}}
	})
	mt.Gauges("shoal_pool_containers", "Warm pool containers of the container backend: ready, starting, target and max.", []string{"kind"}, func() []metrics.Gauge {
		st, ok := ctr.PoolStats()
		if !ok {
			return nil
		}
		return []metrics.Gauge{
			{Labels: []string{"ready"}, Value: float64(st.Ready)}, {Labels: []string{"starting"}, Value: float64(st.Starting)},
			{Labels: []string{"target"}, Value: float64(st.Target)}, {Labels: []string{"max"}, Value: float64(st.Max)},
		}
	})
	mt.Counters("shoal_pool_events_total", "Counts of the warm pool since serve started: claims (creates it served), misses (creates that found it empty), started and shrunk containers, and yields (the refill waiting for a burst of claims to pause).", []string{"event"}, func() []metrics.Gauge {
		st, ok := ctr.PoolStats()
		if !ok {
			return nil
		}
		return []metrics.Gauge{
			{Labels: []string{"claims"}, Value: float64(st.Claims)}, {Labels: []string{"misses"}, Value: float64(st.Misses)},
			{Labels: []string{"started"}, Value: float64(st.Started)}, {Labels: []string{"shrunk"}, Value: float64(st.Shrunk)},
			{Labels: []string{"yields"}, Value: float64(st.Yields)},
		}
	})
}

// setUpSwap sets up the zram swap that paused sandboxes' memory goes to
// (--zram-size), and says at start where a pause's anonymous memory goes:
// to swap, or nowhere (a pause then reclaims file pages only; inspect's
// pause record and /metrics say so too).
func setUpSwap(cfg serveConfig, log *slog.Logger) {
	var size int64
	switch cfg.ZramSize {
	case "auto":
		if total, _, err := reclaim.HostSwap(); err == nil && total > 0 {
			kind := "no zram"
			if act, _ := zram.Active(); len(act) > 0 {
				kind = "zram " + act[0].Name
			}
			log.Info("the host has swap: pauses page sandboxes' anonymous memory out to it", "swap", total, "kind", kind)
			return
		}
		mem, _, _, err := node.HostCapacity()
		if err != nil {
			log.Warn("no zram swap: pauses reclaim file pages only, not anonymous memory", "err", err)
			return
		}
		size = zram.AutoSize(mem)
	default:
		size, _ = parseBytes(cfg.ZramSize) // checked by Validate
	}
	if size <= 0 {
		if reclaim.FilePagesOnly() {
			log.Info("the host has no swap and --zram-size 0 leaves it so: pauses reclaim file pages only, not anonymous memory")
		}
		return
	}
	dev, err := zram.Ensure(size)
	switch {
	case err != nil:
		log.Warn("no zram swap: pauses reclaim file pages only, not anonymous memory", "err", err)
	case dev.Created:
		log.Info("zram swap set up for paused sandboxes (undo: swapoff /dev/"+dev.Name+"; echo "+strings.TrimPrefix(dev.Name, "zram")+" > /sys/class/zram-control/hot_remove; --zram-size 0 leaves the host alone)",
			"device", dev.Name, "size", dev.Size)
	default:
		log.Info("zram swap already active: kept", "device", dev.Name, "size", dev.Size)
	}
}

// The node tells the session layer each sandbox's log budget.
var _ session.LogBudgeter = (*node.Manager)(nil)
