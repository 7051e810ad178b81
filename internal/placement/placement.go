// Package placement chooses the node a sandbox is created on. It is pure
// scheduling: it knows nodes only by what they report (Node: capacity after
// oversubscription, what is used, backends, layers held) and requests only
// by what they ask (Request), and it reaches a node only through the try
// function its caller passes to Place. The control role feeds it from the
// node registry in etcd (internal/cluster); `shoal bench cluster` feeds it
// simulated nodes.
//
// A decision scores every node that can hold the request (its backend is
// supported, its free CPU and memory after oversubscription cover the
// request, it is not draining) by:
//
//   - free share: the smaller of its free CPU and free memory fractions
//     after the request (the tighter resource decides), which also spreads
//     sandboxes over the fleet, since an emptier node scores higher;
//   - layer locality: the fraction of the request's layers the node
//     already holds (cached or mounted), which saves a fetch;
//   - a penalty for a node that refused recently (its reports lag behind
//     its real state).
//
// The best node is tried first; a refusal (errdefs.ErrUnavailable: "node
// full") moves on to the next candidate, up to Config.MaxAttempts nodes.
// Between a decision and the node's next report the engine counts the
// request as reserved on the node, so that a burst of decisions spreads
// instead of landing on the node that looked emptiest at the last report.
//
// Fairness and back-pressure: at most Config.Concurrency decisions with
// their tries are in flight; waiting creates queue per tenant and slots go
// round-robin over the tenants with waiters, so one tenant's burst of
// 32,000 creates takes its turn with the others instead of ahead of them.
// A create that finds the fleet full (no node can hold it) waits for
// capacity (a report or a release) until its deadline. The queue is
// bounded (Config.MaxQueue): beyond it, creates are refused at once with
// resource_exhausted.
//
// Concurrency: an Engine is safe for concurrent use; mu guards every field
// below it.
package placement

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Node is what a node reports about itself.
type Node struct {
	Name string
	// CPU and memory the node admits in all (after oversubscription:
	// ratio × the host's), in milli-CPUs and bytes; 0: no bound.
	MilliCPU, Memory int64
	// What its sandboxes' limits add up to now.
	UsedMilliCPU, UsedMemory int64
	Sandboxes                int
	Backends                 []string
	// Layers the node holds (cached or mounted): digests or refs, as the
	// requests name them.
	Layers   []string
	Draining bool
}

// Request is what a create asks of a node.
type Request struct {
	Tenant           string
	Backend          string
	MilliCPU, Memory int64
	Layers           []string
}

// Config tunes an Engine; zero values take the defaults.
type Config struct {
	// MaxAttempts: nodes tried per create before giving up (default 3).
	MaxAttempts int
	// Concurrency: decisions with their tries in flight at once
	// (default 256).
	Concurrency int
	// MaxQueue: creates that may wait for a slot or for capacity
	// (default 100,000); more are refused with resource_exhausted.
	MaxQueue int
	// MaxWait bounds a create's wait when its context has no earlier
	// deadline (default 60 s).
	MaxWait time.Duration
	// RefusalPenalty: how long a refusing node is scored down
	// (default 2 s).
	RefusalPenalty time.Duration
	// LocalityWeight: the weight of layer locality against free share
	// (default 0.05: a node holding every layer of the request wins over
	// one up to 5% of its capacity emptier; more packs the nodes holding
	// popular layers fuller than the rest: with 0.3, 1.15 max/mean at 87%
	// fleet fill in `shoal bench cluster`).
	LocalityWeight float64
	// Now is the clock (tests); time.Now when nil.
	Now func() time.Time
}

func (c *Config) fill() {
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 3
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 256
	}
	if c.MaxQueue <= 0 {
		c.MaxQueue = 100_000
	}
	if c.MaxWait <= 0 {
		c.MaxWait = 60 * time.Second
	}
	if c.RefusalPenalty <= 0 {
		c.RefusalPenalty = 2 * time.Second
	}
	if c.LocalityWeight == 0 {
		c.LocalityWeight = 0.05
	}
	if c.Now == nil {
		c.Now = time.Now
	}
}

// Stats counts an engine's decisions since it was made.
type Stats struct {
	Placed, Refusals, Retries, NoCapacity, QueueFull, TimedOut int64
}

// nodeState is a node as the engine sees it: its last report plus the
// reservations made since.
type nodeState struct {
	Node
	layers   map[string]bool
	backends map[string]bool
	// Reservations: resCPU, resMem and resN count the creates placed here
	// since the last report, and those in flight (the pend* part, which a
	// report does not clear: the node may not have admitted them yet).
	resCPU, resMem   int64
	resN             int
	pendCPU, pendMem int64
	pendN            int
	refusedUntil     time.Time
}

// waiter is a create waiting for a slot.
type waiter struct {
	ready chan struct{} // closed when granted a slot
	done  bool          // granted (or gave up: removed)
}

// Engine places creates on nodes.
type Engine struct {
	cfg Config

	mu       sync.Mutex
	nodes    map[string]*nodeState
	order    []*nodeState // the nodes, for scans from a random start
	inflight int
	queued   int                  // waiting for a slot or for capacity
	tenants  map[string][]*waiter // waiting for a slot, FIFO per tenant
	rr       []string             // tenants with waiters, in turn order
	capacity chan struct{}        // closed (and replaced) when capacity may have grown
	stats    Stats
}

// New returns an engine with no nodes.
func New(cfg Config) *Engine {
	cfg.fill()
	return &Engine{cfg: cfg, nodes: map[string]*nodeState{}, tenants: map[string][]*waiter{}, capacity: make(chan struct{})}
}

// Update records a node's report, replacing the last one and the
// reservations of creates that ended before it (the report counts them);
// creates still in flight stay reserved.
func (e *Engine) Update(n Node) {
	st := &nodeState{Node: n, layers: make(map[string]bool, len(n.Layers)), backends: make(map[string]bool, len(n.Backends))}
	for _, l := range n.Layers {
		st.layers[l] = true
	}
	for _, b := range n.Backends {
		st.backends[b] = true
	}
	e.mu.Lock()
	if old := e.nodes[n.Name]; old != nil {
		st.refusedUntil = old.refusedUntil
		st.pendCPU, st.pendMem, st.pendN = old.pendCPU, old.pendMem, old.pendN
		st.resCPU, st.resMem, st.resN = old.pendCPU, old.pendMem, old.pendN
		e.order[slices.Index(e.order, old)] = st
	} else {
		e.order = append(e.order, st)
	}
	e.nodes[n.Name] = st
	e.wakeCapacityLocked()
	e.mu.Unlock()
}

// Remove forgets a node (its lease expired, or it left).
func (e *Engine) Remove(name string) {
	e.mu.Lock()
	if st := e.nodes[name]; st != nil {
		e.order = slices.DeleteFunc(e.order, func(x *nodeState) bool { return x == st })
	}
	delete(e.nodes, name)
	e.mu.Unlock()
}

// Nodes returns the names of the nodes known, sorted.
func (e *Engine) Nodes() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]string, 0, len(e.nodes))
	for n := range e.nodes {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// Stats returns the counts so far.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stats
}

// Release undoes the reservation of a create placed on node whose sandbox
// was deleted before the node's next report.
func (e *Engine) Release(node string, r Request) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if st := e.nodes[node]; st != nil {
		st.resCPU = max(st.resCPU-r.MilliCPU, 0)
		st.resMem = max(st.resMem-r.Memory, 0)
		st.resN = max(st.resN-1, 0)
		e.wakeCapacityLocked()
	}
}

func (e *Engine) wakeCapacityLocked() {
	close(e.capacity)
	e.capacity = make(chan struct{})
}

// ErrNoCapacity marks the refusal of a create that no node could hold
// before its deadline (also errdefs.ErrResourceExhausted).
var ErrNoCapacity = errors.New("no node has capacity")

// Place chooses a node for r and calls try with it; a refusal from try
// (an error of kind errdefs.ErrUnavailable) moves on to the next candidate,
// up to Config.MaxAttempts nodes; any other error of try is returned as
// it is. It returns the node that accepted. While no node can hold r,
// Place waits for capacity until ctx's deadline or Config.MaxWait.
func (e *Engine) Place(ctx context.Context, r Request, try func(ctx context.Context, node string) error) (string, error) {
	if r.MilliCPU < 0 || r.Memory < 0 {
		return "", errdefs.New(errdefs.ErrInvalidArgument, "negative CPU or memory")
	}
	ctx, cancel := context.WithTimeout(ctx, e.cfg.MaxWait)
	defer cancel()
	if err := e.enqueue(); err != nil {
		return "", err
	}
	defer e.dequeue()
	var lastRefusal error
	for {
		if err := e.acquire(ctx, r.Tenant); err != nil {
			return "", e.timedOut(r, lastRefusal, err)
		}
		node, err := e.attempt(ctx, r, try)
		e.releaseSlot()
		if err == nil {
			return node, nil
		}
		if !errors.Is(err, ErrNoCapacity) {
			return "", err
		}
		if errors.Is(err, errdefs.ErrUnavailable) {
			lastRefusal = err
		}
		// Wait for a report or a release, then decide again.
		e.mu.Lock()
		wake := e.capacity
		e.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return "", e.timedOut(r, lastRefusal, ctx.Err())
		}
	}
}

func (e *Engine) timedOut(r Request, refusal, err error) error {
	e.mu.Lock()
	e.stats.TimedOut++
	e.mu.Unlock()
	why := "no node can hold it"
	if refusal != nil {
		why = "the nodes tried refused it: " + refusal.Error()
	}
	return errdefs.Mark(errdefs.ErrResourceExhausted, fmt.Errorf("%w: a create of %d milli-CPUs and %d MiB waited until its deadline and %s (%w)", ErrNoCapacity, r.MilliCPU, r.Memory>>20, why, err))
}

// attempt makes one decision and tries its candidates. It returns an error
// wrapping ErrNoCapacity when no node could hold r or every one tried
// refused (the caller waits and decides again).
func (e *Engine) attempt(ctx context.Context, r Request, try func(ctx context.Context, node string) error) (string, error) {
	cands := e.Candidates(r, e.cfg.MaxAttempts)
	if len(cands) == 0 {
		e.mu.Lock()
		e.stats.NoCapacity++
		e.mu.Unlock()
		return "", ErrNoCapacity
	}
	var refusal error
	for i, node := range cands {
		if !e.reserve(node, r) {
			continue // taken meanwhile by another decision
		}
		if i > 0 {
			e.mu.Lock()
			e.stats.Retries++
			e.mu.Unlock()
		}
		err := try(ctx, node)
		e.settle(node, r, err == nil)
		if err == nil {
			e.mu.Lock()
			e.stats.Placed++
			e.mu.Unlock()
			return node, nil
		}
		if !errors.Is(err, errdefs.ErrUnavailable) || ctx.Err() != nil {
			return "", err
		}
		refusal = err
		e.mu.Lock()
		e.stats.Refusals++
		if st := e.nodes[node]; st != nil {
			st.refusedUntil = e.cfg.Now().Add(e.cfg.RefusalPenalty)
		}
		e.mu.Unlock()
	}
	if refusal == nil {
		return "", ErrNoCapacity
	}
	return "", fmt.Errorf("%w: %w", ErrNoCapacity, refusal)
}

// reserve counts r on node if it still fits there.
func (e *Engine) reserve(node string, r Request) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	st := e.nodes[node]
	if st == nil || !fits(st, r) {
		return false
	}
	st.resCPU += r.MilliCPU
	st.resMem += r.Memory
	st.resN++
	st.pendCPU += r.MilliCPU
	st.pendMem += r.Memory
	st.pendN++
	return true
}

// settle ends the flight of a reservation: a create that failed gives it
// back; one that succeeded keeps it until the node's next report.
func (e *Engine) settle(node string, r Request, ok bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	st := e.nodes[node]
	if st == nil {
		return
	}
	st.pendCPU = max(st.pendCPU-r.MilliCPU, 0)
	st.pendMem = max(st.pendMem-r.Memory, 0)
	st.pendN = max(st.pendN-1, 0)
	if !ok {
		st.resCPU = max(st.resCPU-r.MilliCPU, 0)
		st.resMem = max(st.resMem-r.Memory, 0)
		st.resN = max(st.resN-1, 0)
		e.wakeCapacityLocked()
	}
}

// fits reports whether st can hold r: the backend, and CPU and memory
// left after its reservations.
func fits(st *nodeState, r Request) bool {
	if st.Draining || (r.Backend != "" && !st.backends[r.Backend]) {
		return false
	}
	if st.MilliCPU > 0 && st.UsedMilliCPU+st.resCPU+r.MilliCPU > st.MilliCPU {
		return false
	}
	if st.Memory > 0 && st.UsedMemory+st.resMem+r.Memory > st.Memory {
		return false
	}
	return true
}

// score ranks a node that fits r: higher is better.
func (e *Engine) score(st *nodeState, r Request, now time.Time) float64 {
	free := 1.0
	if st.MilliCPU > 0 {
		free = min(free, float64(st.MilliCPU-st.UsedMilliCPU-st.resCPU-r.MilliCPU)/float64(st.MilliCPU))
	}
	if st.Memory > 0 {
		free = min(free, float64(st.Memory-st.UsedMemory-st.resMem-r.Memory)/float64(st.Memory))
	}
	if st.MilliCPU <= 0 && st.Memory <= 0 {
		// Unbounded node: spread by count alone.
		free = 1 / float64(1+st.Sandboxes+st.resN)
	}
	s := free
	if len(r.Layers) > 0 {
		held := 0
		for _, l := range r.Layers {
			if st.layers[l] {
				held++
			}
		}
		s += e.cfg.LocalityWeight * float64(held) / float64(len(r.Layers))
	}
	if now.Before(st.refusedUntil) {
		s -= 2 // below any node that did not refuse
	}
	return s
}

// Candidates returns up to n nodes that can hold r, best first. Ties go
// to the first node met by a scan that starts at a random node, so that
// control replicas deciding at once on the same reports do not all pick
// the same node.
func (e *Engine) Candidates(r Request, n int) []string {
	type cand struct {
		st    *nodeState
		score float64
	}
	now := e.cfg.Now()
	best := make([]cand, 0, n+1)
	e.mu.Lock()
	k := len(e.order)
	start := 0
	if k > 0 {
		start = rand.IntN(k)
	}
	for j := 0; j < k; j++ {
		st := e.order[(start+j)%k]
		if !fits(st, r) {
			continue
		}
		c := cand{st, e.score(st, r, now)}
		// Insert into the top n (n is small).
		i := len(best)
		for i > 0 && best[i-1].score < c.score {
			i--
		}
		if i >= n {
			continue
		}
		best = slices.Insert(best, i, c)
		if len(best) > n {
			best = best[:n]
		}
	}
	out := make([]string, len(best))
	for i, c := range best {
		out[i] = c.st.Name
	}
	e.mu.Unlock()
	return out
}

// enqueue counts a create in the queue, or refuses it when the queue is
// full.
func (e *Engine) enqueue() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.queued >= e.cfg.MaxQueue {
		e.stats.QueueFull++
		return errdefs.New(errdefs.ErrResourceExhausted, "placement queue full (%d creates waiting): retry later", e.queued)
	}
	e.queued++
	return nil
}

func (e *Engine) dequeue() {
	e.mu.Lock()
	e.queued--
	e.mu.Unlock()
}

// acquire waits for a decision slot, granted round-robin over tenants.
func (e *Engine) acquire(ctx context.Context, t string) error {
	e.mu.Lock()
	if e.inflight < e.cfg.Concurrency && len(e.rr) == 0 {
		e.inflight++
		e.mu.Unlock()
		return nil
	}
	w := &waiter{ready: make(chan struct{})}
	if len(e.tenants[t]) == 0 {
		e.rr = append(e.rr, t)
	}
	e.tenants[t] = append(e.tenants[t], w)
	e.grantLocked()
	e.mu.Unlock()
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
		e.mu.Lock()
		defer e.mu.Unlock()
		if w.done { // granted meanwhile: hand the slot on
			e.inflight--
			e.grantLocked()
			return ctx.Err()
		}
		w.done = true
		q := e.tenants[t]
		if i := slices.Index(q, w); i >= 0 {
			e.tenants[t] = slices.Delete(q, i, i+1)
		}
		if len(e.tenants[t]) == 0 {
			delete(e.tenants, t)
			if i := slices.Index(e.rr, t); i >= 0 {
				e.rr = slices.Delete(e.rr, i, i+1)
			}
		}
		return ctx.Err()
	}
}

// grantLocked hands free slots to waiters, one tenant at a time in turn.
func (e *Engine) grantLocked() {
	for e.inflight < e.cfg.Concurrency && len(e.rr) > 0 {
		t := e.rr[0]
		q := e.tenants[t]
		w := q[0]
		q = q[1:]
		e.rr = e.rr[1:]
		if len(q) == 0 {
			delete(e.tenants, t)
		} else {
			e.tenants[t] = q
			e.rr = append(e.rr, t) // its next waiter goes to the back of the turn
		}
		w.done = true
		e.inflight++
		close(w.ready)
	}
}

func (e *Engine) releaseSlot() {
	e.mu.Lock()
	e.inflight--
	e.grantLocked()
	e.mu.Unlock()
}
