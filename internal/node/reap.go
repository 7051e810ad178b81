package node

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/boltgroup"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Deferred teardown.
//
// A delete is answered once the sandbox is recorded as deleting (durably)
// and frozen (sandbox.Freezer): none of its processes runs again, and it is
// gone from every lookup and listing. Its teardown — killing its tasks,
// whose exits the kernel then works through (memory, namespaces), removing
// its cgroups, mounts, writable layer, dir and record — cost a rollout of a
// burst more CPU than its create, and is left to the reaper, which does it
// after the burst: while a create is in flight, or one began less than
// reapYield ago, it waits, unless half of the backlog is used. At most
// Config.DeleteBacklog sandboxes wait; a delete past that tears down before
// it answers, as does every delete on a backend that cannot freeze, one
// whose freeze fails, and every delete before Run (or after it ended). A
// teardown that keeps failing puts the sandbox back in the listings, in
// error, to be deleted again. A node that stops with a backlog tears it
// down at its next start (Recover: the store says deleting).
//
// A sandbox waiting for its teardown is not counted by admission: it runs
// nothing, and the backlog bounds what it holds (memory, its slot of the
// user namespace ranges, its disk).

// DefaultDeleteBacklog is Config.DeleteBacklog's default.
const DefaultDeleteBacklog = 64

// Tuning; variables so that tests can shorten them.
var (
	// reapYield: the reaper waits until no create began for this long.
	reapYield = 250 * time.Millisecond
	// parkFreezeTimeout bounds the freeze of a delete that defers its
	// teardown: past it, the delete tears down itself.
	parkFreezeTimeout = 2 * time.Second
	// reapAttempts: teardowns of one sandbox, reapRetry apart (doubling),
	// before it is put back in error.
	reapAttempts = 3
	reapRetry    = time.Second
)

// reaper holds the deleted sandboxes waiting for their teardown.
type reaper struct {
	// run is held by whoever tears down a parked sandbox (the reaper, a
	// flush), so that a flush also waits for the teardown in flight.
	run   sync.Mutex
	mu    sync.Mutex
	on    bool       // guarded by mu; Run is running: deletes may be parked
	held  int        // guarded by mu; slots taken (parked, or being parked)
	queue []reapItem // guarded by mu; oldest first
	wake  chan struct{}
}

type reapItem struct {
	rec     Record
	release bool // its layer mounts are held (entry.acquired)
}

// startReaper lets deletes park their sandboxes until ctx ends, and tears
// the parked ones down; wait returns once it stopped.
func (m *Manager) startReaper(ctx context.Context) (wait func()) {
	if m.cfg.DeleteBacklog <= 0 {
		return func() {}
	}
	m.reap.mu.Lock()
	m.reap.on = true
	m.reap.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		m.reapLoop(ctx)
	}()
	return func() { <-done }
}

// park freezes a sandbox recorded as deleting and queues its teardown. It
// reports false, having done nothing, when the delete must tear down
// itself.
func (m *Manager) park(ctx context.Context, rec *Record, release bool) bool {
	f, ok := m.backends[rec.Backend].(sandbox.Freezer)
	if !ok {
		return false
	}
	r := &m.reap
	r.mu.Lock()
	if !r.on || r.held >= m.cfg.DeleteBacklog {
		r.mu.Unlock()
		return false
	}
	r.held++
	r.mu.Unlock()
	fctx, cancel := context.WithTimeout(ctx, parkFreezeTimeout)
	err := f.Freeze(fctx, rec.Handle)
	cancel()
	r.mu.Lock()
	switch {
	case err == nil && r.on:
		r.queue = append(r.queue, reapItem{rec: *rec, release: release})
	case err == nil:
		r.held--
		err = errors.New("the reaper stopped")
	default:
		r.held--
	}
	r.mu.Unlock()
	if err != nil {
		m.log.Debug("delete tears down at once", "sandbox_id", rec.ID, "err", err)
		return false
	}
	select {
	case r.wake <- struct{}{}:
	default:
	}
	return true
}

// reapBacklog returns the backends of the parked sandboxes.
func (m *Manager) reapBacklog() []string {
	r := &m.reap
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, len(r.queue))
	for i, it := range r.queue {
		out[i] = it.rec.Backend
	}
	return out
}

// reapLoop tears the parked sandboxes down, oldest first, one at a time,
// until ctx ends (what is left is Recover's at the next start).
func (m *Manager) reapLoop(ctx context.Context) {
	r := &m.reap
	defer func() {
		r.mu.Lock()
		r.on = false
		r.mu.Unlock()
	}()
	for {
		r.mu.Lock()
		have := len(r.queue) > 0
		half := 2*r.held >= m.cfg.DeleteBacklog
		r.mu.Unlock()
		var wait <-chan time.Time
		if have && !half {
			if d := m.reapWait(); d > 0 {
				wait = time.After(d)
			}
		}
		if !have || wait != nil {
			select {
			case <-ctx.Done():
				return
			case <-r.wake:
			case <-wait:
			}
			continue
		}
		m.reapNext(ctx)
	}
}

// reapNext tears down the oldest parked sandbox, if any, and reports
// whether there was one.
func (m *Manager) reapNext(ctx context.Context) bool {
	r := &m.reap
	r.run.Lock()
	defer r.run.Unlock()
	r.mu.Lock()
	if len(r.queue) == 0 {
		r.mu.Unlock()
		return false
	}
	it := r.queue[0]
	r.mu.Unlock()
	err := m.reapOne(ctx, &it)
	r.mu.Lock()
	r.queue = r.queue[1:]
	r.held--
	r.mu.Unlock()
	if err != nil && ctx.Err() == nil {
		m.reinstate(it, err)
	}
	return true
}

// flushDeletes tears the backlog down now, and waits for the teardown in
// flight (reapNext takes its lock first): what a delete answered is then
// done on the host too (the layer mounts its sandboxes held are released,
// for a layer rm or gc).
func (m *Manager) flushDeletes(ctx context.Context) {
	for m.reapNext(ctx) {
	}
}

// reapWait is how long the reaper should still wait for the creates.
func (m *Manager) reapWait() time.Duration {
	m.mu.Lock()
	creating := len(m.admitting)
	m.mu.Unlock()
	if creating > 0 {
		return reapYield
	}
	return time.Until(time.Unix(0, m.lastCreate.Load()).Add(reapYield))
}

// reapOne tears one parked sandbox down, trying again a few times.
func (m *Manager) reapOne(ctx context.Context, it *reapItem) error {
	delay := reapRetry
	for attempt := 1; ; attempt++ {
		// One the node's stop interrupts is finished at its next start.
		tctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
		err := m.teardown(tctx, &it.rec, it.release)
		cancel()
		if err == nil {
			m.log.Debug("sandbox torn down", "sandbox_id", it.rec.ID)
			return nil
		}
		m.log.Warn("tear down deleted sandbox", "sandbox_id", it.rec.ID, "attempt", attempt, "err", err)
		if attempt >= reapAttempts || ctx.Err() != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(delay):
		}
		delay *= 2
	}
}

// reinstate puts back, in error, a deleted sandbox whose teardown failed:
// it is listed again, and a delete tries again.
func (m *Manager) reinstate(it reapItem, cause error) {
	rec := it.rec
	rec.State, rec.Error = StateError, "delete: "+cause.Error()
	m.log.Error("deleted sandbox could not be torn down: listed again, in error", "sandbox_id", rec.ID, "err", cause)
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, &rec) }); err != nil {
		m.log.Error("persist sandbox", "sandbox_id", rec.ID, "err", err)
	}
	e := &entry{rec: rec, acquired: it.release, lastActive: time.Now()}
	if be, ok := m.backends[rec.Backend]; ok {
		e.agent = m.agentClient(be, rec.Handle)
	}
	m.mu.Lock()
	m.sandboxes[rec.ID] = e
	m.mu.Unlock()
}
