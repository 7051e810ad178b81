package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/placement"
)

// Directory is a control replica's view of the nodes: which are alive
// (their lease holds), where they are, and which node a sandbox ID names.
// It follows etcd with watches, so looking a sandbox up never waits on
// etcd; every report is passed on to the placement engine.
type Directory struct {
	cli    *clientv3.Client
	engine *placement.Engine
	log    *slog.Logger

	mu   sync.RWMutex
	live map[string]NodeInfo  // node name → its last report; guarded by mu
	tags map[string]string    // tag → node name; guarded by mu
	gone map[string]time.Time // node name → when its lease ended; guarded by mu
	last map[string]NodeInfo  // node name → its last report, for nodes gone; guarded by mu
}

// WatchDirectory loads the nodes and tags and follows them until ctx ends.
func WatchDirectory(ctx context.Context, cli *clientv3.Client, engine *placement.Engine, log *slog.Logger) (*Directory, error) {
	d := &Directory{cli: cli, engine: engine, log: log, live: map[string]NodeInfo{}, tags: map[string]string{}, gone: map[string]time.Time{}, last: map[string]NodeInfo{}}
	rev, err := d.load(ctx)
	if err != nil {
		return nil, err
	}
	go d.follow(ctx, rev)
	return d, nil
}

// load reads every node and tag, replacing what d knew, and returns the
// revision read at.
func (d *Directory) load(ctx context.Context) (int64, error) {
	tags, err := d.cli.Get(ctx, tagsPrefix, clientv3.WithPrefix())
	if err != nil {
		return 0, fmt.Errorf("read node tags from etcd: %w", err)
	}
	nodes, err := d.cli.Get(ctx, nodesPrefix, clientv3.WithPrefix(), clientv3.WithRev(tags.Header.Revision))
	if err != nil {
		return 0, fmt.Errorf("read nodes from etcd: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, kv := range tags.Kvs {
		d.tags[strings.TrimPrefix(string(kv.Key), tagsPrefix)] = string(kv.Value)
	}
	old := d.live
	d.live = map[string]NodeInfo{}
	for _, kv := range nodes.Kvs {
		d.putLocked(kv.Value)
	}
	for name := range old {
		if _, ok := d.live[name]; !ok {
			d.goneLocked(name)
		}
	}
	return tags.Header.Revision, nil
}

func (d *Directory) putLocked(v []byte) {
	var info NodeInfo
	if err := json.Unmarshal(v, &info); err != nil || info.Name == "" {
		d.log.Warn("cluster: bad node report in etcd", "err", err)
		return
	}
	if _, was := d.live[info.Name]; !was {
		d.log.Info("cluster: node up", "node", info.Name, "url", info.URL, "tag", info.Tag)
	}
	d.live[info.Name] = info
	d.tags[info.Tag] = info.Name
	delete(d.gone, info.Name)
	delete(d.last, info.Name)
	d.engine.Update(info.Load)
}

func (d *Directory) goneLocked(name string) {
	if info, ok := d.live[name]; ok {
		d.log.Warn("cluster: node down (its lease ended): its sandboxes are lost until it comes back", "node", name)
		d.last[name] = info
	}
	delete(d.live, name)
	d.gone[name] = time.Now().UTC()
	d.engine.Remove(name)
}

// follow applies the watch's events; when the watch breaks (etcd
// compacted past it, or a long partition) it reloads and watches anew.
func (d *Directory) follow(ctx context.Context, rev int64) {
	// Only nodes/: a node's report carries its tag (claimed before its
	// first report), and the catalog is read when asked.
	follower{cli: d.cli, prefix: nodesPrefix, what: "nodes", log: d.log, load: d.load, reloadTimeout: 5 * time.Second,
		apply: func(resp clientv3.WatchResponse) {
			d.mu.Lock()
			defer d.mu.Unlock()
			for _, ev := range resp.Events {
				k := string(ev.Kv.Key)
				switch {
				case ev.Type == clientv3.EventTypePut:
					d.putLocked(ev.Kv.Value)
				default:
					d.goneLocked(strings.TrimPrefix(k, nodesPrefix))
				}
			}
		}}.run(ctx, rev)
}

// Client is the etcd client the directory follows etcd with.
func (d *Directory) Client() *clientv3.Client { return d.cli }

// Live returns the live nodes, by name.
func (d *Directory) Live() []NodeInfo {
	d.mu.RLock()
	out := make([]NodeInfo, 0, len(d.live))
	for _, n := range d.live {
		out = append(out, n)
	}
	d.mu.RUnlock()
	slices.SortFunc(out, func(a, b NodeInfo) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Node returns a live node by name.
func (d *Directory) Node(name string) (NodeInfo, bool) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	n, ok := d.live[name]
	return n, ok
}

// DownNode is a node the cluster knows (it claimed a tag) whose lease
// ended.
type DownNode struct {
	// Info is its last report if this replica saw it live, else only its
	// Name and Tag.
	Info NodeInfo
	// Since is when this replica saw its lease end; zero if that was
	// before the replica started.
	Since time.Time
}

// Down returns the nodes that are down, by name.
func (d *Directory) Down() []DownNode {
	d.mu.RLock()
	var out []DownNode
	for tag, name := range d.tags {
		if _, ok := d.live[name]; ok {
			continue
		}
		info, ok := d.last[name]
		if !ok {
			info = NodeInfo{Name: name, Tag: tag}
		}
		out = append(out, DownNode{Info: info, Since: d.gone[name]})
	}
	d.mu.RUnlock()
	slices.SortFunc(out, func(a, b DownNode) int { return strings.Compare(a.Info.Name, b.Info.Name) })
	return out
}

// ErrLost marks a request for a sandbox whose node is down (also
// errdefs.ErrUnavailable: it may come back).
var ErrLost = errors.New("lost")

// ForSandbox returns the live node that holds sandbox id. A sandbox of a
// node that is down is reported lost (unavailable, ErrLost); an ID that
// names no node is not found.
func (d *Directory) ForSandbox(id string) (NodeInfo, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	name, ok := d.tags[TagOf(id)]
	if !ok {
		return NodeInfo{}, errdefs.New(errdefs.ErrNotFound, "no sandbox %s", id)
	}
	if n, ok := d.live[name]; ok {
		return n, nil
	}
	since := "its lease ended before this control replica started"
	if t, ok := d.gone[name]; ok {
		since = "its lease ended at " + t.Format(time.RFC3339)
	}
	return NodeInfo{}, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("%w: sandbox %s is on node %s, which is down (%s)", ErrLost, id, name, since))
}

// Lost returns the catalog's sandboxes of nodes that are down.
func (d *Directory) Lost(ctx context.Context) ([]CatalogEntry, error) {
	d.mu.RLock()
	var tags []string
	for tag, name := range d.tags {
		if _, ok := d.live[name]; !ok {
			tags = append(tags, tag)
		}
	}
	d.mu.RUnlock()
	var out []CatalogEntry
	for _, tag := range tags {
		es, err := d.CatalogOf(ctx, tag)
		if err != nil {
			return nil, err
		}
		out = append(out, es...)
	}
	return out, nil
}

// CatalogOf returns the catalog's sandboxes of the node with tag.
func (d *Directory) CatalogOf(ctx context.Context, tag string) ([]CatalogEntry, error) {
	resp, err := d.cli.Get(ctx, sandboxesPrefix+tag+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("read the sandbox catalog: %w", err)
	}
	var out []CatalogEntry
	for _, kv := range resp.Kvs {
		var e CatalogEntry
		if json.Unmarshal(kv.Value, &e) == nil {
			out = append(out, e)
		}
	}
	return out, nil
}

// Catalog records a sandbox just created on node (the node's own
// heartbeat would within a third of its TTL; this closes the window in
// which the node dies before it).
func (d *Directory) Catalog(ctx context.Context, e CatalogEntry) error {
	b, _ := json.Marshal(e)
	_, err := d.cli.Put(ctx, sandboxesPrefix+TagOf(e.ID)+"/"+e.ID, string(b))
	return err
}

// Uncatalog forgets a deleted sandbox.
func (d *Directory) Uncatalog(ctx context.Context, id string) error {
	_, err := d.cli.Delete(ctx, sandboxesPrefix+TagOf(id)+"/"+id)
	return err
}
