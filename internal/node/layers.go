package node

// Layer operations that need the node's knowledge of its sandboxes: which
// images they use (so that removing a layer or collecting garbage never
// takes one in use), environments (templates) resolved at creation, and
// commits of a sandbox's writable layer into a new layer.

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
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

// RemoveLayer removes a tag or an unused image (see layer.Store.Remove); an
// image a sandbox uses is never removed.
func (m *Manager) RemoveLayer(ref string) (layer.RemoveResult, error) {
	usage, err := m.LayerUsage()
	if err != nil {
		return layer.RemoveResult{}, err
	}
	return m.layers.Remove(ref, usage)
}

// GCLayers removes every image no tag, environment or sandbox uses and that
// is not mounted (see layer.Store.GC).
func (m *Manager) GCLayers(dryRun bool) (layer.GCResult, error) {
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
	if req.Base != "" {
		return errdefs.New(ErrInvalid, "give a template or a base, not both (environment %s has its own base)", req.Template)
	}
	env, err := m.layers.GetEnv(req.Template)
	if err != nil {
		return err
	}
	req.Base = env.Base
	req.Workspaces = append(slices.Clone(env.Workspaces), req.Workspaces...)
	req.Toolkits = append(slices.Clone(env.Toolkits), req.Toolkits...)
	return nil
}

// CommitLayer turns the writable layer of a running sandbox into a new
// workspace or toolkit layer (see layer.Store.Commit); o.Upper, o.Exclude
// and o.Origin are filled in here. The sandbox keeps running; the commit
// counts as activity for its idle timeout.
func (m *Manager) CommitLayer(ctx context.Context, id string, o layer.CommitOptions) (layer.Layer, error) {
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
	var over []string
	for _, l := range rec.Layers {
		over = append(over, l.Ref)
	}
	o.Upper = filepath.Join(dir, upperDirName)
	o.Exclude = append(slices.Clone(o.Exclude), reservedPaths...)
	o.Origin = fmt.Sprintf("commit of sandbox %s over %s", id, strings.Join(over, " + "))
	l, err := m.layers.Commit(ctx, o)
	if err != nil {
		return layer.Layer{}, fmt.Errorf("commit sandbox %s: %w", id, err)
	}
	m.log.Info("sandbox committed", "sandbox_id", id, "layer", l.Ref(), "digest", l.Digest)
	return l, nil
}
