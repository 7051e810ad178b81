// Package container is the sandbox backend that runs each sandbox as an OCI
// container through runc: namespaces (pid, mount, ipc, uts, cgroup, a
// private network namespace with loopback only) and cgroup v1/v2 limits,
// docker's capabilities, masked paths and seccomp profile (without the
// debugging system calls, seccomp.go), with the sandbox's layers composed by
// overlayfs and the guest agent as PID 1. The container's stdio is
// /dev/null and a pipe the node drains into a capped log (agentlog.go).
//
// A sandbox is created one of two ways:
//
//   - Cold: Create mounts the overlay root (layers + a private upper under
//     Spec.Dir) on the host, opens the agent's listening unix socket, writes
//     an OCI bundle and runs `runc run --detach`, handing the agent the
//     listening socket (fd 3), the node's precompiled seccomp filter
//     (fd 4, see seccomp.go) and a ready pipe (fd 5). Create returns once the
//     agent has installed the filter and is about to serve.
//   - Pooled (pool.go): a pre-started blank container, already in its own
//     namespaces and cgroups with its agent running, is claimed: the host
//     writes the sandbox's limits into its cgroups, composes the overlay as
//     a detached mount and passes its descriptor to the agent, which makes
//     it its root, drops CAP_SYS_ADMIN and installs the filter. A claim takes
//     a few milliseconds instead of a runc run; the pool refills in the
//     background. Create falls back on the cold path when the pool is empty
//     or a claim fails.
//
// Pool containers are started by `runc run`, or with Config.Launcher
// native by the node and the agent themselves, with the same isolation
// (native.go); then a create that finds the pool empty starts one and
// claims it instead of the cold path.
//
// There is no shim: once runc exits the container's init is reparented, so
// sandboxes keep running when the node process dies; Recover asks runc for
// the state of a container described by a persisted Handle. Delete SIGKILLs
// every task of the container's cgroup, waits for them to exit (pidfd),
// removes runc's state (runc delete only when that kill failed), unmounts
// the root and checks that no cgroup directory is left. It is idempotent.
// Freeze and Thaw (freeze.go) stop a sandbox's tasks in place with the
// cgroup freezer and let them go on (the node freezes a sandbox while it
// commits its writable layer).
//
// The runc container ID of a cold sandbox is the sandbox ID; a pooled
// sandbox keeps the ID its pool container was started with
// (Handle.Data["runc_id"]; its cgroups are <CgroupParent>/<runc_id>).
//
// A Backend is safe for concurrent use, and two calls for different
// sandboxes never contend (the pool has its own lock, held briefly). Calls
// for the same sandbox must be serialized by the caller (the node's sandbox
// manager).
package container

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/backend/container/seccompbpf"
	"github.com/shoal-sandbox/shoal/internal/diskimg"
	"github.com/shoal-sandbox/shoal/internal/egress"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/forkserver"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Name is the backend name, as stored in sandbox.Handle.Backend.
const Name = "container"

// Defaults for Config and for a zero sandbox.Resources.
const (
	DefaultRuntime      = "runc"
	DefaultStateDir     = "/run/shoal/runc"
	DefaultCgroupParent = "shoal"
	DefaultMemoryBytes  = 512 << 20
	DefaultPids         = 1024
	DefaultPoolSize     = 4
	DefaultPoolMax      = 32
	DefaultNofile       = 65536
)

// Paths inside Spec.Dir, and the agent's place in the container.
const (
	rootfsDir    = "rootfs"
	upperDir     = "upper"
	workDir      = "work"
	bundleDir    = "bundle"
	socketName   = "agent.sock"
	agentLogName = "agent.log"
	pidFileName  = "init.pid"
	agentPath    = "/.shoal/agent"
)

// Config configures a Backend. The zero value is usable.
type Config struct {
	// Runtime is the OCI runtime binary (a name looked up in PATH, or a
	// path); runc's command line is assumed. Default "runc".
	Runtime string
	// StateDir is the runtime's state directory (runc --root). Default
	// /run/shoal/runc. It must outlive the node process (not a temp dir
	// removed on exit) for Recover to work.
	StateDir string
	// CgroupParent is the cgroup under which every sandbox gets its own
	// "<CgroupParent>/<id>", taken from the root of every hierarchy (like
	// docker's --cgroup-parent), not from the node's own cgroup: a service
	// manager stopping the node must not kill its sandboxes. Default "shoal".
	CgroupParent string
	// PidsMax bounds the tasks of all sandboxes together: pids.max of
	// CgroupParent in the pids hierarchy (every sandbox's own pids limit
	// sits under it), so that fork bombs in many sandboxes at once leave
	// the host's pid_max and threads-max to the host. 0: not set.
	PidsMax int64
	// PoolSize is how many pre-started blank containers the backend keeps
	// ready for Create to claim (see pool.go). 0 means DefaultPoolSize; a
	// negative value disables the pool. The pool is filled from the first
	// Create on, in the background.
	PoolSize int
	// PoolMax is how large the pool may grow under demand (see pool.go):
	// each ready container costs about PoolMemberBytes. 0 means
	// DefaultPoolMax; never below PoolSize.
	PoolMax int
	// PoolDir holds the pool containers' bundles and agent sockets, and
	// those of the sandboxes made from them. Default: "pool" beside
	// StateDir. It must outlive the node process like StateDir, and belongs
	// to one Backend: New deletes the unclaimed pool containers it finds.
	PoolDir string
	// DiskDir, when set, holds the disk image templates (disk.go): a
	// sandbox whose Resources.DiskBytes is set gets a writable layer of
	// that size of its own. Empty: no disk limits (DiskBytes refused).
	DiskDir string
	// PremadeDisk: pool containers wait with a disk of this size made and
	// mounted (the node's default disk size), 0 for none.
	PremadeDisk int64
	// Nofile is the RLIMIT_NOFILE (soft and hard) of sandbox processes; 0
	// means DefaultNofile.
	Nofile uint64
	// Egress attaches the networks of sandboxes that ask for egress
	// (internal/egress, shared with the node's other backends); nil
	// disables egress: a create that asks for it fails with
	// ErrUnsupported.
	Egress *egress.Egress
	// RuncSeccomp makes runc compile and load docker's seccomp profile in
	// every container, as before the node compiled it once (seccomp.go).
	// It disables the pool. For comparison and as a way out.
	RuncSeccomp bool
	// UserNS runs every sandbox in a user namespace of its own, mapped to
	// an unprivileged host range (userns.go): UserNSAuto (the default: on
	// when the kernel supports idmapped layers), UserNSOn or UserNSOff.
	UserNS string
	// UserNSBase is the first host id of the sandboxes' ranges (65536 ids
	// each); default DefaultUserNSBase.
	UserNSBase uint32
	// UserNSDir holds the files that reserve ranges, shared by every node
	// of the host; default DefaultUserNSDir.
	UserNSDir string
	// ResumePrefetch: Resume asks the kernel to read a paused sandbox's
	// swapped-out pages back (process_madvise MADV_WILLNEED) before it
	// thaws it. Off by default: measured slower (see README, Pause).
	ResumePrefetch bool
	// Launcher starts pool containers: LauncherRunc (the default, `runc
	// run`) or LauncherNative (native.go: the agent sets its container up
	// itself; a create that finds the pool empty starts one and claims it
	// instead of running runc). Native needs the pool and the compiled
	// seccomp filter; without them runc is used.
	Launcher string
	// Log receives the backend's logs; nil discards them.
	Log *slog.Logger
}

// Validate checks the configuration without touching the system.
func (c Config) Validate() error {
	if c.StateDir != "" && !filepath.IsAbs(c.StateDir) {
		return fmt.Errorf("container backend: state dir %q must be an absolute path", c.StateDir)
	}
	if c.PoolDir != "" && !filepath.IsAbs(c.PoolDir) {
		return fmt.Errorf("container backend: pool dir %q must be an absolute path", c.PoolDir)
	}
	switch c.UserNS {
	case "", UserNSAuto, UserNSOn, UserNSOff:
	default:
		return fmt.Errorf("container backend: user namespaces %q: want auto, on or off", c.UserNS)
	}
	switch c.Launcher {
	case "", LauncherRunc, LauncherNative:
	default:
		return fmt.Errorf("container backend: launcher %q: want runc or native", c.Launcher)
	}
	if c.UserNSDir != "" && !filepath.IsAbs(c.UserNSDir) {
		return fmt.Errorf("container backend: user namespace dir %q must be an absolute path", c.UserNSDir)
	}
	p := strings.Trim(c.CgroupParent, "/")
	for _, part := range strings.Split(p, "/") {
		if part == "." || part == ".." {
			return fmt.Errorf("container backend: cgroup parent %q has a \".\" or \"..\" element", c.CgroupParent)
		}
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Runtime == "" {
		c.Runtime = DefaultRuntime
	}
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir
	}
	if strings.Trim(c.CgroupParent, "/") == "" {
		c.CgroupParent = DefaultCgroupParent
	}
	c.CgroupParent = strings.Trim(filepath.Clean("/"+c.CgroupParent), "/")
	if c.PoolDir == "" {
		c.PoolDir = filepath.Join(filepath.Dir(c.StateDir), "pool")
	}
	if c.PoolSize == 0 {
		c.PoolSize = DefaultPoolSize
	}
	if c.PoolMax == 0 {
		c.PoolMax = DefaultPoolMax
	}
	if c.Nofile == 0 {
		c.Nofile = DefaultNofile
	}
	if c.RuncSeccomp {
		c.PoolSize = -1
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.UserNS == "" {
		c.UserNS = UserNSAuto
	}
	if c.UserNSBase == 0 {
		c.UserNSBase = DefaultUserNSBase
	}
	if c.UserNSDir == "" {
		c.UserNSDir = DefaultUserNSDir
	}
	return c
}

// Backend runs sandboxes as runc containers. Create one with New.
type Backend struct {
	// reclaimSlot (capacity 1) is held by the one pause that reclaims
	// memory at a time (pause.go).
	reclaimSlot  chan struct{}
	runtime      string // absolute path of the runtime binary
	stateDir     string
	cgroupParent string // relative to each hierarchy's root, no leading or trailing slash
	coreSched    bool   // latency-sensitive sandboxes get a core scheduling cookie (coresched.go)
	poolDir      string
	prefetch     bool // Config.ResumePrefetch
	log          *slog.Logger
	// releaseFreezer thaws and removes the frozen group held for the
	// backend's life (holdFreezer).
	releaseFreezer func()

	// filter is a sealed memfd holding the compiled seccomp program that
	// every agent installs (seccomp.go); nil when runc loads the profile.
	filter     *os.File
	filterProg seccompbpf.Program
	pool       *pool // nil when disabled
	// lifeline is the read end of a pipe whose write end (lifelineW) only
	// this process holds: pool containers get it, and their agent exits
	// when it reads EOF before a claim, so that no pool container outlives
	// the node (agent.EnvLifeline). Nil without a pool.
	lifeline, lifelineW *os.File

	// egress attaches sandboxes' networks (network.go); nil when disabled.
	egress *egress.Egress
	// userns allocates the sandboxes' id ranges (userns.go); nil when
	// sandboxes run without a user namespace.
	userns *usernsSlots
	// searchable: directories known to let others search them (traversable).
	searchable sync.Map

	// drains are the agent log drains running in this process (agentlog.go).
	drains drains
	// forks start the native launcher's agents and the helpers of new user
	// namespace slots (forkserver: the node never forks without vfork),
	// one server per agent binary; guarded by forksMu.
	forksMu sync.Mutex
	forks   map[string]*forkserver.Client
	// agents: the private copies of agent binaries that sandboxes bind
	// (agentcopy.go).
	agents *agentCopies

	cgroupOnce sync.Once
	cgroups    []cgroupMount // set once by cgroupOnce, read-only after; see cgroupMounts
	cgroupsErr error

	// runtimeCopy is a sealed memfd copy of the runtime binary, or nil.
	// runc (1.1) copies its own 10 MiB binary into a new sealed memfd in
	// every `runc run` and `runc init` (its defence against CVE-2019-5736,
	// a container overwriting the host's runc through /proc/self/exe),
	// unless it already runs from a sealed memfd: executing it from this
	// copy saves that (~3-4 ms of CPU per container) with the same
	// protection. An upgrade of the runtime on disk takes effect at the
	// next start of the node.
	runtimeCopy *os.File

	disks    *diskimg.Maker // nil: no disk limits (disk.go)
	diskMode string         // how disks are limited, or why not
	// premadeDisk: the size of the disks pool containers wait with.
	premadeDisk int64
	nofile      uint64 // RLIMIT_NOFILE of sandbox processes
	// native: pool containers are started by the native launcher
	// (native.go); only with a pool.
	native bool
}

// The backend contract and the optional abilities this backend has.
var (
	_ sandbox.Backend     = (*Backend)(nil)
	_ sandbox.Closer      = (*Backend)(nil)
	_ sandbox.Prober      = (*Backend)(nil)
	_ sandbox.Freezer     = (*Backend)(nil)
	_ sandbox.DiskLimiter = (*Backend)(nil)
	_ sandbox.Pauser      = (*Backend)(nil)
	_ sandbox.UsageReader = (*Backend)(nil)
)

var (
	_ sandbox.Backend = (*Backend)(nil)
	_ sandbox.Closer  = (*Backend)(nil)
)

// New checks that the runtime answers `--version`, creates the state and
// pool directories, compiles the seccomp filter, deletes the pool
// containers a previous process left unclaimed and returns a Backend.
func New(cfg Config) (*Backend, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	bin, err := exec.LookPath(cfg.Runtime)
	if err != nil {
		return nil, fmt.Errorf("container backend: find runtime %q: %w", cfg.Runtime, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "--version").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("container backend: %s --version: %w: %s", bin, err, bytes.TrimSpace(out))
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("container backend: create state dir: %w", err)
	}
	b := &Backend{reclaimSlot: make(chan struct{}, 1), runtime: bin, stateDir: cfg.StateDir, cgroupParent: cfg.CgroupParent, poolDir: cfg.PoolDir, prefetch: cfg.ResumePrefetch, log: cfg.Log, nofile: cfg.Nofile, premadeDisk: cfg.PremadeDisk}
	// Beside the state directory, not below it: a private fork server
	// sheds the mounts below that one.
	if b.agents, err = mountAgentCopies(filepath.Clean(cfg.StateDir) + ".agent"); err != nil {
		return nil, fmt.Errorf("container backend: %w", err)
	}
	if data, err := os.ReadFile(bin); err != nil {
		cfg.Log.Warn("container backend: read runtime binary", "err", err)
	} else if f, err := sealedFile(filepath.Base(bin), data); err != nil {
		cfg.Log.Warn("container backend: sealed copy of the runtime", "err", err)
	} else {
		b.runtimeCopy = f
		// Executing a memfd may be forbidden (vm.memfd_noexec).
		if out, err := b.runc(ctx, "--version").CombinedOutput(); err != nil {
			cfg.Log.Warn("container backend: cannot run the runtime from a sealed copy", "err", err, "output", string(bytes.TrimSpace(out)))
			b.runtimeCopy = nil
			f.Close()
		}
	}
	if !cfg.RuncSeccomp {
		prog, f, err := compileDockerFilter()
		if err != nil {
			// Still docker's profile, loaded by runc: slower, as safe.
			cfg.Log.Warn("container backend: runc will load the seccomp profile of every container", "err", err)
		} else {
			b.filter, b.filterProg = f, prog
		}
	}
	if cfg.UserNS != UserNSOff {
		u, err := newUsernsSlots(cfg.UserNSBase, cfg.UserNSDir, cfg.StateDir)
		if err == nil {
			err = u.probe(cfg.StateDir)
		}
		if err == nil {
			err = u.load()
		}
		switch {
		case err == nil:
			b.userns = u
		case cfg.UserNS == UserNSOn:
			return nil, fmt.Errorf("container backend: user namespaces: %w", err)
		default:
			cfg.Log.Warn("container backend: sandboxes run without user namespaces (sandbox root is host root)", "err", err)
		}
	}
	if b.releaseFreezer, err = b.holdFreezer(); err != nil {
		cfg.Log.Warn("container backend: no frozen group held: a lone sandbox's pause and resume pay the kernel's freezer switch", "err", err)
	}
	if err := b.sweepPool(ctx); err != nil {
		// What is left is an orphan of an earlier process, not a reason
		// to stay down: the next start sweeps again.
		cfg.Log.Error("container backend: pool containers left by an earlier process could not all be deleted", "err", err)
	}
	b.initDisks(ctx, cfg.DiskDir)
	if cfg.PidsMax > 0 {
		if err := b.setParentPidsMax(cfg.PidsMax); err != nil {
			cfg.Log.Error("container backend: node-wide pids limit NOT set: fork bombs in many sandboxes at once could exhaust the host's tasks", "pids_max", cfg.PidsMax, "err", err)
		} else {
			cfg.Log.Info("container backend: node-wide pids limit", "cgroup", cfg.CgroupParent, "pids_max", cfg.PidsMax)
		}
	}
	if ok, why := probeCoreSched(); ok {
		b.coreSched = true
		cfg.Log.Info("container backend: core scheduling: each latency-sensitive sandbox gets a core of its own while it runs")
	} else {
		cfg.Log.Info("container backend: no core scheduling for latency-sensitive sandboxes", "why", why)
	}
	b.egress = cfg.Egress
	if b.userns != nil {
		b.userns.prune(b.known)
	}
	switch {
	case cfg.PoolSize < 0:
	case b.filter == nil:
		cfg.Log.Warn("container backend: no pool without the compiled seccomp filter")
	case len(b.memberSocket(poolPrefix+strings.Repeat("x", 16))) > maxSocketPath:
		cfg.Log.Warn("container backend: no pool: pool dir too long for unix socket paths", "pool_dir", cfg.PoolDir)
	default:
		r, w, err := os.Pipe() // both close-on-exec: no child holds the write end
		if err != nil {
			return nil, fmt.Errorf("container backend: lifeline pipe: %w", err)
		}
		b.lifeline, b.lifelineW = r, w
		b.pool = newPool(b, cfg.PoolSize, max(cfg.PoolMax, cfg.PoolSize))
		b.native = cfg.Launcher == LauncherNative
	}
	if cfg.Launcher == LauncherNative && !b.native {
		cfg.Log.Warn("container backend: the native launcher needs the pool and the compiled seccomp filter: using runc")
	}
	version, _, _ := strings.Cut(string(out), "\n")
	cfg.Log.Debug("container backend ready", "runtime", bin, "version", version, "state_dir", cfg.StateDir,
		"seccomp", map[bool]string{true: "compiled once", false: "runc"}[b.filter != nil], "pool", cfg.PoolSize,
		"userns", b.userns != nil, "launcher", map[bool]string{true: LauncherNative, false: LauncherRunc}[b.native])
	return b, nil
}

// Close stops refilling the pool and deletes the pool containers not yet
// claimed. Sandboxes keep running. Create must not be called afterwards.
func (b *Backend) Close(ctx context.Context) error {
	var errs []error
	if b.pool != nil {
		errs = append(errs, b.pool.close(ctx))
	}
	if b.userns != nil {
		b.userns.close()
	}
	b.forksMu.Lock()
	for _, f := range b.forks {
		f.Close()
	}
	b.forksMu.Unlock()
	if b.releaseFreezer != nil {
		b.releaseFreezer()
	}
	b.agents.close()
	return errors.Join(errs...)
}

// UserNS reports whether sandboxes run in user namespaces of their own.
func (b *Backend) UserNS() bool { return b.userns != nil }

// Name returns "container".
func (b *Backend) Name() string { return Name }

// Capabilities: layers must be mounted on the host (they become overlay lowers).
func (b *Backend) Capabilities() sandbox.Capabilities {
	return sandbox.Capabilities{HostLayerMounts: true}
}

// runc's container IDs are [\w+-.]+; we also require a leading alphanumeric
// so that an ID is never "." or ".." in a path.
var validID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$`)

func checkID(id string) error {
	if !validID.MatchString(id) {
		return fmt.Errorf("container backend: invalid sandbox id %q (want 1-128 of [A-Za-z0-9_.+-], starting alphanumeric)", id)
	}
	return nil
}

func checkSpec(spec sandbox.Spec) error {
	if err := checkID(spec.ID); err != nil {
		return err
	}
	if spec.Dir == "" {
		return errors.New("container backend: spec has no state dir")
	}
	if len(spec.Layers) == 0 {
		return errors.New("container backend: spec has no layers")
	}
	for i, l := range spec.Layers {
		if l.MountPath == "" {
			return fmt.Errorf("container backend: layer %d (%s) is not mounted on the host", i, l.Digest)
		}
		if !filepath.IsAbs(l.MountPath) {
			return fmt.Errorf("container backend: layer %d mount path %q is not absolute", i, l.MountPath)
		}
		if strings.ContainsAny(l.MountPath, ",:\x00") {
			// Not needed with lowerdir+, but such paths break every other tool.
			return fmt.Errorf("container backend: layer %d mount path %q contains ',' or ':'", i, l.MountPath)
		}
	}
	if spec.AgentBinary == "" {
		return errors.New("container backend: spec has no agent binary")
	}
	for _, kv := range spec.Env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" || strings.ContainsRune(kv, 0) {
			return fmt.Errorf("container backend: env entry %q is not KEY=value", kv)
		}
	}
	return nil
}

// Create starts a sandbox; see the package comment. On failure every step
// already done is undone, in reverse order. ctx bounds only the creation;
// without a deadline sandbox.DefaultStartTimeout applies.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (h sandbox.Handle, err error) {
	if err := checkSpec(spec); err != nil {
		return h, err
	}
	if spec.Network.Egress() && b.egress == nil {
		return h, fmt.Errorf("container backend: network egress is disabled on this node (serve --egress-subnet): %w%.0w", sandbox.ErrUnsupported, errdefs.ErrFailedPrecondition)
	}
	h, err = b.create(ctx, spec)
	if err != nil || !spec.Network.Egress() {
		return h, err
	}
	data, err := b.attachEgress(spec.ID, h.Data["runc_id"], spec.Network)
	if err != nil {
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if derr := b.Delete(dctx, h); derr != nil {
			b.log.Error("undo failed create", "sandbox_id", spec.ID, "err", derr)
		}
		return sandbox.Handle{}, fmt.Errorf("create sandbox %s: network egress: %w", spec.ID, err)
	}
	for k, v := range data {
		h.Data[k] = v
	}
	return h, nil
}

// create is Create without the network.
func (b *Backend) create(ctx context.Context, spec sandbox.Spec) (h sandbox.Handle, err error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, sandbox.DefaultStartTimeout)
		defer cancel()
	}
	start := time.Now()
	defer func() {
		// Out of time (its steps report only "signal: killed" or a
		// context error): say so, as retryable, since a busy host
		// is the likely cause.
		if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) && !errors.Is(err, errdefs.ErrUnavailable) {
			err = fmt.Errorf("%w (the create ran out of time after %s: is the host overloaded?)%.0w", err, time.Since(start).Round(time.Millisecond), errdefs.ErrUnavailable)
		}
	}()
	dir, err := filepath.Abs(spec.Dir)
	if err != nil {
		return h, fmt.Errorf("container backend: %w", err)
	}
	// Refuse before doing anything that the undo steps would tear down: an
	// existing sandbox of that ID or that root must survive a repeated Create.
	if b.hasState(spec.ID) || exists(b.claimedDir(spec.ID)) {
		return h, fmt.Errorf("create sandbox %s: a container with this id exists", spec.ID)
	}
	rootfs := filepath.Join(dir, rootfsDir)
	if mounted, err := isOverlayMount(rootfs); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	} else if mounted {
		return h, fmt.Errorf("create sandbox %s: %s is already mounted", spec.ID, rootfs)
	}
	if exists(filepath.Join(dir, upperDir)) || exists(filepath.Join(dir, diskImageName)) {
		return h, fmt.Errorf("create sandbox %s: %s has a writable layer already", spec.ID, dir)
	}
	// From the pool: a member that fails its claim (or does not answer it
	// within claimTimeout) is destroyed and the next one is tried, up to
	// maxClaimTries; then the cold path.
	for try := 0; b.pool != nil && try < maxClaimTries; try++ {
		m := b.pool.take(spec.AgentBinary)
		if m == nil {
			break
		}
		h, err := b.claim(ctx, spec, dir, m)
		if err == nil {
			return h, nil
		}
		if ctx.Err() != nil {
			return h, err
		}
		b.log.Warn("claim of a pool container failed; trying another", "sandbox_id", spec.ID, "runc_id", m.id, "try", try+1, "err", err)
	}
	if b.native {
		// No runc: a pool container made now, claimed at once.
		m, err := b.startMember(ctx, spec.AgentBinary, true)
		if err != nil {
			return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
		h, err = b.claim(ctx, spec, dir, m)
		if err == nil {
			h.Data["pooled"] = "false" // started for this create: not from the warm pool
		}
		return h, err
	}
	return b.createCold(ctx, spec, dir)
}

// createCold creates a sandbox with its own `runc run` around its root.
func (b *Backend) createCold(ctx context.Context, spec sandbox.Spec, dir string) (h sandbox.Handle, err error) {
	log := b.log.With("sandbox_id", spec.ID)
	start := time.Now()
	var undo undoStack
	defer func() {
		if err != nil {
			undo.run(log)
		}
	}()

	rootfs := filepath.Join(dir, rootfsDir)
	bundle := filepath.Join(dir, bundleDir)
	upper, work, err := b.writableLayer(ctx, spec, dir, "", &undo)
	if err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	for _, d := range []string{rootfs, upper, work, bundle} {
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
	}

	// 0. Its user namespace's range, with the upper given to its root.
	idmap, nsfd, err := b.usernsFor(spec.ID, spec.AgentBinary, &undo)
	if err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	if idmap != nil {
		if err := chownToRoot(upper, idmap); err != nil {
			return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
		if err := ensureTmpUpper(lowerDirs(spec), upper, idmap); err != nil {
			return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
		if err := b.traversable(rootfs); err != nil {
			return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
	}

	// 1. The root: overlay of the layers and the private upper.
	if err := layer.ComposeMapped(rootfs, lowerDirs(spec), nsfd, upper, work, true); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	undo.push("unmount rootfs", func() error { return layer.Unmount(rootfs) })
	if err := ensureTmp(rootfs); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}

	// 2. The agent's socket, listening before the agent exists.
	sock := filepath.Join(dir, socketName)
	lnFile, err := listenAgent(sock)
	if err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	defer lnFile.Close() // the host's copy; the agent keeps its own
	undo.push("remove agent socket", func() error { return removeIfExists(sock) })

	// 3. The OCI bundle.
	cfg, err := b.ociSpec(spec, rootfs, idmap)
	if err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	if err := writeJSON(filepath.Join(bundle, "config.json"), cfg); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}

	// 4. runc run --detach, then wait for the agent.
	// runc may leave a half-created container behind when it fails or is
	// killed: undo by the same path as Delete, with its own time budget.
	undo.push("destroy container", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return b.destroy(ctx, spec.ID)
	})
	if err := b.startContainer(ctx, spec.ID, bundle, dir, lnFile, false, 0); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	if spec.Resources.BestEffort {
		// Its commands run under SCHED_IDLE ($SHOAL_BEST_EFFORT, oci.go).
		if err := b.makeIdle(spec.ID, spec.Resources); err != nil {
			return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
	}
	if _, _, err := b.placeAgent(spec.ID, filepath.Join(dir, pidFileName), spec.Resources.BestEffort); err != nil {
		return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	if !spec.Resources.BestEffort && b.coreSched {
		if err := setCoreCookie(filepath.Join(dir, pidFileName)); err != nil {
			return h, fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
	}

	log.Debug("sandbox created cold", "rootfs", rootfs, "took", time.Since(start))
	return sandbox.Handle{
		ID:          spec.ID,
		Backend:     Name,
		AgentSocket: sock,
		Data:        handleData(map[string]string{"rootfs": rootfs, "bundle": bundle, "dir": dir, "runc_id": spec.ID}, spec, upper),
		IDMap:       idmap,
	}, nil
}

// usernsFor reserves the id range of the container runcID (undone by
// undo, and by destroy) and returns it with a user namespace of its
// mapping, or nil and -1 without user namespaces. A new namespace is made
// through agentBinary's fork server.
func (b *Backend) usernsFor(runcID, agentBinary string, undo *undoStack) (*sandbox.IDMap, int, error) {
	if b.userns == nil {
		return nil, -1, nil
	}
	slot, err := b.userns.alloc(runcID)
	if err != nil {
		return nil, -1, err
	}
	undo.push("release id range", func() error { b.userns.release(runcID); return nil })
	var starter *forkserver.Client
	if agentBinary != "" {
		starter = b.forkServer(agentBinary)
	}
	fd, err := b.userns.nsFD(slot, starter)
	if err != nil {
		return nil, -1, err
	}
	m := b.userns.idmap(slot)
	return &m, fd, nil
}

// lowerDirs are the overlay's lower directories, top first.
func lowerDirs(spec sandbox.Spec) []string {
	lowers := make([]string, len(spec.Layers))
	for i, l := range spec.Layers {
		lowers[i] = l.MountPath
	}
	return lowers
}

// agentFiles are the descriptors a container's agent gets from fd 3 on,
// whichever launcher starts it: its listening socket, the seccomp filter
// (fd 4, if any), the ready pipe (b.readyFD()) and, for a pool container,
// the node's lifeline (b.readyFD()+1, if any).
func (b *Backend) agentFiles(ln, ready *os.File, pooled bool) []*os.File {
	extra := []*os.File{ln} // fd 3
	if b.filter != nil {
		extra = append(extra, b.filter) // fd 4
	}
	extra = append(extra, ready) // b.readyFD()
	if pooled && b.lifeline != nil {
		extra = append(extra, b.lifeline) // b.readyFD()+1
	}
	return extra
}

// startContainer runs `runc run --detach` for the bundle and waits until the
// agent is ready (it has installed its seccomp filter, if any, and serves).
// The container's stdio is runc's: /dev/null, /dev/null and a pipe that the
// node drains into dir/agent.log, within a cap (agentlog.go). The caller
// destroys the container if this fails.
//
// A pool container (pooled) is started at the lowest CPU priority (nice 19,
// see startMember) and gets the read end of the node's lifeline.
//
// nice is runc's nice value (and so the agent's until prioritizeAgent).
func (b *Backend) startContainer(ctx context.Context, runcID, bundle, dir string, ln *os.File, pooled bool, nice int) error {
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer devNull.Close()
	logPath := filepath.Join(dir, agentLogName)
	var logStart int64
	if fi, err := os.Stat(logPath); err == nil {
		logStart = fi.Size()
	}
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("ready pipe: %w", err)
	}
	defer readyR.Close()
	logR, logW, err := os.Pipe()
	if err != nil {
		readyW.Close()
		return fmt.Errorf("log pipe: %w", err)
	}
	drain, err := drainAgentLog(logR, logPath)
	if err != nil {
		readyW.Close()
		logW.Close()
		return fmt.Errorf("agent log: %w", err)
	}
	b.drains.add(runcID, drain)
	extra := b.agentFiles(ln, readyW, pooled)
	cmd := b.runcWith(ctx, extra, "run", "--detach", "--bundle", bundle, "--preserve-fds", strconv.Itoa(len(extra)),
		"--pid-file", filepath.Join(dir, pidFileName), runcID)
	cmd.Stdin = devNull
	cmd.Stdout = devNull
	cmd.Stderr = logW
	if nice != 0 {
		err = forkserver.StartNiced(cmd, nice)
	} else {
		err = cmd.Start()
	}
	logW.Close() // now only runc, and the container, hold it
	if err == nil {
		err = cmd.Wait()
	}
	readyW.Close() // now only the agent holds it: EOF if it dies
	if err != nil {
		// runc is done writing; wait (briefly) for the drain to copy it.
		drain.settle(time.Second)
		return fmt.Errorf("runc run: %w: %s", err, tail(logPath, logStart))
	}
	if err := waitReady(ctx, readyR); err != nil {
		drain.settle(time.Second)
		return fmt.Errorf("agent: %w: %s", err, tail(logPath, logStart))
	}
	return nil
}

// waitReady reads the agent's ready line: "ok", or "error: why".
func waitReady(ctx context.Context, r *os.File) error {
	if dl, ok := ctx.Deadline(); ok {
		r.SetReadDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { r.SetReadDeadline(time.Now()) })
	defer stop()
	var line []byte
	buf := make([]byte, 512)
	for len(line) < 4096 {
		n, err := r.Read(buf)
		line = append(line, buf[:n]...)
		if i := bytes.IndexByte(line, '\n'); i >= 0 {
			line = line[:i]
			break
		}
		if err == io.EOF {
			return errors.New("exited before it was ready")
		}
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("not ready: %w", ctx.Err())
			}
			return fmt.Errorf("not ready: %w", err)
		}
	}
	switch msg := string(line); {
	case msg == "ok":
		return nil
	case strings.HasPrefix(msg, "error: "):
		return errors.New(strings.TrimPrefix(msg, "error: "))
	default:
		return fmt.Errorf("unexpected ready message %q", msg)
	}
}

// runcID returns the runtime's container ID for a handle, which may be a
// provisional one (ID and dir only) left by a create that was interrupted.
func (b *Backend) runcID(h sandbox.Handle) (string, error) {
	id := h.Data["runc_id"]
	if id == "" {
		// A claim renames the pool container's dir to the sandbox's ID
		// before anything else: it tells which container it got.
		if data, err := os.ReadFile(filepath.Join(b.claimedDir(h.ID), runcIDFile)); err == nil {
			id = strings.TrimSpace(string(data))
		} else {
			id = h.ID
		}
	}
	if err := checkID(id); err != nil {
		return "", err
	}
	return id, nil
}

// Recover reports whether the container of h still runs: StatusRunning
// (running or paused), StatusStopped (its init is gone, it never started, or
// the overlay root of a cold sandbox is no longer mounted on the host), or
// sandbox.ErrNotFound when the runtime has no such container.
func (b *Backend) Recover(ctx context.Context, h sandbox.Handle) (sandbox.Status, error) {
	if err := checkID(h.ID); err != nil {
		return "", err
	}
	id, err := b.runcID(h)
	if err != nil {
		return "", err
	}
	if b.isNative(id) {
		alive, err := b.nativeAlive(id)
		if err != nil {
			return "", fmt.Errorf("recover sandbox %s: %w", h.ID, err)
		}
		if !alive {
			return sandbox.StatusStopped, nil
		}
		return b.recoverRunning(h, id)
	}
	if !b.hasState(id) {
		return "", fmt.Errorf("recover sandbox %s: %w", h.ID, sandbox.ErrNotFound)
	}
	// What `runc state` says, without running it (a process per sandbox:
	// 0.1-0.5 s each on a loaded host, minutes for thousands): its init
	// runs (Alive: the pid with the start time runc recorded) and was
	// started (no exec.fifo: runc's "created" waits on it). Running or
	// frozen (runc's "paused") are both running here.
	alive, err := b.Alive(h)
	if err != nil {
		return "", fmt.Errorf("recover sandbox %s: %w", h.ID, err)
	}
	if !alive || exists(filepath.Join(b.stateDir, id, "exec.fifo")) {
		return sandbox.StatusStopped, nil
	}
	if rootfs := h.Data["rootfs"]; rootfs != "" {
		mounted, err := isOverlayMount(rootfs)
		if err != nil {
			return "", fmt.Errorf("recover sandbox %s: %w", h.ID, err)
		}
		if !mounted {
			b.log.Warn("sandbox runs but its root is not mounted on the host", "sandbox_id", h.ID, "rootfs", rootfs)
			return sandbox.StatusStopped, nil
		}
	}
	return b.recoverRunning(h, id)
}

// recoverRunning re-attaches the network and the agent's log of a running
// sandbox.
func (b *Backend) recoverRunning(h sandbox.Handle, id string) (sandbox.Status, error) {
	if b.egress != nil {
		if err := b.egress.Recover(h.ID, h.Data); err != nil {
			return "", fmt.Errorf("recover sandbox %s: network egress: %w", h.ID, err)
		}
	} else if egress.Has(h.Data) {
		return "", fmt.Errorf("recover sandbox %s: it has network egress, which is disabled on this node (serve --egress-subnet)", h.ID)
	}
	if err := b.reattachLog(h, id); err != nil {
		b.log.Warn("the agent's log is not collected", "sandbox_id", h.ID, "err", err)
	}
	return sandbox.StatusRunning, nil
}

// Delete kills the sandbox's processes and removes its container, root
// mount, cgroups and socket. A sandbox that is already (partly) gone is not
// an error. ctx bounds the wait for the processes to exit.
func (b *Backend) Delete(ctx context.Context, h sandbox.Handle) error {
	if err := checkID(h.ID); err != nil {
		return err
	}
	id, err := b.runcID(h)
	if err != nil {
		return err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, sandbox.DefaultStartTimeout)
		defer cancel()
	}
	var errs []error
	if b.egress != nil {
		if err := b.egress.Detach(h.ID, h.Data); err != nil {
			errs = append(errs, err)
		}
	}
	if err := b.destroy(ctx, id); err != nil {
		errs = append(errs, err)
	} else if b.userns != nil {
		b.userns.releaseRange(id, h.IDMap)
	}
	rootfs := h.Data["rootfs"]
	if rootfs == "" && h.Data["dir"] != "" {
		rootfs = filepath.Join(h.Data["dir"], rootfsDir)
	}
	if rootfs != "" {
		if err := layer.Unmount(rootfs); err != nil {
			errs = append(errs, err)
		}
	}
	if dir := h.Data["dir"]; dir != "" {
		if err := removeDisk(dir); err != nil {
			errs = append(errs, err)
		}
	}
	if err := removeDisk(b.claimedDir(h.ID)); err != nil { // a disk a pool container brought
		errs = append(errs, err)
	}
	if h.AgentSocket != "" {
		if err := removeIfExists(h.AgentSocket); err != nil {
			errs = append(errs, err)
		}
	}
	// A pooled sandbox's container dir (socket, log) and bundle.
	if len(errs) == 0 {
		paths := []string{b.claimedDir(h.ID)}
		if strings.HasPrefix(id, poolPrefix) {
			paths = append(paths, b.memberBundle(id))
		}
		for _, p := range paths {
			if err := os.RemoveAll(p); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("delete sandbox %s: %w", h.ID, err)
	}
	b.log.Debug("sandbox deleted", "sandbox_id", h.ID, "runc_id", id)
	return nil
}

// destroy kills the container's tasks, deletes its runtime state and checks
// its cgroups are gone.
func (b *Backend) destroy(ctx context.Context, id string) error {
	killErr := b.killCgroup(ctx, id)
	if killErr != nil {
		// Fall back on the runtime, which freezes, signals and waits itself.
		b.log.Warn("kill via cgroup", "sandbox_id", id, "err", killErr)
	}
	if killErr != nil && b.hasState(id) {
		var stderr bytes.Buffer
		cmd := b.runc(ctx, "delete", "--force", id)
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil && b.hasState(id) {
			return fmt.Errorf("runc delete: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
		}
	} else if err := os.RemoveAll(filepath.Join(b.stateDir, id)); err != nil {
		// No task of the container is left: all `runc delete` would do is
		// remove the cgroups (below) and this directory (our specs have no
		// poststop hooks), at the cost of starting runc, a third of a
		// rollout's CPU in a burst. A runc run killed before it wrote its
		// state leaves the directory too (an exec.fifo at most).
		return fmt.Errorf("remove runc state: %w", err)
	}
	if err := b.removeCgroups(id); err != nil {
		return err
	}
	if err := removeIfExists(b.nativeStatePath(id)); err != nil {
		return err
	}
	if b.userns != nil {
		// No task of the container is left: its range may serve another.
		b.userns.release(id)
	}
	return nil
}

// hasState reports whether the runtime has state for id.
func (b *Backend) hasState(id string) bool {
	_, err := os.Stat(filepath.Join(b.stateDir, id, "state.json"))
	return err == nil
}

// runc returns a runtime command in its own process group (a Ctrl-C of the
// node must not reach it, nor the container it starts) with no stdio of ours.
func (b *Backend) runc(ctx context.Context, args ...string) *exec.Cmd {
	return b.runcWith(ctx, nil, args...)
}

// runcWith is runc with extra files for the runtime (fd 3 on). The runtime
// binary is executed from the backend's sealed copy when there is one (see
// runtimeCopy).
func (b *Backend) runcWith(ctx context.Context, extra []*os.File, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, b.runtime, append([]string{"--root", b.stateDir}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.WaitDelay = 5 * time.Second
	cmd.ExtraFiles = extra
	if b.runtimeCopy != nil {
		// The copy goes last, past what --preserve-fds hands the container
		// (runc marks every later descriptor close-on-exec in its init).
		cmd.ExtraFiles = append(append([]*os.File(nil), extra...), b.runtimeCopy)
		cmd.Path = "/proc/self/fd/" + strconv.Itoa(3+len(extra))
		cmd.Args[0] = filepath.Base(b.runtime)
	}
	return cmd
}

// maxSocketPath is the longest path a unix socket can be bound to.
var maxSocketPath = len(unix.RawSockaddrUnix{}.Path) - 1

// listenAgent binds a listening unix socket at path and returns it as a file
// (for the agent); the listener itself is closed without unlinking the path.
func listenAgent(path string) (*os.File, error) {
	if len(path) > maxSocketPath {
		return nil, fmt.Errorf("agent socket path %s is longer than %d bytes: use a shorter sandbox dir", path, maxSocketPath)
	}
	if err := removeIfExists(path); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on agent socket: %w", err)
	}
	ln.SetUnlinkOnClose(false)
	f, err := ln.File()
	ln.Close()
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("listen on agent socket: %w", err)
	}
	return f, nil
}

// ensureTmp gives the root a world-writable /tmp in its upper layer when no
// layer has one.
func ensureTmp(rootfs string) error {
	p := filepath.Join(rootfs, "tmp")
	if _, err := os.Lstat(p); err == nil {
		return nil
	}
	if err := os.Mkdir(p, 0o755); err != nil {
		return fmt.Errorf("create /tmp: %w", err)
	}
	if err := os.Chmod(p, 0o777|os.ModeSticky); err != nil {
		return fmt.Errorf("create /tmp: %w", err)
	}
	return nil
}

func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "\t")
	if err != nil {
		return fmt.Errorf("encode %s: %w", filepath.Base(path), err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	return nil
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func removeAll(paths ...string) error {
	var errs []error
	for _, p := range paths {
		if err := os.RemoveAll(p); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// tail returns what was appended to the file at path since offset (at most
// 4 KiB of its end), for error messages.
func tail(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	const max = 4 << 10
	if fi.Size()-offset > max {
		offset = fi.Size() - max
	}
	b, _ := io.ReadAll(io.NewSectionReader(f, offset, fi.Size()-offset))
	return strings.TrimSpace(string(b))
}

// undoStack holds the undo steps of a creation.
type undoStack struct {
	steps []undoStep
}

type undoStep struct {
	what string
	fn   func() error
}

func (u *undoStack) push(what string, fn func() error) {
	u.steps = append(u.steps, undoStep{what, fn})
}

// run runs the steps in reverse order, logging (and skipping past) failures.
func (u *undoStack) run(log *slog.Logger) {
	for i := len(u.steps) - 1; i >= 0; i-- {
		if err := u.steps[i].fn(); err != nil {
			log.Error("undo failed create", "step", u.steps[i].what, "err", err)
		}
	}
	u.steps = nil
}
