package node

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/boltgroup"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Pause and resume.
//
// A sandbox is running, or paused (its backend's sandbox.Pauser stopped its
// processes and reclaimed their memory). The state is persisted: a node that
// restarts keeps a paused sandbox paused (Recover). At most one pause or
// resume of a sandbox is in flight (entry.trans); every caller that needs
// the sandbox's agent meanwhile waits for it to end, and every request that
// needs the agent of a paused sandbox resumes it first (Agent), concurrent
// ones sharing one resume. A pause also takes the sandbox's commit slot, so
// a commit's freeze and thaw never overlap it.
//
// The idle clocks: a paused sandbox's idle timeout is suspended (a paused
// E2B sandbox does not time out either); it is deleted only when it stays
// paused for Config.PausedTimeout (default 24 h). A resume restarts its
// idle clock, as any request does.

const (
	// pauseTimeout and resumeTimeout bound a pause or resume when the
	// caller's context has no deadline (the idle policy, Agent).
	pauseTimeout  = 2 * time.Minute
	resumeTimeout = 30 * time.Second
)

// Pause pauses a running sandbox: its processes stop where they are and
// its memory is reclaimed, as far as its backend can. Pausing a paused
// sandbox returns its record unchanged with paused false. A backend that
// cannot pause gives failed_precondition.
func (m *Manager) Pause(ctx context.Context, id string) (rec Record, paused bool, err error) {
	return m.pause(ctx, id, pauseRequest)
}

// PauseFSOnly pauses a running sandbox without its processes (E2B's
// keepMemory: false): every process but its agent ends (its commands and
// shells are closed, as by a reset, OnEndProcesses), then it is paused as
// by Pause; its resume has its files and none of its processes. A backend
// that cannot end them gives unimplemented.
func (m *Manager) PauseFSOnly(ctx context.Context, id string) (rec Record, paused bool, err error) {
	return m.pause(ctx, id, pauseFSOnly)
}

// OnEndProcesses registers fn, called with a sandbox's ID before a
// file-system-only pause ends its processes. Set before serving.
func (m *Manager) OnEndProcesses(fn func(id string)) { m.onEnd = append(m.onEnd, fn) }

// Why a sandbox is paused.
type pauseReason int

const (
	pauseRequest    pauseReason = iota // a client asked
	pauseIdle                          // the idle policy: AutoPause
	pausePressure                      // the host's memory ran low (pressure.go)
	pauseFSOnly                        // a client asked, without the processes
	pauseIdleFSOnly                    // the idle policy, without the processes (E2B's auto-pause keepMemory: false)
)

func (m *Manager) pause(ctx context.Context, id string, why pauseReason) (Record, bool, error) {
	auto := why != pauseRequest && why != pauseFSOnly
	fsOnly := why == pauseFSOnly || why == pauseIdleFSOnly
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, pauseTimeout)
		defer cancel()
	}
	m.mu.Lock()
	e, err := m.lookup(id)
	if err != nil {
		m.mu.Unlock()
		return Record{}, false, err
	}
	p, ok := m.backends[e.rec.Backend].(sandbox.Pauser)
	if !ok {
		m.mu.Unlock()
		return Record{}, false, errdefs.New(ErrNotRunning, "sandbox %s: its %s backend cannot pause sandboxes", id, e.rec.Backend)
	}
	ender, _ := m.backends[e.rec.Backend].(sandbox.ProcessEnder)
	if fsOnly && ender == nil {
		m.mu.Unlock()
		return Record{}, false, errdefs.New(errdefs.ErrUnimplemented, "sandbox %s: its %s backend cannot pause without its processes (keepMemory: false); pause it with its memory, or reset it", id, e.rec.Backend)
	}
	if e.commit == nil {
		e.commit = make(chan struct{}, 1)
	}
	slot := e.commit
	m.mu.Unlock()
	// No commit (which freezes and thaws) while pausing.
	select {
	case slot <- struct{}{}:
		defer func() { <-slot }()
	case <-ctx.Done():
		return Record{}, false, fmt.Errorf("pause sandbox %s: waiting for its commit: %w", id, ctx.Err())
	}
	e, err = m.settle(ctx, id)
	if err != nil {
		return Record{}, false, err
	}
	defer m.mu.Unlock() // settle returns locked
	switch {
	case e.rec.State == StatePaused:
		return e.rec, false, nil
	case e.deleted != nil:
		return Record{}, false, errdefs.New(ErrNotFound, "sandbox %s is being deleted", id)
	case e.rec.State != StateRunning:
		return Record{}, false, errdefs.New(ErrNotRunning, "pause sandbox %s: it is %s", id, e.rec.State)
	case auto && e.running > 0,
		(why == pauseIdle || why == pauseIdleFSOnly) && time.Since(e.lastActive) < e.rec.AutoPause,
		why == pausePressure && time.Since(e.lastActive) < m.cfg.Pressure.MinIdle:
		return e.rec, false, nil // it became busy meanwhile
	}
	done := make(chan struct{})
	e.trans = done
	h := e.rec.Handle
	m.mu.Unlock()

	start := time.Now()
	var stats sandbox.PauseStats
	var perr error
	if fsOnly {
		for _, fn := range m.onEnd {
			fn(id)
		}
		perr = ender.EndProcesses(ctx, h)
	}
	if perr == nil {
		stats, perr = p.Pause(ctx, h)
	}

	m.mu.Lock()
	e.trans = nil
	close(done)
	if perr != nil {
		m.log.Warn("pause failed", "sandbox_id", id, "err", perr)
		if ctx.Err() == nil {
			perr = errdefs.Mark(errdefs.ErrUnavailable, perr)
		}
		return Record{}, false, fmt.Errorf("pause sandbox %s: %w", id, perr)
	}
	if e.deleted != nil {
		return Record{}, false, errdefs.New(ErrNotFound, "sandbox %s was deleted while it was paused", id)
	}
	now := time.Now().UTC()
	e.rec.State = StatePaused
	e.rec.Pause = &PauseInfo{At: now, Auto: auto, Stats: stats, FSOnly: fsOnly}
	e.rec.Expires = now.Add(m.cfg.PausedTimeout)
	e.dirty = false
	stored := e.persisted()
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, &stored) }); err != nil {
		// Still paused in memory; a restart finds it running and thaws it.
		m.log.Error("persist paused sandbox", "sandbox_id", id, "err", err)
	}
	m.cfg.Metrics.Pause(e.rec.Backend, auto, time.Since(start), stats.MemoryBefore-stats.MemoryAfter)
	m.log.Info("sandbox paused", "sandbox_id", id, "auto", auto, "fs_only", fsOnly, "pressure", why == pausePressure, "took", time.Since(start),
		"memory_before", stats.MemoryBefore, "memory_after", stats.MemoryAfter, "method", stats.Method,
		"freeze_took", stats.FreezeTook, "reclaim_took", stats.ReclaimTook)
	return e.rec, true, nil
}

// settle waits until no pause or resume of the sandbox is in flight and
// returns its entry with m.mu held.
func (m *Manager) settle(ctx context.Context, id string) (*entry, error) {
	for {
		m.mu.Lock()
		e, err := m.lookup(id)
		if err != nil {
			m.mu.Unlock()
			return nil, err
		}
		if e.trans == nil {
			return e, nil
		}
		ch := e.trans
		m.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, fmt.Errorf("sandbox %s: waiting for its pause or resume: %w", id, ctx.Err())
		}
	}
}

// evict moves a paused sandbox's memory off the host (sandbox.Evicter),
// for memory pressure, and tells whether it did. The sandbox stays
// paused; one evicted already, or whose backend cannot, is left alone.
func (m *Manager) evict(ctx context.Context, id string) (bool, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, pauseTimeout)
		defer cancel()
	}
	e, err := m.settle(ctx, id)
	if err != nil {
		return false, err
	}
	ev, ok := m.backends[e.rec.Backend].(sandbox.Evicter)
	if !ok || e.rec.State != StatePaused || e.deleted != nil || e.rec.Pause == nil || e.rec.Pause.Evicted {
		m.mu.Unlock()
		return false, nil
	}
	done := make(chan struct{})
	e.trans = done
	h := e.rec.Handle
	m.mu.Unlock()

	start := time.Now()
	stats, evicted, err := ev.Evict(ctx, h)

	m.mu.Lock()
	defer m.mu.Unlock()
	e.trans = nil
	close(done)
	if err != nil {
		return false, fmt.Errorf("evict paused sandbox %s: %w", id, err)
	}
	if e.deleted != nil || e.rec.Pause == nil {
		return false, nil
	}
	pi := *e.rec.Pause // a new one: records handed out share the old
	pi.Evicted = true  // nothing to move is not tried again either
	if evicted {
		pi.Evict = &stats
	}
	e.rec.Pause = &pi
	stored := e.persisted()
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, &stored) }); err != nil {
		m.log.Error("persist evicted sandbox", "sandbox_id", id, "err", err)
	}
	if evicted {
		m.log.Info("paused sandbox evicted", "sandbox_id", id, "took", time.Since(start),
			"memory_before", stats.MemoryBefore, "memory_after", stats.MemoryAfter, "method", stats.Method)
	}
	return evicted, nil
}

// Resume resumes a paused sandbox and returns its record (resumed false
// when it was not paused). Concurrent resumes of one sandbox share one.
func (m *Manager) Resume(ctx context.Context, id string) (rec Record, resumed bool, err error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, resumeTimeout)
		defer cancel()
	}
	e, err := m.settle(ctx, id)
	if err != nil {
		return Record{}, false, err
	}
	defer m.mu.Unlock()
	if e.rec.State != StatePaused {
		if e.rec.State == StateRunning {
			m.touchLocked(e)
		}
		return e.rec, false, nil
	}
	if e.deleted != nil {
		return Record{}, false, errdefs.New(ErrNotFound, "sandbox %s is being deleted", id)
	}
	p, ok := m.backends[e.rec.Backend].(sandbox.Pauser)
	if !ok {
		return Record{}, false, errdefs.New(ErrNotRunning, "sandbox %s: its %s backend cannot resume sandboxes", id, e.rec.Backend)
	}
	done := make(chan struct{})
	e.trans = done
	h := e.rec.Handle
	m.mu.Unlock()

	start := time.Now()
	nh, rerr := p.Resume(ctx, h)
	took := time.Since(start)
	inPlace := sameHandle(nh, h)

	m.mu.Lock()
	e.trans = nil
	close(done)
	if rerr != nil {
		m.log.Warn("resume failed", "sandbox_id", id, "err", rerr)
		if ctx.Err() == nil {
			rerr = errdefs.Mark(errdefs.ErrUnavailable, rerr)
		}
		return Record{}, false, fmt.Errorf("resume sandbox %s: %w", id, rerr)
	}
	if e.deleted != nil {
		return Record{}, false, errdefs.New(ErrNotFound, "sandbox %s was deleted while it was resumed", id)
	}
	if be := m.backends[e.rec.Backend]; nh.AgentSocket != h.AgentSocket {
		e.agent = m.agentClient(be, nh)
	} else if _, ok := be.(sandbox.AgentDialer); ok {
		e.agent = m.agentClient(be, nh)
	}
	if nh.Data == nil {
		nh.Data = map[string]string{}
	}
	if nh.Data["dir"] == "" {
		nh.Data["dir"] = h.Data["dir"]
	}
	e.rec.Handle = nh
	e.rec.State = StateRunning
	if e.rec.Pause != nil {
		pi := *e.rec.Pause
		pi.ResumedAt, pi.ResumeTook = time.Now().UTC(), took
		e.rec.Pause = &pi
	}
	m.touchLocked(e)
	// A resume in place is persisted by the next flush (touchLocked marked
	// it dirty), not on the way to the request that resumed it: a node
	// that dies before then finds it paused in the store, and Recover
	// pauses it again where it is (its handle is the same).
	if !inPlace {
		e.dirty = false
		stored := e.persisted()
		if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, &stored) }); err != nil {
			m.log.Error("persist resumed sandbox", "sandbox_id", id, "err", err)
		}
	}
	m.cfg.Metrics.Resume(e.rec.Backend, took)
	m.log.Info("sandbox resumed", "sandbox_id", id, "took", took)
	return e.rec, true, nil
}

// Paused reports whether a sandbox is paused or being paused or resumed:
// its agent does not answer now, and will once it is resumed.
func (m *Manager) Paused(id string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.sandboxes[id]
	return ok && e.deleted == nil && (e.rec.State == StatePaused || e.trans != nil)
}

// Client returns the agent client of a running or paused sandbox without
// resuming it and without counting activity: for the session layer's
// pumps, which wait across a pause.
func (m *Manager) Client(id string) (*agent.Client, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	if e.rec.State != StateRunning && e.rec.State != StatePaused {
		return nil, notRunning(e)
	}
	return e.agent, nil
}

func notRunning(e *entry) error {
	if e.rec.Error != "" {
		return errdefs.New(ErrNotRunning, "sandbox %s is %s: %s", e.rec.ID, e.rec.State, e.rec.Error)
	}
	return errdefs.New(ErrNotRunning, "sandbox %s is %s", e.rec.ID, e.rec.State)
}

// autoPause pauses sandboxes idle for their AutoPause (the idle policy);
// ids come from expired.
func (m *Manager) autoPause(ids []string) {
	if !m.autoPausing.CompareAndSwap(false, true) {
		return // the last round is still pausing; the next tick retries
	}
	defer m.autoPausing.Store(false)
	for _, id := range ids {
		_, paused, err := m.pause(context.Background(), id, pauseIdle)
		switch {
		case err != nil && !errors.Is(err, ErrNotFound):
			m.log.Warn("auto-pause", "sandbox_id", id, "err", err)
		case paused:
			m.log.Debug("sandbox auto-paused", "sandbox_id", id)
		}
	}
}

// sameHandle tells whether a resume left the sandbox's handle as it was (a
// container thawed, a VM continued in place) rather than making a new one
// (a VM restored from its snapshot into a new process).
func sameHandle(a, b sandbox.Handle) bool {
	return a.AgentSocket == b.AgentSocket && maps.Equal(a.Data, b.Data) &&
		(a.IDMap == nil) == (b.IDMap == nil) && (a.IDMap == nil || *a.IDMap == *b.IDMap)
}
