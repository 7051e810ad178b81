package cluster

// Environments (named stacks of layer references, layer.Env) are cluster
// state: one key per environment in etcd, written in one transaction
// through any control replica or node, and mirrored by every node into its
// own layer store (where its creates and its E2B templates resolve them,
// and where its garbage collection sees the layers they name).
//
//	envs/<name>            layer.Env as JSON; the key's ModRevision is the
//	                       environment's revision, which a conditional
//	                       replace names
//	envs/<tenant>/<name>   a tenant's (layer.Env.Key: tenants own their
//	                       environments; those without a tenant are shared)

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
)

const envsPrefix = Prefix + "envs/"

// Env is an environment as etcd has it: the stack, and the revision of its
// last write.
type Env struct {
	layer.Env
	Revision int64
}

// PutEnv writes an environment in one transaction. Without replace, an
// environment of that name already there is refused (already exists);
// with replace and ifRevision > 0, the environment must still be at that
// revision (else failed precondition: someone else changed it). The
// layers are not checked here: the caller checks them first.
func PutEnv(ctx context.Context, cli *clientv3.Client, e layer.Env, replace bool, ifRevision int64) (Env, error) {
	if err := layer.CheckEnv(e); err != nil {
		return Env{}, err
	}
	if ifRevision < 0 || ifRevision > 0 && !replace {
		return Env{}, errdefs.New(errdefs.ErrInvalidArgument, "environment %s: a revision to replace is for a replace", e.Name)
	}
	if e.Created.IsZero() {
		e.Created = time.Now().UTC().Truncate(time.Millisecond)
	}
	e.Mirrored = 0
	v, err := json.Marshal(e)
	if err != nil {
		return Env{}, err
	}
	k := envsPrefix + e.Key()
	var cmps []clientv3.Cmp
	switch {
	case !replace:
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(k), "=", 0))
	case ifRevision > 0:
		cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(k), "=", ifRevision))
	}
	resp, err := cli.Txn(ctx).If(cmps...).Then(clientv3.OpPut(k, string(v))).Else(clientv3.OpGet(k)).Commit()
	if err != nil {
		return Env{}, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("write environment %s to etcd: %w", e.Name, err))
	}
	if !resp.Succeeded {
		kvs := resp.Responses[0].GetResponseRange().Kvs
		switch {
		case !replace:
			return Env{}, errdefs.New(errdefs.ErrAlreadyExists, "environment %s exists: remove it first or replace it", e.Name)
		case len(kvs) == 0:
			return Env{}, errdefs.New(errdefs.ErrFailedPrecondition, "environment %s was removed since revision %d: read it again", e.Name, ifRevision)
		default:
			return Env{}, errdefs.New(errdefs.ErrFailedPrecondition, "environment %s changed since revision %d (it is at %d now): read it again", e.Name, ifRevision, kvs[0].ModRevision)
		}
	}
	return Env{Env: e, Revision: resp.Header.Revision}, nil
}

// envKeyOK checks an environment's key (layer.Env.Key:
// "[tenant/]name") before it is looked up.
func envKeyOK(key string) bool {
	return key != "" && len(key) <= 256 && strings.Count(key, "/") <= 1 && !strings.HasPrefix(key, "/") && !strings.HasSuffix(key, "/")
}

// DeleteEnv removes an environment (by its key, layer.Env.Key) and returns
// the revision of its removal; an unknown one is not found.
func DeleteEnv(ctx context.Context, cli *clientv3.Client, name string) (int64, error) {
	if !envKeyOK(name) {
		return 0, errdefs.New(errdefs.ErrNotFound, "no environment %q (see shoal env ls)", name)
	}
	resp, err := cli.Delete(ctx, envsPrefix+name)
	if err != nil {
		return 0, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("remove environment %s from etcd: %w", name, err))
	}
	if resp.Deleted == 0 {
		return 0, errdefs.New(errdefs.ErrNotFound, "no environment %q (see shoal env ls)", name)
	}
	return resp.Header.Revision, nil
}

// GetEnv reads an environment (by its key, layer.Env.Key) from etcd (a
// linearizable read: a write through any replica is seen).
func GetEnv(ctx context.Context, cli *clientv3.Client, name string) (Env, error) {
	if !envKeyOK(name) {
		return Env{}, errdefs.New(errdefs.ErrNotFound, "no environment %q (see shoal env ls)", name)
	}
	resp, err := cli.Get(ctx, envsPrefix+name)
	if err != nil {
		return Env{}, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("read environment %s from etcd: %w", name, err))
	}
	if len(resp.Kvs) == 0 {
		return Env{}, errdefs.New(errdefs.ErrNotFound, "no environment %q (see shoal env ls)", name)
	}
	return decodeEnv(resp.Kvs[0].Value, resp.Kvs[0].ModRevision)
}

// ListEnvs reads every environment, by name.
func ListEnvs(ctx context.Context, cli *clientv3.Client) ([]Env, int64, error) {
	resp, err := cli.Get(ctx, envsPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, 0, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("read environments from etcd: %w", err))
	}
	out := make([]Env, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		if e, err := decodeEnv(kv.Value, kv.ModRevision); err == nil {
			out = append(out, e)
		}
	}
	return out, resp.Header.Revision, nil
}

func decodeEnv(v []byte, rev int64) (Env, error) {
	var e layer.Env
	if err := json.Unmarshal(v, &e); err != nil || e.Name == "" {
		return Env{}, fmt.Errorf("decode environment: %w", errors.Join(err, errors.New("no name")))
	}
	e.Mirrored = 0
	return Env{Env: e, Revision: rev}, nil
}

// EnvSink is where a node keeps its copy of the environments (its layer
// store).
type EnvSink interface {
	MirrorEnv(layer.Env) error
	UnmirrorEnv(name string) error
	Envs() ([]layer.Env, error)
}

// LayerMirror keeps a node's copy of the cluster's environments and, when
// its sink is a TagSink too, of its layer tags: it loads them all
// (removing the copies of those etcd no longer has: a node that was down
// catches up; one made on the node before it joined a cluster, which etcd
// never had, is written to etcd instead), then follows etcd's changes of
// both with one follower until its context ends, reloading when the watch
// breaks. Apply and ApplyTag write one the node itself just wrote, so
// that the node reads its own write at once.
type LayerMirror struct {
	cli  *clientv3.Client
	sink EnvSink
	tags TagSink // nil: the sink keeps no tags
	log  *slog.Logger

	mu      sync.Mutex       // serializes writes to sink, guards revs and tagRevs
	revs    map[string]int64 // environment key (layer.Env.Key) → revision applied (of a put or a delete)
	tagRevs map[string]int64 // tag key (layer.Layer.Key) → revision applied
}

// MirrorLayers loads etcd's environments (and layer tags, if sink is a
// TagSink) into sink (giving up after 30 s) and follows them until ctx
// ends.
func MirrorLayers(ctx context.Context, cli *clientv3.Client, sink EnvSink, log *slog.Logger) (*LayerMirror, error) {
	m := &LayerMirror{cli: cli, sink: sink, log: log, revs: map[string]int64{}, tagRevs: map[string]int64{}}
	m.tags, _ = sink.(TagSink)
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	rev, err := m.load(lctx)
	cancel()
	if err != nil {
		return nil, err
	}
	go m.follow(ctx, rev)
	return m, nil
}

func (m *LayerMirror) load(ctx context.Context) (int64, error) {
	envs, rev, err := ListEnvs(ctx, m.cli)
	if err != nil {
		return 0, err
	}
	var tags []LayerTag
	if m.tags != nil {
		// Read at the environments' revision: one snapshot of both,
		// which the watch goes on from.
		resp, err := m.cli.Get(ctx, layerTagsPrefix, clientv3.WithPrefix(), clientv3.WithRev(rev))
		if err != nil {
			return 0, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("read layer tags from etcd: %w", err))
		}
		for _, kv := range resp.Kvs {
			if t, err := decodeLayerTag(kv.Value, kv.ModRevision); err == nil {
				tags = append(tags, t)
			}
		}
	}
	have, err := m.sink.Envs()
	if err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	in := map[string]bool{}
	for _, e := range envs {
		in[e.Key()] = true
		m.putLocked(e)
	}
	for _, e := range have {
		switch {
		case in[e.Key()]:
		case e.Mirrored > 0: // etcd's once, removed since
			m.deleteLocked(e.Key(), rev)
		default: // made here before the node was in a cluster
			ce, err := PutEnv(ctx, m.cli, e, false, 0)
			if err != nil && !errors.Is(err, errdefs.ErrAlreadyExists) {
				return 0, fmt.Errorf("write environment %s, made on this node, to etcd: %w", e.Key(), err)
			}
			if err == nil {
				m.log.Info("cluster: an environment made on this node is the cluster's now", "env", e.Key())
				m.putLocked(ce)
			}
		}
	}
	if m.tags == nil {
		return rev, nil
	}
	haveTags, err := m.tags.List()
	if err != nil {
		return 0, err
	}
	inTags := map[string]bool{}
	for _, t := range tags {
		inTags[t.Key()] = true
		m.putTagLocked(t)
	}
	for _, l := range haveTags {
		switch {
		case inTags[l.Key()]:
		case l.Mirrored > 0: // etcd's once, removed since
			m.deleteTagLocked(l.Key(), rev)
		default: // built here before the node was in a cluster
			t, _, err := PutLayerTag(ctx, m.cli, l)
			if err != nil {
				return 0, fmt.Errorf("write tag %s, made on this node, to etcd: %w", l.Key(), err)
			}
			if t.Digest != l.Digest {
				// etcd had it already (since this load's read), at
				// another layer: etcd's stands.
				m.log.Warn("cluster: a tag made on this node points elsewhere in the cluster; the cluster's stands", "layer", l.Key(), "digest", l.Digest, "cluster_digest", t.Digest)
			} else {
				m.log.Info("cluster: a layer tag made on this node is the cluster's now", "layer", l.Key())
			}
			m.putTagLocked(t)
		}
	}
	return rev, nil
}

func (m *LayerMirror) putLocked(e Env) {
	if m.revs[e.Key()] >= e.Revision {
		return // a newer write is in already
	}
	le := e.Env
	le.Mirrored = e.Revision
	if err := m.sink.MirrorEnv(le); err != nil {
		m.log.Warn("cluster: mirror an environment", "env", e.Key(), "err", err)
		return
	}
	m.revs[e.Key()] = e.Revision
}

func (m *LayerMirror) deleteLocked(name string, rev int64) {
	if m.revs[name] > rev {
		return
	}
	if err := m.sink.UnmirrorEnv(name); err != nil {
		m.log.Warn("cluster: mirror an environment's removal", "env", name, "err", err)
		return
	}
	m.revs[name] = rev
}

func (m *LayerMirror) putTagLocked(t LayerTag) {
	if m.tagRevs[t.Key()] >= t.Revision {
		return // a newer move is in already
	}
	l := t.Layer
	l.Mirrored = t.Revision
	if err := m.tags.MirrorTag(l); err != nil {
		m.log.Warn("cluster: mirror a layer tag", "layer", t.Key(), "err", err)
		return
	}
	m.tagRevs[t.Key()] = t.Revision
}

func (m *LayerMirror) deleteTagLocked(ref string, rev int64) {
	if m.tagRevs[ref] > rev {
		return
	}
	if err := m.tags.UnmirrorTag(ref); err != nil {
		m.log.Warn("cluster: mirror a layer tag's removal", "layer", ref, "err", err)
		return
	}
	m.tagRevs[ref] = rev
}

// Revision is the revision of the environment's copy (0: none).
func (m *LayerMirror) Revision(name string) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.revs[name]
}

// TagRevision is the revision of the copy of tag ref (0: none).
func (m *LayerMirror) TagRevision(ref string) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.tagRevs[ref]
}

// Apply writes into the copy an environment just written to etcd (PutEnv's
// answer), unless a newer write is in already.
func (m *LayerMirror) Apply(e Env) {
	m.mu.Lock()
	m.putLocked(e)
	m.mu.Unlock()
}

// ApplyDelete removes from the copy an environment just removed from etcd
// at revision rev.
func (m *LayerMirror) ApplyDelete(name string, rev int64) {
	m.mu.Lock()
	m.deleteLocked(name, rev)
	m.mu.Unlock()
}

// PutTag moves a tag in etcd (PutLayerTag) and then in the copy, so that
// the node reads its own write at once; it returns the layer the tag
// points at and the digest it pointed at before. It is what a node of a
// cluster writes its tags with (layer.ClusterTags).
func (m *LayerMirror) PutTag(ctx context.Context, l layer.Layer) (layer.Layer, string, error) {
	if m.tags == nil {
		return layer.Layer{}, "", errdefs.New(errdefs.ErrFailedPrecondition, "this node keeps no copy of the cluster's tags")
	}
	t, old, err := PutLayerTag(ctx, m.cli, l)
	if err != nil {
		return layer.Layer{}, "", err
	}
	m.mu.Lock()
	m.putTagLocked(t)
	m.mu.Unlock()
	t.Layer.Mirrored = t.Revision
	return t.Layer, old, nil
}

// DeleteTag removes a tag from etcd (DeleteLayerTag) and then from the
// copy.
func (m *LayerMirror) DeleteTag(ctx context.Context, ref string) error {
	if m.tags == nil {
		return errdefs.New(errdefs.ErrFailedPrecondition, "this node keeps no copy of the cluster's tags")
	}
	rev, err := DeleteLayerTag(ctx, m.cli, ref)
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.deleteTagLocked(ref, rev)
	m.mu.Unlock()
	return nil
}

// LookupTag reads a tag from etcd (GetLayerTag), for a node whose copy
// does not have it (yet: the watch brings it within milliseconds), and
// writes it into the copy.
func (m *LayerMirror) LookupTag(ctx context.Context, ref string) (layer.Layer, error) {
	t, err := GetLayerTag(ctx, m.cli, ref)
	if err != nil {
		return layer.Layer{}, fmt.Errorf("resolve layer %s: %w", ref, err)
	}
	if m.tags != nil {
		m.mu.Lock()
		m.putTagLocked(t)
		m.mu.Unlock()
	}
	t.Layer.Mirrored = t.Revision
	return t.Layer, nil
}

func (m *LayerMirror) follow(ctx context.Context, rev int64) {
	f := follower{cli: m.cli, prefix: envsPrefix, what: "environments", log: m.log, load: m.load, reloadTimeout: 5 * time.Second,
		apply: func(resp clientv3.WatchResponse) {
			m.mu.Lock()
			defer m.mu.Unlock()
			for _, ev := range resp.Events {
				k := string(ev.Kv.Key)
				if strings.HasPrefix(k, layerTagsPrefix) {
					if ev.Type == clientv3.EventTypePut {
						if t, err := decodeLayerTag(ev.Kv.Value, ev.Kv.ModRevision); err == nil && refOfTagKey(k) == t.Key() {
							m.putTagLocked(t)
						}
						continue
					}
					m.deleteTagLocked(refOfTagKey(k), ev.Kv.ModRevision)
					continue
				}
				if ev.Type == clientv3.EventTypePut {
					if e, err := decodeEnv(ev.Kv.Value, ev.Kv.ModRevision); err == nil && strings.TrimPrefix(k, envsPrefix) == e.Key() {
						m.putLocked(e)
					}
					continue
				}
				m.deleteLocked(strings.TrimPrefix(k, envsPrefix), ev.Kv.ModRevision)
			}
		}}
	if m.tags != nil {
		f.what = "environments and layer tags"
		f.more = []string{layerTagsPrefix}
	}
	f.run(ctx, rev)
}
