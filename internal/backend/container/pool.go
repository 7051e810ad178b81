package container

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// The warm pool.
//
// A pool container is a runc container started ahead of time over an empty
// root: its own pid, mount, ipc, uts, cgroup and network namespaces, its
// cgroups (with the default limits), docker's masked and read-only paths,
// /proc, /dev and /sys mounted, and the agent running as PID 1 in pooled
// mode. It has CAP_SYS_ADMIN (for the root switch) and no seccomp filter
// yet; nothing but the agent ever runs in it before it is claimed.
//
// A claim (Create with a ready pool container):
//
//  1. renames the container's dir PoolDir/ready/<runc id> to
//     PoolDir/claimed/<sandbox id>, atomically (RENAME_NOREPLACE): from then
//     on the container belongs to the sandbox, and a provisional handle (a
//     create interrupted by a crash) finds it by the sandbox ID;
//  2. writes the sandbox's limits into the container's cgroups;
//  3. composes the overlay root (layers + the private upper under
//     Spec.Dir) as a detached mount, and sends its descriptor to the agent
//     with the host name and the environment (agent.Client.Claim);
//  4. the agent attaches it, moves /proc, /dev, /sys and its binary into it,
//     pivots, installs docker's seccomp filter for docker's capabilities on
//     every thread and drops CAP_SYS_ADMIN from every thread
//     (internal/agent/claim.go); only then does it answer and serve.
//
// Isolation is that of a cold sandbox: same namespaces, cgroup limits
// (written by the host before the root arrives), capabilities (CAP_SYS_ADMIN
// is gone from the bounding set before any command can run), seccomp
// policy, masked paths, read-only agent binary, no network. The overlay
// root exists only in the container's mount namespace, not on the host.
//
// The pool is filled from StartPool (serve calls it at start, so that the
// first create after a start or a restart is served warm; else from the
// first Create on) and refilled in the background, one container at a
// time, after each claim, at the lowest
// priority: runc runs at nice 19 and the pool container's cgroup at the
// lowest CPU weight until its claim (the agent's threads are set back to
// nice 0 once it is ready), so that filling the pool yields to the creates
// and sandboxes that run. A failed claim
// deletes the pool container and the create falls back on the cold path.
// Close deletes the unclaimed pool containers. Should the node die without
// Close, their agents exit on their own (the lifeline, agent.EnvLifeline),
// and the next New on the same dirs deletes the stopped containers.

// Layout of PoolDir.
const (
	poolReady   = "ready"   // ready/<runc id>: unclaimed pool containers
	poolClaimed = "claimed" // claimed/<sandbox id>: containers of pooled sandboxes
	// bundles/<runc id>: a pool container's OCI bundle. It never moves: runc
	// records its path (and chdirs there for runc exec), while the
	// container's dir moves from ready/ to claimed/ on its claim.
	poolBundles = "bundles"
	runcIDFile  = "runc-id" // in a container dir: the runc container ID
	ownerFile   = "owner"   // in a claimed dir: the sandbox's Spec.Dir
	blankRoot   = "root"    // in a container dir: the empty root before the claim
	poolPrefix  = "pool-"
)

func (b *Backend) readyDir(runcID string) string {
	return filepath.Join(b.poolDir, poolReady, runcID)
}

func (b *Backend) memberBundle(runcID string) string {
	return filepath.Join(b.poolDir, poolBundles, runcID)
}

func (b *Backend) claimedDir(sandboxID string) string {
	return filepath.Join(b.poolDir, poolClaimed, sandboxID)
}

func (b *Backend) memberSocket(runcID string) string {
	return filepath.Join(b.readyDir(runcID), socketName)
}

const (
	// claimTimeout bounds one claim: the agent's answer normally comes in
	// milliseconds, even on a loaded host.
	claimTimeout = 5 * time.Second
	// maxClaimTries is how many pool members one create tries before the
	// cold path.
	maxClaimTries = 2
)

// processState describes the process whose pid is in pidFile, for an error
// message: its state and kernel wait channel, with those of its threads.
func processState(pidFile string) string {
	p, err := readPidFile(pidFile)
	if err != nil {
		return "pid unknown: " + err.Error()
	}
	pid := strconv.Itoa(p)
	ents, err := os.ReadDir("/proc/" + pid + "/task")
	if err != nil {
		return "pid " + pid + ": gone"
	}
	out := "pid " + pid + ":"
	for i, e := range ents {
		if i == 16 {
			out += " …"
			break
		}
		state := "?"
		if st, err := os.ReadFile("/proc/" + pid + "/task/" + e.Name() + "/stat"); err == nil {
			// "tid (comm) S ...": the state follows the last ')'.
			if j := strings.LastIndexByte(string(st), ')'); j >= 0 && j+2 < len(st) {
				state = string(st[j+2])
			}
		}
		wchan, _ := os.ReadFile("/proc/" + pid + "/task/" + e.Name() + "/wchan")
		out += fmt.Sprintf(" %s=%s/%s", e.Name(), state, wchan)
	}
	return out
}

// member is a ready pool container.
type member struct {
	id    string // runc container ID
	dir   string // PoolDir/ready/<id>
	agent string // the agent binary it runs
	// idmap and nsfd: the range of its user namespace, and a user
	// namespace of the same mapping (the slot's, not to be closed), or nil
	// and -1 (userns.go).
	idmap *sandbox.IDMap
	nsfd  int
	// disk: the size of the disk image made and mounted in dir/disk while
	// it waits (premakeDisk), 0 for none: a claim asking that size takes
	// it instead of making one.
	disk int64
}

// pool keeps between min and max ready containers, sized by demand.
//
// The target starts at min. A take that finds the pool empty (a miss: that
// create goes cold) doubles the target, up to max, and makes the pool
// urgent for urgentFor: the filler then starts up to fillParallel
// containers at once at normal priority (nice 0, the default CPU weight)
// instead of one at a time at the lowest. Every shrinkEvery without a miss
// halves the surplus above min once the pool has been idle (no take) for
// shrinkIdle, deleting the oldest ready containers. max bounds the memory
// the pool holds (about PoolMemberBytes per ready container).
type pool struct {
	b        *Backend
	min, max int
	// Tuning, copied from the variables below at creation (shrinkIdle is
	// read under mu).
	urgentFor, shrinkIdle, shrinkEvery, yieldFor time.Duration
	fillParallel                                 int

	ctx    context.Context // cancelled by close: stops the filler
	cancel context.CancelFunc
	wake   chan struct{} // cap 1: a member was taken, or the target grew

	mu        sync.Mutex
	agent     string    // guarded by mu; the agent binary, set by the first take
	ready     []*member // guarded by mu; oldest first
	starting  int       // guarded by mu; members being started
	target    int       // guarded by mu; between min and max
	urgentTo  time.Time // guarded by mu; fill at full speed until then
	lastTake  time.Time // guarded by mu
	lastClaim time.Time // guarded by mu; the last take that got a member
	lastMiss  time.Time // guarded by mu
	stats     PoolStats // guarded by mu
	started   bool      // guarded by mu; the filler runs
	closed    bool      // guarded by mu
	done      chan struct{}
}

// PoolStats counts what the pool did; see Backend.PoolStats.
type PoolStats struct {
	Ready, Starting, Target, Max int
	Claims                       int64 // creates served from the pool
	Misses                       int64 // creates that found the pool empty
	Started, Shrunk              int64 // containers started, and deleted by a shrink
	Yields                       int64 // times the filler waited for a burst of claims to pause
}

// Tuning of the pool; variables so that tests can shorten them.
var (
	// yieldFor: while creates keep claiming from a pool that holds more
	// than a quarter of its target or yieldReserve containers, whichever
	// is fewer, the filler waits until none came for this long: a refill
	// costs more CPU than the claims it would slow down, and the pool
	// covers the burst anyway (a refill that began at a quarter of a pool
	// of 55 cost a burst of 50 rollouts 12% of its rate).
	yieldFor     = 250 * time.Millisecond
	yieldReserve = 2
	urgentFor    = 10 * time.Second
	shrinkIdle   = 60 * time.Second
	shrinkEvery  = 10 * time.Second
	fillParallel = 2
)

// holdsSome reports whether a pool of ready containers out of target may
// wait for the claims to pause before it refills (see yieldFor).
func holdsSome(ready, target int) bool {
	return ready > min(target/4, yieldReserve)
}

// PoolMemberBytes is about what one ready pool container costs: the agent's
// resident memory (~4 MiB) and the kernel's share (namespaces, cgroups,
// page tables).
const PoolMemberBytes = 8 << 20

func newPool(b *Backend, min, max int) *pool {
	ctx, cancel := context.WithCancel(context.Background())
	return &pool{b: b, min: min, max: max, target: min, ctx: ctx, cancel: cancel,
		urgentFor: urgentFor, shrinkIdle: shrinkIdle, shrinkEvery: shrinkEvery, yieldFor: yieldFor, fillParallel: fillParallel,
		wake: make(chan struct{}, 1), done: make(chan struct{})}
}

func (p *pool) poke() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// startLocked starts the filler with containers running agentBinary, unless it
// runs already (or the pool is closed); it reports whether it started it.
// p.mu must be held.
func (p *pool) startLocked(agentBinary string) bool {
	if p.started || p.closed {
		return false
	}
	p.started, p.agent = true, agentBinary
	go p.fill()
	go p.shrinker()
	return true
}

// take returns a ready container running agentBinary, or nil. The first
// call starts the filler if StartPool did not; every call wakes it.
func (p *pool) take(agentBinary string) *member {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	now := time.Now()
	p.lastTake = now
	if p.startLocked(agentBinary) {
		return nil
	}
	if agentBinary != p.agent {
		return nil
	}
	defer p.poke()
	if len(p.ready) == 0 {
		// A miss: the pool is too small for this demand.
		p.stats.Misses++
		p.lastMiss = now
		p.urgentTo = now.Add(p.urgentFor)
		p.target = min(p.max, max(2*p.target, p.target+1))
		return nil
	}
	m := p.ready[0]
	p.ready = slices.Delete(p.ready, 0, 1)
	p.stats.Claims++
	p.lastClaim = now
	return m
}

// stats returns the pool's counters and sizes.
func (p *pool) statsNow() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.stats
	st.Ready, st.Starting, st.Target, st.Max = len(p.ready), p.starting, p.target, p.max
	return st
}

// fill keeps the pool at its target until close.
func (p *pool) fill() {
	defer close(p.done)
	var wg sync.WaitGroup
	defer wg.Wait()
	log := p.b.log
	var backoff time.Duration
	// Each start reports here (buffered: never more than fillParallel run).
	results := make(chan error, p.fillParallel)
	handle := func(err error) bool {
		if err == nil {
			backoff = 0
			return true
		}
		if p.ctx.Err() != nil {
			return false
		}
		backoff = min(max(2*backoff, 100*time.Millisecond), 30*time.Second)
		log.Error("start pool container", "err", err, "retry_in", backoff)
		select {
		case <-time.After(backoff):
			return true
		case <-p.ctx.Done():
			return false
		}
	}
	for {
		select {
		case err := <-results:
			if !handle(err) {
				return
			}
			continue
		default:
		}
		p.mu.Lock()
		now := time.Now()
		urgent := now.Before(p.urgentTo)
		limit := 1
		if urgent {
			limit = p.fillParallel
		}
		need := !p.closed && len(p.ready)+p.starting < p.target && p.starting < limit
		// Claims are coming and the pool still holds some: refill after.
		var yield <-chan time.Time
		if need && !urgent && holdsSome(len(p.ready), p.target) {
			if wait := p.lastClaim.Add(p.yieldFor).Sub(now); wait > 0 {
				need, yield = false, time.After(wait)
				p.stats.Yields++
			}
		}
		if need {
			p.starting++
		}
		p.mu.Unlock()
		if !need {
			select {
			case <-yield:
			case <-p.wake:
			case err := <-results:
				if !handle(err) {
					return
				}
			case <-p.ctx.Done():
				return
			}
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(p.ctx, sandbox.DefaultStartTimeout)
			m, err := p.b.startMember(ctx, p.agent, urgent)
			cancel()
			p.mu.Lock()
			p.starting--
			closed := p.closed
			if err == nil && !closed {
				p.ready = append(p.ready, m)
				p.stats.Started++
			}
			n := len(p.ready)
			p.mu.Unlock()
			if err == nil && closed {
				p.b.removeMember(m)
				return
			}
			if err == nil {
				log.Debug("pool container ready", "runc_id", m.id, "ready", n, "urgent", urgent)
			}
			select {
			case results <- err:
			case <-p.ctx.Done():
			}
		}()
	}
}

// shrinker lowers the target towards min while the pool is idle, deleting
// the surplus ready containers (oldest first).
func (p *pool) shrinker() {
	t := time.NewTicker(p.shrinkEvery)
	defer t.Stop()
	for {
		select {
		case <-p.ctx.Done():
			return
		case now := <-t.C:
			p.mu.Lock()
			var drop []*member
			if now.Sub(p.lastTake) >= p.shrinkIdle && now.Sub(p.lastMiss) >= p.shrinkIdle {
				if p.target > p.min {
					p.target = p.min + (p.target-p.min)/2
				}
				// Also what was still starting when the target came down.
				if extra := len(p.ready) - p.target; extra > 0 {
					drop = slices.Clone(p.ready[:extra])
					p.ready = slices.Delete(p.ready, 0, extra)
					p.stats.Shrunk += int64(extra)
				}
			}
			p.mu.Unlock()
			for _, m := range drop {
				if err := p.b.removeMember(m); err != nil {
					p.b.log.Warn("shrink pool", "runc_id", m.id, "err", err)
				}
			}
		}
	}
}

// close stops the filler and deletes the ready containers.
func (p *pool) close(ctx context.Context) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	started := p.started
	ready := p.ready
	p.ready = nil
	p.mu.Unlock()
	p.cancel()
	if started {
		select {
		case <-p.done:
		case <-ctx.Done():
			return fmt.Errorf("close pool: %w", ctx.Err())
		}
	}
	var errs []error
	for _, m := range ready {
		errs = append(errs, p.b.removeMember(m))
	}
	return errors.Join(errs...)
}

// startMember starts one pool container running agentBinary.
// urgent: creates are waiting, start it at normal priority.
func (b *Backend) startMember(ctx context.Context, agentBinary string, urgent bool) (m *member, err error) {
	var r [8]byte
	rand.Read(r[:])
	id := poolPrefix + hex.EncodeToString(r[:])
	dir := b.readyDir(id)
	m = &member{id: id, dir: dir, agent: agentBinary, nsfd: -1}
	defer func() {
		if err != nil {
			if rerr := b.removeMember(m); rerr != nil {
				b.log.Error("undo failed pool container", "runc_id", id, "err", rerr)
			}
		}
	}()
	var undo undoStack // the id range; removeMember releases it too
	if m.idmap, m.nsfd, err = b.usernsFor(id, agentBinary, &undo); err != nil {
		undo.run(b.log)
		return m, fmt.Errorf("pool container: %w", err)
	}
	root := filepath.Join(dir, blankRoot)
	bundle := b.memberBundle(id)
	for _, d := range []string{dir, bundle, root, filepath.Join(root, ".shoal", "newroot")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return m, fmt.Errorf("pool container: %w", err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, runcIDFile), []byte(id+"\n"), 0o600); err != nil {
		return m, fmt.Errorf("pool container: %w", err)
	}
	if m.idmap != nil {
		// runc mounts the blank root, and makes its mount points, as the
		// container's root.
		for _, d := range []string{root, filepath.Join(root, ".shoal"), filepath.Join(root, ".shoal", "newroot")} {
			if err := chownToRoot(d, m.idmap); err != nil {
				return m, fmt.Errorf("pool container: %w", err)
			}
		}
		if err := b.traversable(root); err != nil {
			return m, fmt.Errorf("pool container: %w", err)
		}
	}
	caps := append(slices.Clone(dockerCaps), "CAP_SYS_ADMIN")
	cfg, err := b.containerSpec(containerOptions{
		runcID:   id,
		rootfs:   root,
		hostname: "pool",
		env:      baseEnv,
		agent:    agentBinary,
		caps:     caps,
		pooled:   true,
		urgent:   urgent,
		idmap:    m.idmap,
	})
	if err != nil {
		return m, fmt.Errorf("pool container: %w", err)
	}
	if err := writeJSON(filepath.Join(bundle, "config.json"), cfg); err != nil {
		return m, fmt.Errorf("pool container: %w", err)
	}
	lnFile, err := listenAgent(filepath.Join(dir, socketName))
	if err != nil {
		return m, fmt.Errorf("pool container: %w", err)
	}
	defer lnFile.Close()
	// In the background, at the lowest priority: filling the pool yields
	// to the creates and sandboxes that run (the container's own cgroup
	// starts at the lowest CPU weight too, see containerSpec). The agent
	// inherits runc's nice value: set it back for the sandbox.
	nice := 19
	if urgent {
		nice = 0
	}
	if b.native {
		err = b.startNative(ctx, id, dir, root, agentBinary, lnFile, m.idmap, caps, urgent)
	} else {
		err = b.startContainer(ctx, id, bundle, dir, lnFile, true, nice)
	}
	if err != nil {
		return m, fmt.Errorf("pool container %s: %w", id, err)
	}
	pid, agentNice, err := b.placeAgent(id, filepath.Join(dir, pidFileName), false)
	if err != nil {
		return m, fmt.Errorf("pool container %s: %w", id, err)
	}
	b.premakeDisk(ctx, m)
	// The nice value once more, off the claim's path: a thread whose clone
	// was under way during the first pass (its parent still at the pool's
	// nice 19, the new thread not yet listed) keeps 19 (seen in CI: one
	// agent thread of a pooled sandbox at 19).
	if err := agent.Prioritize(pid, agentNice); err != nil {
		return m, fmt.Errorf("pool container %s: %w", id, err)
	}
	return m, nil
}

// readPidFile returns the pid a pid file (runc's, the native launcher's)
// holds.
func readPidFile(pidFile string) (int, error) {
	data, err := os.ReadFile(pidFile)
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(string(trimSpace(data)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("pid file %s: %q", pidFile, data)
	}
	return pid, nil
}

// removeMember destroys an unclaimed pool container and removes its dir.
func (b *Backend) removeMember(m *member) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.destroy(ctx, m.id); err != nil {
		return err
	}
	unmountAgentBind(m.dir)
	if err := removeDisk(m.dir); err != nil {
		return err
	}
	if err := os.RemoveAll(b.memberBundle(m.id)); err != nil {
		return err
	}
	return os.RemoveAll(m.dir)
}

// claim makes a sandbox of a ready pool container; see the top of the file.
// On failure the container is destroyed and nothing of the claim is left
// (the caller may then create the sandbox cold in the same dir).
func (b *Backend) claim(ctx context.Context, spec sandbox.Spec, dir string, m *member) (h sandbox.Handle, err error) {
	log := b.log.With("sandbox_id", spec.ID, "runc_id", m.id)
	start := time.Now()
	ph := sandbox.StartPhases()
	claimed := b.claimedDir(spec.ID)
	sock := filepath.Join(claimed, socketName)
	if len(sock) > maxSocketPath {
		b.removeMember(m)
		return h, fmt.Errorf("claim for sandbox %s: socket path %s too long", spec.ID, sock)
	}
	var undo undoStack
	defer func() {
		if err != nil {
			undo.run(log)
		}
	}()
	owner := filepath.Join(m.dir, ownerFile)
	if err := os.WriteFile(owner, []byte(dir+"\n"), 0o600); err != nil {
		b.removeMember(m)
		return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
	}
	if err := os.MkdirAll(filepath.Dir(claimed), 0o700); err != nil {
		b.removeMember(m)
		return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
	}
	// 1. The container is the sandbox's from here on.
	if err := unix.Renameat2(unix.AT_FDCWD, m.dir, unix.AT_FDCWD, claimed, unix.RENAME_NOREPLACE); err != nil {
		b.removeMember(m)
		return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
	}
	undo.push("destroy container", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := b.destroy(ctx, m.id); err != nil {
			return err
		}
		return removeAll(claimed, b.memberBundle(m.id))
	})

	ph.Mark("rename")
	// 2. Limits, before anything of the sandbox runs.
	if err := b.setLimits(m.id, spec.Resources); err != nil {
		return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
	}
	if spec.Resources.BestEffort {
		// Its commands run under SCHED_IDLE: the claim says so.
		if err := b.makeIdle(m.id, spec.Resources); err != nil {
			return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
		}
		// The move took the spawner out of its commands' group.
		if _, _, err := b.placeAgent(m.id, filepath.Join(claimed, pidFileName), true); err != nil {
			return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
		}
	}
	if !spec.Resources.BestEffort && b.coreSched {
		if err := setCoreCookie(filepath.Join(claimed, pidFileName)); err != nil {
			return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
		}
	}

	ph.Mark("limits")
	// 3. The root, as a detached mount handed to the agent; its writable
	// layer on the disk the container brought, when it is of the size
	// asked (it moved here with the container's dir).
	premade := ""
	switch {
	case m.disk > 0 && m.disk == spec.Resources.DiskBytes:
		premade = claimed
	case m.disk > 0:
		if err := removeDisk(claimed); err != nil {
			return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
		}
	}
	upper, work, err := b.writableLayer(ctx, spec, dir, premade, &undo)
	if err != nil {
		return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
	}
	lowers := lowerDirs(spec)
	if err := ensureTmpUpper(lowers, upper, m.idmap); err != nil {
		return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
	}
	if m.idmap != nil {
		if err := os.MkdirAll(upper, 0o755); err != nil {
			return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
		}
		if err := chownToRoot(upper, m.idmap); err != nil {
			return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
		}
	}
	ph.Mark("upper")
	mfd, err := layer.ComposeFDMapped(lowers, m.nsfd, upper, work, true)
	if err != nil {
		return h, fmt.Errorf("claim for sandbox %s: %w", spec.ID, err)
	}
	ph.Mark("overlay")
	// A claim takes milliseconds; one that takes seconds will not end
	// well: the member is destroyed (undo) and the caller tries another.
	cctx, cancel := context.WithTimeout(ctx, claimTimeout)
	info, err := agent.NewClient(sock).Claim(cctx, mfd, agent.ClaimRequest{
		Hostname:   hostname(spec.ID),
		Env:        sandboxEnv(spec),
		BestEffort: spec.Resources.BestEffort,
	})
	cancel()
	unix.Close(mfd)
	if err != nil {
		// Say what the agent was doing: a claim that is not answered
		// must be explainable from the log alone.
		return h, fmt.Errorf("claim for sandbox %s: %w (agent %s); agent log: %q", spec.ID, err,
			processState(filepath.Join(claimed, pidFileName)), tail(filepath.Join(claimed, agentLogName), 0))
	}
	ph.Mark("agent")
	log.Debug("sandbox created from the pool", "took", time.Since(start), "phases", ph.String())
	return sandbox.Handle{
		ID:          spec.ID,
		Backend:     Name,
		AgentSocket: sock,
		Agent:       &info,
		Data: handleData(map[string]string{
			"runc_id": m.id,
			"bundle":  b.memberBundle(m.id),
			"dir":     dir,
			"pooled":  "true",
		}, spec, upper),
		IDMap: m.idmap,
	}, nil
}

// ensureTmpUpper gives the root a world-writable /tmp, in its upper layer,
// when no lower layer has one (ensureTmp for a root not mounted on the host).
func ensureTmpUpper(lowers []string, upper string, idmap *sandbox.IDMap) error {
	for _, l := range lowers {
		if _, err := os.Lstat(filepath.Join(l, "tmp")); err == nil {
			return nil
		}
	}
	if err := os.MkdirAll(upper, 0o755); err != nil {
		return err
	}
	p := filepath.Join(upper, "tmp")
	if err := os.Mkdir(p, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("create /tmp: %w", err)
	}
	if err := os.Chmod(p, 0o777|os.ModeSticky); err != nil {
		return fmt.Errorf("create /tmp: %w", err)
	}
	return chownToRoot(p, idmap)
}

// sweepPool deletes what an earlier process left in PoolDir: every
// unclaimed pool container (its agent never served a sandbox), and the
// claimed ones whose sandbox dir is gone (the node forgot the sandbox).
func (b *Backend) sweepPool(ctx context.Context) error {
	for _, d := range []string{filepath.Join(b.poolDir, poolReady), filepath.Join(b.poolDir, poolClaimed)} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("create pool dir: %w", err)
		}
	}
	var errs []error
	sweep := func(kind, name string, orphan func(dir string) bool) {
		dir := filepath.Join(b.poolDir, kind, name)
		if !orphan(dir) {
			return
		}
		id := name
		if data, err := os.ReadFile(filepath.Join(dir, runcIDFile)); err == nil {
			id = string(trimSpace(data))
		}
		if checkID(id) != nil {
			errs = append(errs, fmt.Errorf("pool dir %s: bad container id %q", dir, id))
			return
		}
		b.log.Info("deleting a pool container left by an earlier process", "runc_id", id, "dir", dir)
		unmountAgentBind(dir)
		if err := b.destroy(ctx, id); err != nil {
			errs = append(errs, err)
			return
		}
		if err := removeDisk(dir); err != nil {
			errs = append(errs, err)
			return
		}
		for _, p := range []string{b.memberBundle(id), dir} {
			if err := os.RemoveAll(p); err != nil {
				errs = append(errs, err)
			}
		}
	}
	ready, err := os.ReadDir(filepath.Join(b.poolDir, poolReady))
	if err != nil {
		return err
	}
	for _, e := range ready {
		sweep(poolReady, e.Name(), func(string) bool { return true })
	}
	claimed, err := os.ReadDir(filepath.Join(b.poolDir, poolClaimed))
	if err != nil {
		return err
	}
	for _, e := range claimed {
		sweep(poolClaimed, e.Name(), func(dir string) bool {
			data, err := os.ReadFile(filepath.Join(dir, ownerFile))
			if err != nil {
				return false // not ours to judge
			}
			_, err = os.Stat(string(trimSpace(data)))
			return errors.Is(err, os.ErrNotExist)
		})
	}
	return errors.Join(errs...)
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == ' ') {
		b = b[:len(b)-1]
	}
	return b
}

// StartPool starts filling the pool now with containers that run
// agentBinary (the guest agent the node's creates name), rather than at
// the first Create: the creates after a start or a restart of the node
// find warm containers. Creates with another agent binary go cold. It does
// nothing without a pool or once the pool is filling.
func (b *Backend) StartPool(agentBinary string) {
	if b.pool == nil {
		return
	}
	b.pool.mu.Lock()
	defer b.pool.mu.Unlock()
	b.pool.startLocked(agentBinary)
}

// PoolStats reports the pool's sizes and counters; ok is false without a
// pool.
func (b *Backend) PoolStats() (st PoolStats, ok bool) {
	if b.pool == nil {
		return st, false
	}
	return b.pool.statsNow(), true
}
