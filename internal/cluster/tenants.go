package cluster

// Tenancy: a cluster's tenants' keys and quotas, kept in etcd and followed
// by every node and control replica, so that a tenant's key works at each
// of them and a quota means the same everywhere.
//
// Keys (under Prefix):
//
//	tenancy/keys/<name>      tenant.Key as JSON: its name, tenant, scopes,
//	                         creation time and the hex SHA-256 of its
//	                         plaintext (never the plaintext)
//	tenancy/quotas/<tenant>  tenant.Quota as JSON (absent: no bound)
//
// Each change is one etcd request (a create is a transaction that fails
// when the name is taken). Every process keeps the whole set in memory,
// loaded at start and followed with a watch: resolving a key never waits
// on etcd. A change made through a process is applied to its own copy
// before the call returns (it waits for its watch to pass the change's
// revision); the others see it when their watch delivers it (typically
// milliseconds; while a process is cut off from etcd it keeps its last
// copy, so a key removed then still works there until it is back).

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

const (
	tenancyPrefix = Prefix + "tenancy/"
	tenantKeys    = tenancyPrefix + "keys/"
	tenantQuotas  = tenancyPrefix + "quotas/"
)

// MaxTenancyKeys bounds the keys a cluster holds (every process resolves
// them from memory), as tenant.MaxKeys does a node's.
const MaxTenancyKeys = tenant.MaxKeys

// Tenancy is a process's copy of the cluster's keys and quotas, following
// etcd. It is safe for concurrent use.
type Tenancy struct {
	cli *clientv3.Client
	log *slog.Logger

	mu     sync.RWMutex
	byName map[string]tenant.Key   // guarded by mu
	byHash map[string]tenant.Key   // guarded by mu
	quotas map[string]tenant.Quota // guarded by mu
	rev    int64                   // the etcd revision the copy is at; guarded by mu
	moved  chan struct{}           // closed (and replaced) when rev moves; guarded by mu

	catchMu  sync.Mutex // serializes ResolveFresh's catch-ups
	caughtUp time.Time  // when the last catch-up started; guarded by catchMu
}

// WatchTenancy loads the cluster's keys and quotas and follows them until
// ctx ends.
func WatchTenancy(ctx context.Context, cli *clientv3.Client, log *slog.Logger) (*Tenancy, error) {
	t := newTenancy(cli, log)
	lctx, cancel := context.WithTimeout(ctx, loadTimeout)
	rev, err := t.load(lctx)
	cancel()
	if err != nil {
		return nil, err
	}
	go t.follow(ctx, rev)
	return t, nil
}

func newTenancy(cli *clientv3.Client, log *slog.Logger) *Tenancy {
	return &Tenancy{cli: cli, log: log, moved: make(chan struct{})}
}

// load reads every key and quota, replacing the copy, and returns the
// revision read at.
func (t *Tenancy) load(ctx context.Context) (int64, error) {
	resp, err := t.cli.Get(ctx, tenancyPrefix, clientv3.WithPrefix())
	if err != nil {
		return 0, fmt.Errorf("read tenants' keys and quotas from etcd: %w", err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.byName, t.byHash, t.quotas = map[string]tenant.Key{}, map[string]tenant.Key{}, map[string]tenant.Quota{}
	for _, kv := range resp.Kvs {
		t.putLocked(string(kv.Key), kv.Value)
	}
	t.advanceLocked(resp.Header.Revision)
	return resp.Header.Revision, nil
}

func (t *Tenancy) advanceLocked(rev int64) {
	if rev > t.rev {
		t.rev = rev
		close(t.moved)
		t.moved = make(chan struct{})
	}
}

// putLocked applies a put of etcd key k; a value that does not decode or
// is not valid is left out (logged).
func (t *Tenancy) putLocked(k string, v []byte) {
	switch {
	case strings.HasPrefix(k, tenantKeys):
		name := strings.TrimPrefix(k, tenantKeys)
		var key tenant.Key
		err := json.Unmarshal(v, &key)
		if err == nil {
			err = key.Valid()
		}
		if err == nil && key.Name != name {
			err = fmt.Errorf("stored under the name %q", name)
		}
		t.deleteLocked(k) // the key this name had, if any
		if err != nil {
			t.log.Warn("cluster: a bad tenant key in etcd is ignored", "key", name, "err", err)
			return
		}
		t.byName[name] = key
		t.byHash[key.Hash] = key
	case strings.HasPrefix(k, tenantQuotas):
		name := strings.TrimPrefix(k, tenantQuotas)
		var q tenant.Quota
		err := json.Unmarshal(v, &q)
		if err == nil {
			err = q.Validate()
		}
		if err == nil {
			err = tenant.ValidName("tenant", name)
		}
		if err != nil {
			delete(t.quotas, name)
			t.log.Warn("cluster: a bad tenant quota in etcd is ignored", "tenant", name, "err", err)
			return
		}
		t.quotas[name] = q
	}
}

func (t *Tenancy) deleteLocked(k string) {
	switch {
	case strings.HasPrefix(k, tenantKeys):
		name := strings.TrimPrefix(k, tenantKeys)
		if old, ok := t.byName[name]; ok {
			delete(t.byHash, old.Hash)
			delete(t.byName, name)
		}
	case strings.HasPrefix(k, tenantQuotas):
		delete(t.quotas, strings.TrimPrefix(k, tenantQuotas))
	}
}

// follow applies the watch's events; when the watch breaks it reloads and
// watches anew (as Directory does).
func (t *Tenancy) follow(ctx context.Context, rev int64) {
	follower{cli: t.cli, prefix: tenancyPrefix, what: "tenants' keys", log: t.log, load: t.load, reloadTimeout: 5 * time.Second,
		opts: []clientv3.OpOption{clientv3.WithProgressNotify()},
		apply: func(resp clientv3.WatchResponse) {
			t.mu.Lock()
			defer t.mu.Unlock()
			for _, ev := range resp.Events {
				if ev.Type == clientv3.EventTypePut {
					t.putLocked(string(ev.Kv.Key), ev.Kv.Value)
				} else {
					t.deleteLocked(string(ev.Kv.Key))
				}
			}
			t.advanceLocked(resp.Header.Revision)
		}}.run(ctx, rev)
}

// loadTimeout bounds the first read of what a watch then follows.
const loadTimeout = 30 * time.Second

// caughtUpWait bounds how long a change waits for this process's own copy
// to show it.
const caughtUpWait = 5 * time.Second

// waitRev waits until the copy is at revision rev or later (a change made
// here is then visible here), for at most caughtUpWait.
func (t *Tenancy) waitRev(ctx context.Context, rev int64) {
	ctx, cancel := context.WithTimeout(ctx, caughtUpWait)
	defer cancel()
	if !t.waitRevFor(ctx, rev) {
		t.mu.RLock()
		at := t.rev
		t.mu.RUnlock()
		t.log.Warn("cluster: a tenants' change is not in this process's copy yet", "rev", rev, "at", at)
	}
}

// waitRevFor waits until the copy is at revision rev or later, or ctx
// ends; it reports whether the copy got there.
func (t *Tenancy) waitRevFor(ctx context.Context, rev int64) bool {
	for {
		t.mu.RLock()
		at, moved := t.rev, t.moved
		t.mu.RUnlock()
		if at >= rev {
			return true
		}
		select {
		case <-moved:
		case <-ctx.Done():
			return false
		}
	}
}

// Resolve returns the key whose plaintext is plaintext, from memory.
func (t *Tenancy) Resolve(plaintext string) (tenant.Key, bool) {
	h := tenant.HashKey(plaintext)
	t.mu.RLock()
	k, ok := t.byHash[h]
	t.mu.RUnlock()
	return k, ok
}

// missEvery spaces the catch-ups of ResolveFresh; missWait bounds one.
const (
	missEvery = 50 * time.Millisecond
	missWait  = 2 * time.Second
)

// ResolveFresh is Resolve, but on a miss it first makes sure the copy is
// not behind etcd: it reads the revision of the last key written under
// the prefix (one linearizable read) and waits for the watch to pass it,
// then looks again. A key made
// through any process is so accepted by the first request that uses it
// here, however soon. A known key never waits on etcd. Misses share their
// catch-ups: one that started after a miss arrived answers it, and they
// start at most every missEvery, so wrong keys cost at most one etcd read
// per missEvery (and wait that long themselves).
func (t *Tenancy) ResolveFresh(ctx context.Context, plaintext string) (tenant.Key, bool) {
	if k, ok := t.Resolve(plaintext); ok {
		return k, true
	}
	arrived := time.Now()
	t.catchMu.Lock()
	if !t.caughtUp.After(arrived) {
		if d := time.Until(t.caughtUp.Add(missEvery)); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
				t.catchMu.Unlock()
				return tenant.Key{}, false
			}
		}
		t.caughtUp = time.Now()
		cctx, cancel := context.WithTimeout(ctx, missWait)
		// The last change under the prefix that still stands (a put: what
		// a new key is) is the revision the copy must reach.
		resp, err := t.cli.Get(cctx, tenancyPrefix, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithLimit(1),
			clientv3.WithSort(clientv3.SortByModRevision, clientv3.SortDescend))
		if err == nil && len(resp.Kvs) == 1 {
			t.waitRevFor(cctx, resp.Kvs[0].ModRevision)
		}
		cancel()
	}
	t.catchMu.Unlock()
	return t.Resolve(plaintext)
}

// Keys lists the keys by name.
func (t *Tenancy) Keys() []tenant.Key {
	t.mu.RLock()
	out := make([]tenant.Key, 0, len(t.byName))
	for _, k := range t.byName {
		out = append(out, k)
	}
	t.mu.RUnlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Quota returns tenant name's quota (zero: no bound).
func (t *Tenancy) Quota(name string) tenant.Quota {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.quotas[name]
}

// Tenants lists every tenant that has a key or a quota, with its quota.
func (t *Tenancy) Tenants() map[string]tenant.Quota {
	t.mu.RLock()
	defer t.mu.RUnlock()
	out := map[string]tenant.Quota{}
	for _, k := range t.byName {
		if k.Tenant != "" {
			out[k.Tenant] = t.quotas[k.Tenant]
		}
	}
	for n, q := range t.quotas {
		out[n] = q
	}
	return out
}

// CreateKey makes a key (tenant.NewKey) and stores it in one transaction
// that fails when the name is taken; it returns the plaintext (shown once).
func (t *Tenancy) CreateKey(ctx context.Context, name, tenantName string, scopes []tenant.Scope) (string, tenant.Key, error) {
	plaintext, k, err := tenant.NewKey(name, tenantName, scopes)
	if err != nil {
		return "", tenant.Key{}, err
	}
	t.mu.RLock()
	n := len(t.byName)
	t.mu.RUnlock()
	if n >= MaxTenancyKeys { // from the copy: racing creates may pass it by a few
		return "", tenant.Key{}, errdefs.New(errdefs.ErrResourceExhausted, "the cluster holds %d keys, the maximum", MaxTenancyKeys)
	}
	b, err := json.Marshal(k)
	if err != nil {
		return "", tenant.Key{}, err
	}
	ek := tenantKeys + name
	resp, err := t.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(ek), "=", 0)).Then(clientv3.OpPut(ek, string(b))).Commit()
	if err != nil {
		return "", tenant.Key{}, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("store key %s in etcd: %w", name, err))
	}
	if !resp.Succeeded {
		return "", tenant.Key{}, errdefs.New(errdefs.ErrAlreadyExists, "a key named %q exists (remove it first: shoal key rm %s)", name, name)
	}
	t.waitRev(ctx, resp.Header.Revision)
	return plaintext, k, nil
}

// DeleteKey removes the key named name; requests made with it fail at
// every process once its watch has the change.
func (t *Tenancy) DeleteKey(ctx context.Context, name string) (tenant.Key, error) {
	if err := tenant.ValidName("key", name); err != nil {
		return tenant.Key{}, errdefs.New(errdefs.ErrNotFound, "no key named %q", name)
	}
	resp, err := t.cli.Delete(ctx, tenantKeys+name, clientv3.WithPrevKV())
	if err != nil {
		return tenant.Key{}, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("remove key %s from etcd: %w", name, err))
	}
	if resp.Deleted == 0 {
		return tenant.Key{}, errdefs.New(errdefs.ErrNotFound, "no key named %q", name)
	}
	var k tenant.Key
	if len(resp.PrevKvs) == 1 {
		json.Unmarshal(resp.PrevKvs[0].Value, &k)
	}
	k.Name = name
	t.waitRev(ctx, resp.Header.Revision)
	return k, nil
}

// SetQuota sets tenant name's quota (a zero Quota removes it).
func (t *Tenancy) SetQuota(ctx context.Context, name string, q tenant.Quota) error {
	if err := tenant.ValidName("tenant", name); err != nil {
		return err
	}
	if err := q.Validate(); err != nil {
		return err
	}
	var rev int64
	if q == (tenant.Quota{}) {
		resp, err := t.cli.Delete(ctx, tenantQuotas+name)
		if err != nil {
			return errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("remove the quota of %s from etcd: %w", name, err))
		}
		rev = resp.Header.Revision
	} else {
		b, err := json.Marshal(q)
		if err != nil {
			return err
		}
		resp, err := t.cli.Put(ctx, tenantQuotas+name, string(b))
		if err != nil {
			return errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("store the quota of %s in etcd: %w", name, err))
		}
		rev = resp.Header.Revision
	}
	t.waitRev(ctx, rev)
	return nil
}
