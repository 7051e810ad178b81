package fncall

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/node"
)

// sbx is one pool sandbox. It serves one call at a time; its fields are
// owned by whoever holds it (the pool while idle, a call while in use).
type sbx struct {
	id      string
	agent   *agent.Client
	cg      map[string]string // controller → the sandbox's cgroup on the host
	uses    int
	uid     int             // the uid (and gid) of its current or last call; 0 before any
	release func()          // the node's hold while in use
	clean   bool            // reset since its last call: nothing to kill or wipe
	next    chan *runCgroup // cap 1: a run cgroup made ahead during a call, never used
	spent   []*runCgroup    // run cgroups of the current call, removed after it
	making  sync.WaitGroup  // makeNextCgroup running in the background
	e       *Engine
}

// callUID is the uid (and gid) of the sandbox's next call: each call of a
// reused sandbox runs under a uid of its own (Config.UID + uses mod
// CallUIDs), so what a call left behind is not its successor's, and the
// sandbox's user namespace (its own host range) keeps them apart from
// every other sandbox's.
func (s *sbx) callUID() int {
	return s.e.cfg.UID + s.uses%CallUIDs
}

// takeCgroup returns fresh cgroups for a run: the ones made ahead if
// ready, else new ones.
func (s *sbx) takeCgroup() (*runCgroup, error) {
	select {
	case cg := <-s.next:
		return cg, nil
	default:
		return newRunCgroup(s.cg, s.e.cgroupName())
	}
}

// makeNextCgroup makes the next run's cgroups ahead of it (while the
// current run runs, or after a call).
func (s *sbx) makeNextCgroup() {
	if len(s.next) > 0 {
		return
	}
	cg, err := newRunCgroup(s.cg, s.e.cgroupName())
	if err != nil {
		s.e.log.Warn("make fncall run cgroup", "sandbox_id", s.id, "err", err)
		return
	}
	select {
	case s.next <- cg:
	default:
		cg.dispose()
	}
}

// disposeCgroups removes the run cgroups of the last call (and, with all,
// the one made ahead). It reports whether they were clean.
func (s *sbx) disposeCgroups(all bool) bool {
	s.making.Wait()
	clean := true
	spent := s.spent
	s.spent = nil
	if all {
		select {
		case cg := <-s.next:
			spent = append(spent, cg)
		default:
		}
	}
	for _, cg := range spent {
		ok, err := cg.dispose()
		if !ok {
			clean = false
			s.e.log.Warn("fncall run cgroup was not clean", "sandbox_id", s.id, "err", err)
		}
	}
	return clean
}

// pool holds the sandboxes of one environment and isolation mode.
type pool struct {
	e     *Engine
	key   string
	env   environment
	name  string // a language of the environment (the sandboxes' metadata)
	reuse bool   // cgroup isolation: sandboxes serve many calls
	warm  int

	mu      sync.Mutex
	warms   [][]string // guarded by mu; warm-up commands of the languages using the pool
	idle    []*sbx     // guarded by mu; most recently used last
	filling bool       // guarded by mu; a refill runs
	lastUse time.Time  // guarded by mu
	closed  bool       // guarded by mu
}

// pool returns the pool of l's environment for the isolation mode.
func (e *Engine) pool(env environment, l *Language, iso Isolation) *pool {
	key := iso.String() + "|" + env.key
	e.mu.Lock()
	defer e.mu.Unlock()
	p := e.pools[key]
	if p == nil {
		warm := e.cfg.Warm
		if warm == 0 {
			warm = 1
			if iso == IsolationSandbox {
				warm = e.cfg.MaxConcurrent
			}
		}
		p = &pool{e: e, key: key, env: env, name: l.Name, reuse: iso != IsolationSandbox, warm: max(warm, 0), lastUse: time.Now()}
		e.pools[key] = p
	}
	if len(l.Warm) > 0 {
		p.mu.Lock()
		if !slices.ContainsFunc(p.warms, func(w []string) bool { return slices.Equal(w, l.Warm) }) {
			p.warms = append(p.warms, l.Warm)
		}
		p.mu.Unlock()
	}
	return p
}

// get returns a ready sandbox: an idle one, or a new one made now.
func (p *pool) get(ctx context.Context) (*sbx, error) {
	p.mu.Lock()
	p.lastUse = time.Now()
	var s *sbx
	if n := len(p.idle); n > 0 {
		s, p.idle = p.idle[n-1], p.idle[:n-1]
	}
	p.mu.Unlock()
	p.refill()
	if s == nil {
		var err error
		if s, err = p.e.newSandbox(ctx, p); err != nil {
			return nil, err
		}
	}
	release, err := p.e.mgr.Hold(s.id) // also: the sandbox still exists
	if err != nil {
		return nil, fmt.Errorf("pool sandbox %s: %w", s.id, err)
	}
	s.release = release
	return s, nil
}

// put gives a sandbox back after a call: reset and kept if healthy and
// reusable, else deleted. In the background.
func (p *pool) put(s *sbx, healthy bool) {
	if s.release != nil {
		s.release()
		s.release = nil
	}
	s.uses++
	s.clean = false
	p.e.wg.Add(1)
	go func() {
		defer p.e.wg.Done()
		// An idle sandbox holds no run cgroup: the node can delete it
		// (the backend cannot remove a cgroup that has children).
		if !s.disposeCgroups(true) {
			healthy = false
		}
		if healthy && p.reuse && s.uses < p.e.cfg.MaxUses {
			if err := p.e.reset(p.e.ctx, s); err == nil {
				p.mu.Lock()
				if !p.closed {
					p.idle = append(p.idle, s)
					p.mu.Unlock()
					return
				}
				p.mu.Unlock()
			} else {
				p.e.log.Warn("pool sandbox not reusable", "sandbox_id", s.id, "err", err)
			}
		}
		p.e.destroy(s)
		p.refill()
	}()
}

// refill starts making sandboxes in the background until warm are idle.
func (p *pool) refill() {
	p.mu.Lock()
	if p.filling || p.closed || len(p.idle) >= p.warm {
		p.mu.Unlock()
		return
	}
	p.filling = true
	p.mu.Unlock()
	p.e.wg.Add(1)
	go func() {
		defer p.e.wg.Done()
		for fails := 0; fails < 3; {
			p.mu.Lock()
			if p.closed || len(p.idle) >= p.warm || p.e.ctx.Err() != nil {
				p.filling = false
				p.mu.Unlock()
				return
			}
			p.mu.Unlock()
			select {
			case p.e.build <- struct{}{}:
			case <-p.e.ctx.Done():
				continue
			}
			s, err := p.e.newSandbox(p.e.ctx, p)
			<-p.e.build
			if err != nil {
				fails++
				p.e.log.Warn("refill fncall pool", "pool", p.key, "err", err)
				continue
			}
			p.mu.Lock()
			if p.closed {
				p.mu.Unlock()
				p.e.destroy(s)
				continue
			}
			p.idle = append(p.idle, s)
			p.mu.Unlock()
		}
		p.mu.Lock()
		p.filling = false
		p.mu.Unlock()
	}()
}

// shrink removes the oldest idle sandboxes past keep and returns them.
func (p *pool) shrink(keep int) []*sbx {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*sbx
	for len(p.idle) > keep {
		out = append(out, p.idle[0])
		p.idle = p.idle[1:]
	}
	return out
}

// drain closes the pool and returns its idle sandboxes.
func (p *pool) drain() []*sbx {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	return p.shrink(0)
}

// janitor shrinks pools idle for IdleTimeout down to MinIdle, and keeps
// the idle sandboxes' node timeout from expiring.
func (e *Engine) janitor() {
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	lastTouch := time.Now()
	for {
		select {
		case <-e.ctx.Done():
			return
		case now := <-tick.C:
			var gone, idle []*sbx
			e.mu.Lock()
			for _, p := range e.pools {
				p.mu.Lock()
				stale := now.Sub(p.lastUse) > e.cfg.IdleTimeout
				p.mu.Unlock()
				if stale {
					gone = append(gone, p.shrink(e.cfg.MinIdle)...)
				}
				p.mu.Lock()
				idle = append(idle, p.idle...)
				p.mu.Unlock()
			}
			e.mu.Unlock()
			for _, s := range gone {
				e.log.Debug("fncall pool shrinks", "sandbox_id", s.id)
				e.destroy(s)
			}
			if now.Sub(lastTouch) > 5*time.Minute {
				lastTouch = now
				for _, s := range idle {
					e.mgr.Agent(s.id) // counts as activity
				}
			}
		}
	}
}

// sandboxTimeout is the node idle timeout of pool sandboxes: a safety net
// (the janitor keeps idle ones alive and the engine deletes them).
const sandboxTimeout = time.Hour

// newSandbox creates a pool sandbox: a container sandbox of the
// environment, with tmpfs mounts for everything a call may write, warmed
// up. On failure nothing is left.
func (e *Engine) newSandbox(ctx context.Context, p *pool) (s *sbx, err error) {
	if e.hErr != nil {
		return nil, e.hErr
	}
	rec, err := e.mgr.Create(ctx, node.CreateRequest{
		Backend: "container", Base: p.env.base, Workspaces: p.env.workspaces, Toolkits: p.env.toolkits,
		Memory: e.cfg.SandboxMemory, MilliCPU: int64(runtime.NumCPU()) * 1000, Timeout: sandboxTimeout,
		Metadata: map[string]string{MetadataKey: p.name},
		// A warm pool member waits for work: pausing it would only put a
		// resume on the next call's path.
		AutoPause: new(time.Duration),
	})
	if err != nil {
		return nil, fmt.Errorf("create fncall sandbox: %w", err)
	}
	defer func() {
		if err != nil {
			e.deleteSandbox(rec.ID)
		}
	}()
	runcID := rec.Handle.Data["runc_id"]
	if runcID == "" {
		runcID = rec.ID
	}
	cg, err := sandboxCgroups(e.h, e.cfg.CgroupParent, runcID)
	if err != nil {
		return nil, err
	}
	pid, err := agentPid(cg)
	if err != nil {
		return nil, err
	}
	if err := mountTmpfs(pid, e.cfg.SandboxMemory, rec.Handle.IDMap, []tmpfsMount{
		{path: e.cfg.Box, mode: 0o755, create: true},
		{path: "/tmp", mode: 0o1777, create: true},
		{path: "/var/tmp", mode: 0o1777},
		{path: "/run/lock", mode: 0o1777},
	}); err != nil {
		return nil, fmt.Errorf("set up fncall sandbox %s: %w", rec.ID, err)
	}
	ag, err := e.mgr.Agent(rec.ID)
	if err != nil {
		return nil, err
	}
	made := &sbx{id: rec.ID, agent: ag, cg: cg, e: e, next: make(chan *runCgroup, 1)}
	s = made
	defer func() {
		// made, not s: "return nil, err" has set s to nil by now.
		if err != nil {
			made.disposeCgroups(true)
		}
	}()
	if err := e.reset(ctx, s); err != nil {
		return nil, err
	}
	p.mu.Lock()
	warms := slices.Clone(p.warms)
	p.mu.Unlock()
	for _, w := range warms {
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		proc, err := ag.FnStart(wctx, agent.FnRunRequest{
			Args: w, Env: e.runEnv(nil), Cwd: e.cfg.Box, UID: e.cfg.UID, GID: e.cfg.GID, Timeout: time.Minute, OutputLimit: 4 << 10,
		})
		var ae *agent.Error
		if errors.As(err, &ae) && (ae.Code == agent.CodeNotExist || ae.Code == agent.CodePermission || ae.Code == agent.CodeIsDir) {
			// The agent answered: the warm-up command is wrong (the pool
			// is shared by every language on the environment), not the
			// sandbox. A warm-up only saves time: say so, go on.
			e.log.Warn("fncall warm-up command could not start", "sandbox_id", rec.ID, "cmd", w, "err", err)
			cancel()
			continue
		}
		if err == nil {
			var r agent.FnRunResult
			r, err = proc.Wait()
			if err == nil && r.Code != 0 {
				e.log.Warn("fncall warm-up command failed", "sandbox_id", rec.ID, "cmd", w, "code", r.Code, "stderr", string(r.Stderr))
			}
		}
		cancel()
		if err != nil {
			return nil, fmt.Errorf("warm up fncall sandbox %s: %w", rec.ID, err)
		}
	}
	if len(warms) > 0 {
		if err := e.reset(ctx, s); err != nil {
			return nil, err
		}
	}
	e.log.Debug("fncall sandbox ready", "sandbox_id", rec.ID, "pool", p.key)
	return s, nil
}

// wipeDirs are the places writable by anyone in a sandbox, emptied
// before and after every call (the box is emptied too).
var wipeDirs = []string{"/tmp", "/var/tmp", "/run/lock", "/dev/shm", "/dev/mqueue"}

// reset empties a sandbox after (or before) a call; an error means it
// must not be reused.
func (e *Engine) reset(ctx context.Context, s *sbx) error {
	uid := s.uid // what the last call ran as: its processes are killed
	if uid == 0 {
		uid = e.cfg.UID
	}
	res, err := s.agent.FnPrepare(ctx, agent.FnPrepareRequest{Box: e.cfg.Box, Wipe: wipeDirs, UID: uid, GID: uid - e.cfg.UID + e.cfg.GID})
	if err != nil {
		return err
	}
	if len(res.Dirty) > 0 {
		return fmt.Errorf("sandbox %s could not be cleaned: %v", s.id, res.Dirty)
	}
	s.clean = true
	return nil
}

func (e *Engine) cgroupName() string { return fmt.Sprintf("fc%d", e.seq.Add(1)) }

// destroy removes a pool sandbox's run cgroups, then the sandbox.
func (e *Engine) destroy(s *sbx) {
	s.disposeCgroups(true)
	e.deleteSandbox(s.id)
}

// deleteStale deletes a pool sandbox an earlier process left, with any run
// cgroups left in it (the backend removes the sandbox's own cgroups, and
// cannot while they have children).
func (e *Engine) deleteStale(rec node.Record) {
	if e.h != nil {
		runcID := rec.Handle.Data["runc_id"]
		if runcID == "" {
			runcID = rec.ID
		}
		for _, c := range controllers {
			dir := filepath.Join(e.h[c], e.cfg.CgroupParent, runcID)
			entries, _ := os.ReadDir(dir)
			for _, ent := range entries {
				if ent.IsDir() && strings.HasPrefix(ent.Name(), "fc") {
					cg := &runCgroup{dirs: map[string]string{}}
					for _, c2 := range controllers {
						cg.dirs[c2] = filepath.Join(e.h[c2], e.cfg.CgroupParent, runcID, ent.Name())
					}
					cg.dispose()
				}
			}
		}
	}
	e.deleteSandbox(rec.ID)
}

// deleteSandbox deletes a pool sandbox, logging failures.
func (e *Engine) deleteSandbox(id string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := e.mgr.Delete(ctx, id); err != nil && !errors.Is(err, node.ErrNotFound) {
		e.log.Warn("delete fncall sandbox", "sandbox_id", id, "err", err)
	}
}

// gid is the gid of the sandbox's current call.
func (s *sbx) gid() int { return s.uid - s.e.cfg.UID + s.e.cfg.GID }
