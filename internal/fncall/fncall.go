// Package fncall is the FnCall backend: one-shot code execution judged like
// an online judge, served from warm pools of sandboxes.
//
// A call names a language (a layer stack plus compile and run command
// templates, see Language), gives source code, extra files and either one
// stdin or test cases with expected output. The engine takes a sandbox from
// the pool of the language's environment, writes the files into the
// sandbox's box, compiles once, runs each test, and judges each run:
//
//	OLE  stdout passed the output limit (the run is killed at once)
//	TLE  CPU time (cgroup cpuacct, all processes) over the limit, or the
//	     wall clock ran out
//	MLE  the kernel's OOM killer fired in the run's memory cgroup
//	RE   non-zero exit code or killed by a signal
//	WA   the output differs from the expected output (see Compare)
//	OK   none of the above
//	CE   the compile step failed (overall verdict)
//
// # Isolation unit
//
// The default (IsolationCgroup) reuses a pool sandbox for many calls, one
// call at a time, and gives every run its own cgroups (memory, cpuacct,
// pids) created by the host under the sandbox's cgroup, which the process
// is born in (internal/agent/fncall.go). Every process of a call runs as an
// unprivileged uid of its own (the sandbox's calls rotate through CallUIDs
// uids, and the sandbox's user namespace maps them to a host range no
// other sandbox has) that owns nothing but the call's box; the box, /tmp,
// /var/tmp and /run/lock are tmpfs mounts of the sandbox (counted in the
// writer's memory cgroup, so a call cannot fill a disk), and /dev/shm and
// /dev/mqueue are emptied between calls. After each run every process of
// the uid is killed (the run's cgroup is checked empty and removed); after
// each call the box and the shared writable places are emptied, and a
// sandbox in which anything could not be cleaned (System V IPC objects,
// processes that did not die) is deleted instead of reused. Sandboxes are
// also replaced after MaxUses calls. No network (the container backend's
// private network namespace), docker's seccomp profile and capabilities,
// no CAP_SYS_ADMIN: what one call can leave behind is what the reset
// removes.
//
// IsolationSandbox gives each call a sandbox of its own, created ahead of
// time (a pool per environment, refilled in the background) and deleted
// after the call: the strongest isolation, at the price of one sandbox
// creation and deletion per call (see the README's measured numbers).
//
// Pools are keyed by environment (the resolved layer digests) and
// isolation mode; each keeps Warm idle sandboxes ready while in use,
// refills in the background, and shrinks to MinIdle after IdleTimeout
// without calls. Pool sandboxes are ordinary container sandboxes of the
// node (metadata shoal.fncall=<env>), visible in `shoal ls`; the engine
// deletes those an earlier process left when it starts.
//
// Concurrency: at most MaxConcurrent calls run at once on the node (the
// rest wait in order); an Engine is safe for concurrent use.
package fncall

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/node"
)

// Isolation is the isolation unit of a call.
type Isolation int

const (
	IsolationDefault Isolation = iota // the engine's Config.Isolation
	IsolationCgroup                   // a reused pool sandbox, cgroups and a box per run
	IsolationSandbox                  // a sandbox of its own, deleted after the call
)

func (i Isolation) String() string {
	switch i {
	case IsolationCgroup:
		return "cgroup"
	case IsolationSandbox:
		return "sandbox"
	}
	return "default"
}

// Backend is the name under which the FnCall backend is known (a session
// create asking for it is told to use FnCallService).
const Backend = "fncall"

// MetadataKey marks the engine's pool sandboxes (value: the language).
const MetadataKey = "shoal.fncall"

// Config configures an Engine. Zero fields take the defaults.
type Config struct {
	Languages []Language // default DefaultLanguages()
	// MaxConcurrent is how many calls run at once on the node; 0 = one
	// per core (runs are CPU-bound: more would only slow each other).
	MaxConcurrent int
	// Warm is how many idle sandboxes each environment keeps ready while
	// it is in use (refilled in the background). 0 = 1 for cgroup
	// isolation, MaxConcurrent for sandbox isolation; < 0 = none.
	Warm int
	// MinIdle is how many idle sandboxes an environment keeps after
	// IdleTimeout without calls (default 0: shrink to nothing).
	MinIdle     int
	IdleTimeout time.Duration // default 60s
	MaxUses     int           // calls one sandbox serves before it is replaced; default 1000
	// DefaultLimits apply to a run whose call leaves a limit zero;
	// MaxLimits bound what a call may ask (a call over them is refused).
	DefaultLimits Limits
	MaxLimits     Limits
	// CompileLimits bound a compile step unless its language says.
	CompileLimits Limits
	// SandboxMemory is the memory limit of each pool sandbox (its cgroup,
	// above the runs'). Default: the largest run or compile memory + 512 MiB.
	SandboxMemory int64
	// UID and GID are the first of the calls' uids and gids (default
	// 10001): the k-th call of a sandbox runs as UID + k mod CallUIDs.
	UID, GID int
	Box      string // the calls' working directory; default /box
	// CgroupParent is the container backend's cgroup parent (the pool
	// sandboxes' cgroups are <hierarchy>/<CgroupParent>/<runc id>).
	CgroupParent string    // default "shoal"
	Isolation    Isolation // for calls that do not say; default IsolationCgroup
	Log          *slog.Logger
}

// CallUIDs is how many uids the calls of one sandbox rotate through.
const CallUIDs = 1000

// Limits bound one run. Zero fields mean "the default".
type Limits struct {
	CPUTime   time.Duration
	WallTime  time.Duration
	Memory    int64
	Output    int64 // bytes kept per stream; more stdout is OLE
	Processes int
}

func (l Limits) or(d Limits) Limits {
	if l.CPUTime == 0 {
		l.CPUTime = d.CPUTime
	}
	if l.WallTime == 0 {
		l.WallTime = d.WallTime
	}
	if l.Memory == 0 {
		l.Memory = d.Memory
	}
	if l.Output == 0 {
		l.Output = d.Output
	}
	if l.Processes == 0 {
		l.Processes = d.Processes
	}
	return l
}

// Validate fills defaults and checks the configuration.
func (c *Config) Validate() error {
	if c.Languages == nil {
		c.Languages = DefaultLanguages()
	}
	if c.MaxConcurrent <= 0 {
		c.MaxConcurrent = runtime.NumCPU()
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = time.Minute
	}
	if c.MaxUses <= 0 {
		c.MaxUses = 1000
	}
	c.DefaultLimits = c.DefaultLimits.or(Limits{CPUTime: 2 * time.Second, Memory: 256 << 20, Output: 1 << 20, Processes: 64})
	c.MaxLimits = c.MaxLimits.or(Limits{CPUTime: time.Minute, WallTime: 3 * time.Minute, Memory: 2 << 30, Output: 64 << 20, Processes: 512})
	c.CompileLimits = c.CompileLimits.or(Limits{CPUTime: 20 * time.Second, WallTime: 60 * time.Second, Memory: 1 << 30, Output: 256 << 10, Processes: 256})
	if c.SandboxMemory == 0 {
		c.SandboxMemory = max(c.MaxLimits.Memory, c.CompileLimits.Memory) + 512<<20
	}
	if c.UID == 0 {
		c.UID = 10001
	}
	if c.GID == 0 {
		c.GID = c.UID
	}
	if c.UID < 0 || c.GID < 0 {
		return errors.New("fncall: uid and gid must be positive")
	}
	if max(c.UID, c.GID)+CallUIDs > 65534 {
		// A sandbox's user namespace maps ids 0..65535.
		return fmt.Errorf("fncall: uid and gid + %d must stay below 65534", CallUIDs)
	}
	if c.Box == "" {
		c.Box = "/box"
	}
	if !strings.HasPrefix(c.Box, "/") || c.Box == "/" {
		return fmt.Errorf("fncall: box %q must be an absolute path below /", c.Box)
	}
	if c.CgroupParent == "" {
		c.CgroupParent = "shoal"
	}
	if c.Isolation == IsolationDefault {
		c.Isolation = IsolationCgroup
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	seen := map[string]bool{}
	for i := range c.Languages {
		l := &c.Languages[i]
		if err := l.validate(); err != nil {
			return fmt.Errorf("fncall: %w", err)
		}
		if seen[l.Name] {
			return fmt.Errorf("fncall: language %s defined twice", l.Name)
		}
		seen[l.Name] = true
	}
	return nil
}

// Engine runs calls. Create it with New, stop it with Close.
type Engine struct {
	cfg   Config
	mgr   *node.Manager
	log   *slog.Logger
	h     hierarchies // nil when the host lacks them (hErr says why)
	hErr  error
	langs map[string]*Language
	slots chan struct{} // one per call running
	build chan struct{} // bounds background sandbox creations
	seq   atomic.Uint64 // names of run cgroups

	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // background work

	mu       sync.Mutex
	pools    map[string]*pool      // guarded by mu; by environment key and isolation
	resolved map[string]resolution // guarded by mu; stack resolutions, cached briefly
}

type resolution struct {
	env  environment
	err  error
	when time.Time
}

// New returns an engine on the node's manager. It deletes the pool
// sandboxes an earlier engine left (in the background) and starts the
// pools' janitor. The host's cgroup hierarchies are checked now; without
// them every call fails with a clear error.
func New(cfg Config, mgr *node.Manager) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &Engine{
		cfg: cfg, mgr: mgr, log: cfg.Log.With("component", "fncall"),
		langs: map[string]*Language{}, slots: make(chan struct{}, cfg.MaxConcurrent), build: make(chan struct{}, 2),
		ctx: ctx, cancel: cancel, pools: map[string]*pool{}, resolved: map[string]resolution{},
	}
	for i := range cfg.Languages {
		e.langs[cfg.Languages[i].Name] = &cfg.Languages[i]
	}
	e.h, e.hErr = findHierarchies()
	if e.hErr != nil {
		e.log.Warn("fncall disabled", "err", e.hErr)
	}
	var stale []node.Record
	for _, rec := range mgr.List() {
		if _, ok := rec.Metadata[MetadataKey]; ok {
			stale = append(stale, rec)
		}
	}
	e.wg.Add(2)
	go func() {
		defer e.wg.Done()
		for _, rec := range stale {
			e.deleteStale(rec)
		}
	}()
	go func() { defer e.wg.Done(); e.janitor() }()
	return e, nil
}

// Close stops the pools and deletes their sandboxes. Calls in flight fail.
func (e *Engine) Close(ctx context.Context) error {
	e.cancel()
	e.mu.Lock()
	var idle []*sbx
	for _, p := range e.pools {
		idle = append(idle, p.drain()...)
	}
	e.mu.Unlock()
	for _, s := range idle {
		e.destroy(s)
	}
	done := make(chan struct{})
	go func() { e.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Capacity is how many calls run at once on this node.
func (e *Engine) Capacity() int { return e.cfg.MaxConcurrent }

// LanguageInfo describes a language and whether it can run here.
type LanguageInfo struct {
	Language
	Available bool
	Reason    string
}

// Languages lists the configured languages, sorted by name.
func (e *Engine) Languages() []LanguageInfo {
	var out []LanguageInfo
	for _, l := range e.cfg.Languages {
		info := LanguageInfo{Language: l, Available: true}
		if e.hErr != nil {
			info.Available, info.Reason = false, e.hErr.Error()
		} else if _, err := e.resolve(&l); err != nil {
			info.Available, info.Reason = false, err.Error()
		}
		out = append(out, info)
	}
	slices.SortFunc(out, func(a, b LanguageInfo) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// environment is a language's resolved layer stack.
type environment struct {
	key        string // digests, top to bottom
	base       string
	workspaces []string
	toolkits   []string
}

// resolve turns a language's stack into layer digests (cached for two
// seconds: a moved tag reaches new calls that fast).
func (e *Engine) resolve(l *Language) (environment, error) {
	sk := l.stackKey()
	e.mu.Lock()
	r, ok := e.resolved[sk]
	e.mu.Unlock()
	if ok && time.Since(r.when) < 2*time.Second {
		return r.env, r.err
	}
	env, err := e.resolveNow(l)
	e.mu.Lock()
	e.resolved[sk] = resolution{env, err, time.Now()}
	e.mu.Unlock()
	return env, err
}

func (e *Engine) resolveNow(l *Language) (environment, error) {
	store := e.mgr.Layers()
	base, workspaces, toolkits := l.Base, []string(nil), l.Toolkits
	if l.Template != "" {
		t, err := store.GetEnv(l.Template)
		if err != nil {
			return environment{}, fmt.Errorf("language %s: environment %s: %w", l.Name, l.Template, err)
		}
		base, workspaces, toolkits = t.Base, t.Workspaces, t.Toolkits
	}
	layers, err := store.ResolveStack(base, workspaces, toolkits)
	if err != nil {
		return environment{}, fmt.Errorf("language %s: %w (build its layers: see scripts/up)", l.Name, err)
	}
	var env environment
	var keys []string
	for _, ly := range layers {
		keys = append(keys, ly.Digest)
		switch ly.Kind {
		case layer.KindBase:
			env.base = ly.Digest
		case layer.KindWorkspace:
			env.workspaces = append(env.workspaces, ly.Digest)
		case layer.KindToolkit:
			env.toolkits = append(env.toolkits, ly.Digest)
		}
	}
	env.key = strings.Join(keys, ",")
	return env, nil
}

// invalid marks a malformed request.
func invalid(format string, args ...any) error {
	return errdefs.New(errdefs.ErrInvalidArgument, format, args...)
}
