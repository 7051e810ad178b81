package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/placement"
)

// RegisterConfig configures a node's registration.
type RegisterConfig struct {
	Name string
	URL  string // the node's API as control replicas reach it
	// E2BURL is the node's E2B endpoint as control replicas reach it
	// (empty: it serves none).
	E2BURL string
	// LayerStore is the URL of the node's shared layer store ("": none).
	LayerStore string
	// TTL of the node's lease: a node silent this long is gone, and its
	// sandboxes lost (default 10 s, at least 2 s).
	TTL time.Duration
	// Report returns the node's capacity report and its sandboxes; called
	// once per heartbeat (TTL/3) from one goroutine.
	// The report's Name is filled in.
	Report func() (placement.Node, []CatalogEntry)
	Log    *slog.Logger
}

// Registration is a node's membership of the cluster.
type Registration struct {
	cli     *clientv3.Client
	cfg     RegisterConfig
	tag     string
	started time.Time
	lease   *keeper
	written map[string]bool // catalog keys in etcd, as last known; only Run's goroutine
	beats   int
}

// resyncEvery: every this many heartbeats the node re-reads its catalog
// keys from etcd, so that entries others wrote (a control replica catalogs
// a create at once) for sandboxes already gone are deleted too.
var resyncEvery = 10 // tests lower it

// Register claims the node's tag (refusing a name whose tag another node
// holds), grants its lease and publishes its first report. Run keeps it
// alive.
func Register(ctx context.Context, cli *clientv3.Client, cfg RegisterConfig) (*Registration, error) {
	if err := ValidNodeName(cfg.Name); err != nil {
		return nil, err
	}
	if cfg.TTL == 0 {
		cfg.TTL = 10 * time.Second
	}
	if cfg.TTL < 2*time.Second || cfg.TTL > 10*time.Minute {
		return nil, fmt.Errorf("node lease TTL %s: want 2s to 10m", cfg.TTL)
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	r := &Registration{cli: cli, cfg: cfg, tag: Tag(cfg.Name), started: time.Now().UTC(), written: map[string]bool{}, lease: newKeeper(cli, cfg.TTL)}
	key := tagsPrefix + r.tag
	resp, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, cfg.Name)).Else(clientv3.OpGet(key)).Commit()
	if err != nil {
		return nil, fmt.Errorf("claim node tag %s in etcd: %w", r.tag, err)
	}
	if !resp.Succeeded {
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 1 && string(kvs[0].Value) != cfg.Name {
			return nil, fmt.Errorf("node name %q: its ID tag %s is held by node %q: choose another name", cfg.Name, r.tag, kvs[0].Value)
		}
	}
	if err := r.heartbeat(ctx); err != nil {
		return nil, err
	}
	return r, nil
}

// Tag is the prefix of the node's sandbox IDs.
func (r *Registration) Tag() string { return r.tag }

// Run heartbeats until ctx ends, then revokes the lease (the node leaves:
// its sandboxes are reported lost until it comes back).
func (r *Registration) Run(ctx context.Context) {
	t := time.NewTicker(r.cfg.TTL / 3)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			r.lease.close()
			return
		case <-t.C:
		}
		c, cancel := context.WithTimeout(ctx, r.cfg.TTL/3)
		if err := r.heartbeat(c); err != nil && ctx.Err() == nil {
			r.cfg.Log.Warn("cluster heartbeat", "node", r.cfg.Name, "err", err)
		}
		cancel()
	}
}

// heartbeat publishes the report under the node's lease (a new one if it
// expired: the node was cut off too long) and brings the catalog up to
// date.
func (r *Registration) heartbeat(ctx context.Context) error {
	lease, _, err := r.lease.lease(ctx)
	if err != nil {
		return err
	}
	load, sbs := r.cfg.Report()
	load.Name = r.cfg.Name
	info := NodeInfo{Name: r.cfg.Name, Tag: r.tag, URL: r.cfg.URL, E2BURL: r.cfg.E2BURL, LayerStore: r.cfg.LayerStore, Load: load, Started: r.started, Updated: time.Now().UTC()}
	b, err := json.Marshal(info)
	if err != nil {
		return err
	}
	if _, err := r.cli.Put(ctx, nodesPrefix+r.cfg.Name, string(b), clientv3.WithLease(lease)); err != nil {
		return fmt.Errorf("publish node report: %w", err)
	}
	if r.beats%resyncEvery == 0 {
		// The catalog as etcd has it (at start: as this node left it).
		got, err := r.cli.Get(ctx, sandboxesPrefix+r.tag+"/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
		if err != nil {
			return fmt.Errorf("read the node's catalog: %w", err)
		}
		r.written = make(map[string]bool, len(got.Kvs))
		for _, kv := range got.Kvs {
			r.written[string(kv.Key)] = true
		}
	}
	r.beats++
	return r.syncCatalog(ctx, sbs)
}

// maxTxnOps stays below etcd's default --max-txn-ops (128).
const maxTxnOps = 100

// syncCatalog writes the entries not written yet and deletes those of
// sandboxes gone, in transactions of at most maxTxnOps operations.
func (r *Registration) syncCatalog(ctx context.Context, sbs []CatalogEntry) error {
	now := make(map[string]bool, len(sbs))
	var ops []clientv3.Op
	var keys []string
	for _, e := range sbs {
		k := sandboxesPrefix + r.tag + "/" + e.ID
		now[k] = true
		if r.written[k] {
			continue
		}
		e.Node = r.cfg.Name
		b, _ := json.Marshal(e)
		ops = append(ops, clientv3.OpPut(k, string(b)))
		keys = append(keys, k)
	}
	for k := range r.written {
		if !now[k] {
			ops = append(ops, clientv3.OpDelete(k))
			keys = append(keys, k)
		}
	}
	for len(ops) > 0 {
		n := min(len(ops), maxTxnOps)
		if _, err := r.cli.Txn(ctx).Then(ops[:n]...).Commit(); err != nil {
			return fmt.Errorf("write the sandbox catalog: %w", err)
		}
		for _, k := range keys[:n] {
			if now[k] {
				r.written[k] = true
			} else {
				delete(r.written, k)
			}
		}
		ops, keys = ops[n:], keys[n:]
	}
	return nil
}
