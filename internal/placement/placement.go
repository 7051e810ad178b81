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
// A burst must not make the others wait even before the queue: 32,000
// creates arriving at once all go through Place. So the queue is kept off
// the engine's mutex (mu, which the decisions and the reports hold) and
// off any lock the arrivals would convoy on: each tenant's waiters are a
// lock-free queue (many arrivals push, the one holder of slotMu pops),
// the slots and the turn order are behind slotMu, and the queue's size is
// an atomic counter. A create that arrives while slots are taken pushes
// itself on its tenant's queue and takes slotMu only if it starts its
// tenant's turn or finds a slot free; each slot's release takes slotMu to
// hand the slot on. So a burst's creates never stand in line in front of
// another tenant's.
//
// Concurrency: an Engine is safe for concurrent use; mu guards the node
// state and the stats, slotMu the turn order and each queue's consumer
// side; mu is never held with slotMu.
package placement

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
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

// waiter is a create waiting for a slot, and its node in its tenant's
// queue.
type waiter struct {
	ready chan struct{} // closed when granted a slot
	state atomic.Int32  // waiting, granted or gaveUp
	next  atomic.Pointer[waiter]
}

const (
	waiting int32 = iota
	granted
	gaveUp // its create's context ended first; the queue drops it
)

// tenantQueue is one tenant's creates waiting for a slot, first come first
// served: an intrusive multi-producer, single-consumer queue (Vyukov's:
// a push is one atomic swap and one store, so arrivals never wait on each
// other) whose consumer is whoever holds Engine.slotMu.
type tenantQueue struct {
	tail atomic.Pointer[waiter]
	head *waiter      // the last popped (or the stub): guarded by slotMu
	n    atomic.Int64 // pushed and not popped yet (counted before linking)
	// inTurn: the queue is in Engine.turn (guarded by slotMu).
	inTurn bool
}

func newTenantQueue() *tenantQueue {
	stub := &waiter{}
	q := &tenantQueue{head: stub}
	q.tail.Store(stub)
	return q
}

// push adds w; it reports whether the queue was empty.
func (q *tenantQueue) push(w *waiter) bool {
	first := q.n.Add(1) == 1
	prev := q.tail.Swap(w)
	if h := testHookLinking.Load(); h != nil {
		(*h)(w)
	}
	prev.next.Store(w) // until here a pop sees the queue end at prev
	return first
}

// Test hooks (nil but in tests): testHookLinking runs in a push between
// taking the tail and linking the waiter; testHookGivingUp when a waiting
// create's context has ended, before it leaves the queue.
var testHookLinking, testHookGivingUp atomic.Pointer[func(*waiter)]

// popLive returns the first waiter still waiting, marked granted, dropping
// those that gave up; nil when the queue is empty or its next waiter is
// still being linked (its pusher then hands out free slots itself).
// slotMu held.
func (q *tenantQueue) popLive() *waiter {
	for {
		next := q.head.next.Load()
		if next == nil {
			return nil
		}
		q.head = next
		q.n.Add(-1)
		if next.state.CompareAndSwap(waiting, granted) {
			return next
		}
	}
}

// Engine places creates on nodes.
type Engine struct {
	cfg Config

	mu       sync.Mutex
	nodes    map[string]*nodeState
	order    []*nodeState  // the nodes, for scans from a random start
	capacity chan struct{} // closed (and replaced) when capacity may have grown
	stats    Stats

	queued  atomic.Int64 // creates in Place: waiting for a slot or for capacity, or deciding
	waiting atomic.Int64 // creates waiting for a slot
	// inflight: slots taken (written under slotMu, read without it).
	inflight atomic.Int64
	tenants  sync.Map // tenant name → *tenantQueue (kept: tenants are few)

	slotMu sync.Mutex
	turn   []*tenantQueue // the queues with waiters, in turn order
}

// New returns an engine with no nodes.
func New(cfg Config) *Engine {
	cfg.fill()
	return &Engine{cfg: cfg, nodes: map[string]*nodeState{}, capacity: make(chan struct{})}
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
	if err := e.offered(r.Backend); err != nil {
		return "", err
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

// offered refuses at once (invalid argument, as a node refuses it) a
// backend that none of the nodes the engine knows offers: waiting would
// not bring one (a node's backends come with its start). With no node at
// all (a cluster starting), it waits as for capacity.
func (e *Engine) offered(backend string) error {
	if backend == "" {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.nodes) == 0 {
		return nil
	}
	all := map[string]bool{}
	for _, st := range e.nodes {
		if st.backends[backend] {
			return nil
		}
		for b := range st.backends {
			all[b] = true
		}
	}
	names := make([]string, 0, len(all))
	for b := range all {
		names = append(names, b)
	}
	slices.Sort(names)
	return errdefs.New(errdefs.ErrInvalidArgument, "backend %q is not offered by any node of the cluster (offered: %s)", backend, strings.Join(names, ", "))
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
	for {
		q := e.queued.Load()
		if q >= int64(e.cfg.MaxQueue) {
			e.mu.Lock()
			e.stats.QueueFull++
			e.mu.Unlock()
			return errdefs.New(errdefs.ErrResourceExhausted, "placement queue full (%d creates waiting): retry later", q)
		}
		if e.queued.CompareAndSwap(q, q+1) {
			return nil
		}
	}
}

func (e *Engine) dequeue() { e.queued.Add(-1) }

func (e *Engine) queueOf(t string) *tenantQueue {
	if q, ok := e.tenants.Load(t); ok {
		return q.(*tenantQueue)
	}
	q, _ := e.tenants.LoadOrStore(t, newTenantQueue())
	return q.(*tenantQueue)
}

// acquire waits for a decision slot, granted round-robin over tenants.
func (e *Engine) acquire(ctx context.Context, t string) error {
	slots := int64(e.cfg.Concurrency)
	if e.waiting.Load() == 0 && e.inflight.Load() < slots {
		e.slotMu.Lock()
		if e.inflight.Load() < slots && len(e.turn) == 0 {
			e.inflight.Add(1)
			e.slotMu.Unlock()
			return nil
		}
		e.slotMu.Unlock()
	}
	tq := e.queueOf(t)
	w := &waiter{ready: make(chan struct{})}
	e.waiting.Add(1)
	first := tq.push(w)
	// The create that makes its tenant's queue non-empty puts the queue in
	// the turn; a create that finds a slot free hands the free slots out.
	// Otherwise every slot is taken, and the release of one, which comes
	// after this push, hands it on: no waiter is left behind a free slot.
	if first || e.inflight.Load() < slots {
		e.slotMu.Lock()
		if !tq.inTurn && tq.n.Load() > 0 {
			tq.inTurn = true
			e.turn = append(e.turn, tq)
		}
		e.grantLocked()
		e.slotMu.Unlock()
	}
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
		if h := testHookGivingUp.Load(); h != nil {
			(*h)(w)
		}
		if w.state.CompareAndSwap(waiting, gaveUp) {
			e.waiting.Add(-1) // its node leaves the queue at the next pop
			return ctx.Err()
		}
		e.releaseSlot() // granted meanwhile: hand the slot on
		return ctx.Err()
	}
}

// grantLocked hands free slots to waiters, one tenant at a time in turn. A
// queue whose waiter is still being linked keeps its turn (stalled: its
// pusher hands out free slots once linked); an empty one leaves the turn.
func (e *Engine) grantLocked() {
	stalled := 0
	for e.inflight.Load() < int64(e.cfg.Concurrency) && len(e.turn) > stalled {
		tq := e.turn[0]
		e.turn = e.turn[1:]
		w := tq.popLive()
		if w == nil && tq.n.Load() > 0 {
			e.turn = append(e.turn, tq)
			stalled++
			continue
		}
		if tq.n.Load() > 0 {
			e.turn = append(e.turn, tq) // its next waiter goes to the back of the turn
		} else {
			tq.inTurn = false
		}
		if w != nil {
			stalled = 0
			e.inflight.Add(1)
			e.waiting.Add(-1)
			close(w.ready)
		}
	}
}

func (e *Engine) releaseSlot() {
	e.slotMu.Lock()
	e.inflight.Add(-1)
	e.grantLocked()
	e.slotMu.Unlock()
}
