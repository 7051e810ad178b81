package node

import (
	"context"
	"fmt"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/boltgroup"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// resetTimeout bounds a reset when the caller's context has no deadline.
const resetTimeout = 30 * time.Second

// OnReset registers fn, called with a sandbox's ID when a reset of it
// begins, before its backend kills its processes (the session manager
// closes its commands and shells with the reason "reset"). Set before
// serving.
func (m *Manager) OnReset(fn func(id string)) { m.onReset = append(m.onReset, fn) }

// Reset brings a sandbox back to its start, in place (sandbox.Resetter):
// every process but its agent ends, its writable layer is replaced by an
// empty one over the same layers, its commands and shells are closed with
// the reason "reset", and it keeps its ID, limits, network and address. A
// paused sandbox is resumed first. It returns the record and how long the
// backend's reset took. A backend that cannot reset gives unimplemented;
// a reset that failed gives unavailable and keeps the old handle: the
// sandbox may have lost its processes, and, failed during the root
// switch, its root (its agent then stops answering and the prober reports
// it in error); delete it.
func (m *Manager) Reset(ctx context.Context, id string) (Record, time.Duration, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, resetTimeout)
		defer cancel()
	}
	if _, _, err := m.Resume(ctx, id); err != nil {
		return Record{}, 0, err
	}
	m.mu.Lock()
	e, err := m.lookup(id)
	if err != nil {
		m.mu.Unlock()
		return Record{}, 0, err
	}
	be := m.backends[e.rec.Backend]
	r, ok := be.(sandbox.Resetter)
	if !ok {
		m.mu.Unlock()
		return Record{}, 0, errdefs.New(errdefs.ErrUnimplemented, "reset sandbox %s: its %s backend cannot reset a sandbox in place; delete it and create another (a pooled create)", id, e.rec.Backend)
	}
	if e.commit == nil {
		e.commit = make(chan struct{}, 1)
	}
	slot := e.commit
	m.mu.Unlock()
	// No commit (which freezes and thaws) or pause while resetting.
	select {
	case slot <- struct{}{}:
		defer func() { <-slot }()
	case <-ctx.Done():
		return Record{}, 0, fmt.Errorf("reset sandbox %s: waiting for its commit: %w", id, ctx.Err())
	}
	e, err = m.settle(ctx, id)
	if err != nil {
		return Record{}, 0, err
	}
	switch {
	case e.deleted != nil:
		m.mu.Unlock()
		return Record{}, 0, errdefs.New(ErrNotFound, "sandbox %s is being deleted", id)
	case e.rec.State != StateRunning:
		st := e.rec.State
		m.mu.Unlock()
		return Record{}, 0, errdefs.New(ErrNotRunning, "reset sandbox %s: it is %s", id, st)
	}
	// Callers that need its agent wait for the reset (as for a resume).
	done := make(chan struct{})
	e.trans = done
	rec := e.rec
	m.mu.Unlock()

	for _, fn := range m.onReset {
		fn(id)
	}
	spec, release, err := m.resetSpec(rec)
	var nh sandbox.Handle
	start := time.Now()
	if err == nil {
		nh, err = r.Reset(ctx, rec.Handle, spec)
		release()
	}
	took := time.Since(start)

	m.mu.Lock()
	defer m.mu.Unlock()
	e.trans = nil
	close(done)
	if err != nil {
		m.log.Warn("reset failed", "sandbox_id", id, "err", err)
		if ctx.Err() == nil {
			err = errdefs.Mark(errdefs.ErrUnavailable, err)
		}
		return Record{}, took, fmt.Errorf("reset sandbox %s: %w", id, err)
	}
	if e.deleted != nil {
		return Record{}, took, errdefs.New(ErrNotFound, "sandbox %s was deleted while it was reset", id)
	}
	if nh.Data == nil {
		nh.Data = map[string]string{}
	}
	if nh.Data["dir"] == "" {
		nh.Data["dir"] = rec.Handle.Data["dir"]
	}
	e.rec.Handle = nh
	e.agent = m.agentClient(be, nh)
	m.touchLocked(e)
	e.dirty = false
	stored := e.persisted()
	if err := boltgroup.Update(m.db, func(tx *bbolt.Tx) error { return putRecord(tx, &stored) }); err != nil {
		m.log.Error("persist reset sandbox", "sandbox_id", id, "err", err)
	}
	m.log.Info("sandbox reset", "sandbox_id", id, "took", took)
	return e.rec, took, nil
}

// resetSpec is the spec a backend resets rec's sandbox to: its layers (held
// until release), resources, environment and network, as at its create.
func (m *Manager) resetSpec(rec Record) (sandbox.Spec, func(), error) {
	be := m.backends[rec.Backend]
	spec := sandbox.Spec{
		ID:          rec.ID,
		Dir:         rec.Handle.Data["dir"],
		Resources:   rec.Resources,
		AgentBinary: m.cfg.AgentBinary,
		Env:         envList(rec.Env),
		Network:     rec.Network,
	}
	var held []string
	release := func() {
		for _, d := range held {
			m.layers.Release(d)
		}
	}
	hostMounts := be.Capabilities().HostLayerMounts
	for _, l := range rec.Layers {
		sl := sandbox.Layer{Digest: l.Digest, Kind: l.Kind, ImagePath: m.layers.ImagePath(l.Digest)}
		if hostMounts {
			p, err := m.layers.Acquire(l.Digest)
			if err != nil {
				release()
				return spec, nil, fmt.Errorf("mount layer %s: %w", l.Ref, err)
			}
			held = append(held, l.Digest)
			sl.MountPath = p
		}
		spec.Layers = append(spec.Layers, sl)
	}
	return spec, release, nil
}
