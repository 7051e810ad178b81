package node

// Layer operations that need the node's knowledge of its sandboxes: which
// images they use (so that removing a layer or collecting garbage never
// takes one in use), environments (templates) resolved at creation, and
// commits of a sandbox's writable layer into a new layer.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// reservedPaths are the paths Shoal itself puts into a sandbox's root (the
// guest agent's mount point); a commit leaves them out.
var reservedPaths = []string{"/.shoal"}

// upperDirName is where a container sandbox's writable overlay layer lives
// in its directory (Handle.Data["dir"]).
const upperDirName = "upper"

// LayerUsage returns, for every image some sandbox of this node uses (in any
// state, including those still being created), the IDs of those sandboxes.
func (m *Manager) LayerUsage() (layer.Usage, error) {
	usage := layer.Usage{}
	add := func(rec *Record) {
		for _, l := range rec.Layers {
			if !slices.Contains(usage[l.Digest], rec.ID) {
				usage[l.Digest] = append(usage[l.Digest], rec.ID)
			}
		}
	}
	m.mu.Lock()
	for _, e := range m.sandboxes {
		add(&e.rec)
	}
	m.mu.Unlock()
	// A sandbox being created is persisted before it is in m.sandboxes.
	recs, err := loadRecords(m.db)
	if err != nil {
		return nil, fmt.Errorf("layer usage: %w", err)
	}
	for _, r := range recs {
		add(r)
	}
	for _, ids := range usage {
		slices.Sort(ids)
	}
	return usage, nil
}

// RemoveLayer removes a tag or an unused image as o may (see
// layer.View.Remove); an image a sandbox uses is never removed.
func (m *Manager) RemoveLayer(o layer.Owner, ref string) (layer.RemoveResult, error) {
	m.flushDeletes(context.Background()) // their layer mounts, released (reap.go)
	usage, err := m.LayerUsage()
	if err != nil {
		return layer.RemoveResult{}, err
	}
	return m.layers.As(o).Remove(ref, usage)
}

// GCLayers removes every image no tag, environment or sandbox uses and that
// is not mounted (see layer.Store.GC).
func (m *Manager) GCLayers(dryRun bool) (layer.GCResult, error) {
	m.flushDeletes(context.Background()) // their layer mounts, released (reap.go)
	usage, err := m.LayerUsage()
	if err != nil {
		return layer.GCResult{}, err
	}
	return m.layers.GC(usage, dryRun)
}

// applyTemplate fills a create request from its environment: the
// environment's base, its workspaces then the request's, its toolkits then
// the request's. Tags are left as they are, to be resolved by this create.
func (m *Manager) applyTemplate(req *CreateRequest) error {
	if req.Template == "" {
		return nil
	}
	if err := limits.String("template", req.Template, limits.IDBytes); err != nil {
		return err
	}
	if req.Base != "" {
		return errdefs.New(ErrInvalid, "give a template or a base, not both (environment %s has its own base)", req.Template)
	}
	env, err := m.layers.As(req.Owner).GetEnv(req.Template)
	if err != nil {
		return err
	}
	// A shared environment's references are the shared layers, whoever
	// creates from it; a tenant's are that tenant's (the admin's create
	// from it resolves as the tenant would).
	req.Owner = env.ResolvedBy(req.Owner)
	base, workspaces, toolkits := env.QualifiedRefs()
	req.Base = base
	req.image = env.Image // images.go
	if req.Backend == "" {
		req.Backend = env.Backend // "" still: the node's default
	}
	req.Workspaces = append(workspaces, req.Workspaces...)
	req.Toolkits = append(toolkits, req.Toolkits...)
	return nil
}

// CommitLayer turns the writable layer of a running sandbox into a new
// workspace or toolkit layer (see layer.Store.Commit); o.Upper, o.Exclude,
// o.Origin and o.Freeze are filled in here, and o.MaxBytes if zero (from
// Config.CommitMaxBytes). When its backend is a sandbox.Freezer the sandbox
// is frozen while its writable layer is copied (not while the image is
// built) and thawed whatever happens; otherwise it keeps running. Commits
// of one sandbox run one at a time. The commit counts as activity for its
// idle timeout.
func (m *Manager) CommitLayer(ctx context.Context, id string, o layer.CommitOptions) (layer.Layer, error) {
	// A paused sandbox is resumed first, like for any request.
	if _, _, err := m.Resume(ctx, id); err != nil {
		return layer.Layer{}, err
	}
	m.mu.Lock()
	e, err := m.lookup(id)
	if err != nil {
		m.mu.Unlock()
		return layer.Layer{}, err
	}
	if e.rec.State != StateRunning {
		m.mu.Unlock()
		return layer.Layer{}, errdefs.New(ErrNotRunning, "commit sandbox %s: it is %s; only a running sandbox can be committed", id, e.rec.State)
	}
	rec := e.rec
	e.running++
	if e.commit == nil {
		e.commit = make(chan struct{}, 1)
	}
	commit := e.commit
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		e.running--
		m.touchLocked(e)
		m.mu.Unlock()
	}()

	dir := rec.Handle.Data["dir"]
	if dir == "" {
		return layer.Layer{}, errdefs.New(ErrNotRunning, "commit sandbox %s: its %s backend keeps no writable layer on this node's disk", id, rec.Backend)
	}
	// One commit of a sandbox at a time: a freeze is not counted, the
	// first commit's thaw would end the second's.
	select {
	case commit <- struct{}{}:
		defer func() { <-commit }()
	case <-ctx.Done():
		return layer.Layer{}, fmt.Errorf("commit sandbox %s: waiting for its other commit: %w", id, ctx.Err())
	}
	// A pause (which holds the same slot) may have come first.
	m.mu.Lock()
	st := e.rec.State
	m.mu.Unlock()
	if st != StateRunning {
		return layer.Layer{}, errdefs.New(ErrNotRunning, "commit sandbox %s: it was %s meanwhile; try again", id, st)
	}
	var over []string
	for _, l := range rec.Layers {
		over = append(over, l.Ref)
	}
	if c, ok := m.backends[rec.Backend].(sandbox.Committer); ok {
		wl, err := c.WritableLayer(rec.Handle)
		if errors.Is(err, sandbox.ErrUnsupported) {
			return layer.Layer{}, errdefs.New(ErrNotRunning, "commit sandbox %s: its %s backend cannot commit: %s", id, rec.Backend, err)
		}
		if err != nil {
			return layer.Layer{}, fmt.Errorf("commit sandbox %s: %w", id, err)
		}
		o.Upper = wl.Dir
		if export := wl.Export; export != nil {
			// Inside the sandbox (a VM's guest): streamed by the backend,
			// which stops the sandbox's writers itself (no Freeze).
			o.Export = func(ctx context.Context, maxDepth int) (io.ReadCloser, error) {
				rc, err := export(ctx, maxDepth)
				if errors.Is(err, sandbox.ErrUnsupported) {
					return nil, errdefs.New(ErrNotRunning, "its %s backend cannot commit: %s", rec.Backend, err)
				}
				return rc, err
			}
		}
	} else {
		o.Upper = rec.Handle.Data["upper"] // where the backend put it (on a disk image, say)
		if o.Upper == "" {
			o.Upper = filepath.Join(dir, upperDirName)
		}
	}
	o.IDMap = rec.Handle.IDMap // the upper holds host ids of the sandbox's range
	o.Exclude = append(slices.Clone(o.Exclude), reservedPaths...)
	o.Origin = fmt.Sprintf("commit of sandbox %s over %s", id, strings.Join(over, " + "))
	if o.MaxBytes == 0 {
		o.MaxBytes = m.cfg.CommitMaxBytes
	}
	thaw := func() {}
	defer func() { thaw() }() // the layer store thaws after the copy; this is in case it did not
	o.Freeze = func(ctx context.Context) (func(), error) {
		f, ok := m.backends[rec.Backend].(sandbox.Freezer)
		if !ok {
			return nil, nil
		}
		if err := f.Freeze(ctx, rec.Handle); err != nil {
			if errors.Is(err, sandbox.ErrUnsupported) {
				m.log.Warn("commit of a sandbox that cannot be frozen", "sandbox_id", id, "err", err)
				return nil, nil
			}
			if ctx.Err() != nil {
				return nil, err
			}
			return nil, errdefs.Mark(errdefs.ErrUnavailable, err)
		}
		frozen := time.Now()
		thaw = sync.OnceFunc(func() {
			// Not ctx: a cancelled commit must thaw too.
			tctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := f.Thaw(tctx, rec.Handle); err != nil {
				m.log.Error("thaw sandbox after commit", "sandbox_id", id, "err", err)
				return
			}
			m.log.Debug("sandbox thawed after commit", "sandbox_id", id, "frozen_for", time.Since(frozen))
		})
		return thaw, nil
	}
	l, err := m.layers.Commit(ctx, o)
	if err != nil {
		return layer.Layer{}, fmt.Errorf("commit sandbox %s: %w", id, err)
	}
	m.log.Info("sandbox committed", "sandbox_id", id, "layer", l.Ref(), "digest", l.Digest)
	return l, nil
}
