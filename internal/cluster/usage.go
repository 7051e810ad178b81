package cluster

// Usage: tenants' quotas held across the whole cluster, checked by a
// control replica before it places a create.
//
// A replica follows the sandbox catalog (sandboxes/<tag>/<id>, every
// node's sandboxes, with each one's tenant and limits) with a watch and
// keeps each tenant's totals in memory. A create through the replica
// reserves its sandbox's limits first: the reservation is refused
// (resource_exhausted, naming the quota, as a node's admission words it)
// when the tenant's catalogued sandboxes plus the replica's reservations
// would exceed the tenant's quota. The reservation holds until the catalog
// shows the sandbox (or the create fails), so a burst through one replica
// never overshoots. How strict it is across replicas: each replica counts
// the catalog and its own creates in flight, not another replica's, so two
// replicas racing for the last of a tenant's quota may overshoot it by at
// most the creates the other replicas have in flight for that tenant at
// that moment (each node's own admission checks the same quota against
// the tenant's sandboxes on that node as a second guard). Creates per
// second is a token bucket per replica holding its share of the rate and
// burst (1/R of each with R live replicas, SetReplicas): exact when a
// tenant's creates are spread evenly over the replicas, short of the rate
// when they all go through one.

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// Totals is what a tenant's sandboxes take.
type Totals struct {
	Sandboxes int64
	Memory    int64
	MilliCPU  int64
}

// QuotaSource gives a tenant's quota (*Tenancy).
type QuotaSource interface {
	Quota(t string) tenant.Quota
}

type usageEntry struct {
	id       string
	tenant   string
	memory   int64
	milliCPU int64
}

// reservationHold bounds how long a create that succeeded keeps its
// reservation while the catalog does not show its sandbox yet (the node's
// heartbeat catalogs it within a third of its TTL, if the replica's own
// write failed).
var reservationHold = 30 * time.Second

// Usage is a control replica's view of what each tenant's sandboxes take
// across the cluster, and its reservations. It is safe for concurrent use.
type Usage struct {
	cli      *clientv3.Client
	quotas   QuotaSource
	log      *slog.Logger
	replicas *Replica // splits creates-per-second among the live replicas; set by SetReplicas before use

	mu      sync.Mutex
	entries map[string]usageEntry     // catalog key → entry; guarded by mu
	names   map[string]string         // tenants' names, interned; guarded by mu
	totals  map[string]Totals         // tenant → its catalogued sandboxes' totals; guarded by mu
	pending map[*Reservation]bool     // creates in flight or not catalogued yet; guarded by mu
	byID    map[string]*Reservation   // pending reservations whose create gave an ID; guarded by mu
	buckets map[string]*tenant.Bucket // tenant → creates-per-second bucket; guarded by mu
}

// Reservation is a create's claim on its tenant's quota. Its methods may
// be called on nil (a create of no tenant).
type Reservation struct {
	u        *Usage
	tenant   string
	memory   int64
	milliCPU int64
	bucket   *tenant.Bucket // the token it took (nil: none)
	id       string         // set by Created; guarded by u.mu
	until    time.Time      // set by Done after Created: held until then at most; guarded by u.mu
}

// usagePage bounds one read of the catalog at start.
const usagePage = 5000

// WatchUsage loads the catalog's totals and follows them until ctx ends;
// quotas gives each tenant's quota.
func WatchUsage(ctx context.Context, cli *clientv3.Client, quotas QuotaSource, log *slog.Logger) (*Usage, error) {
	u := &Usage{cli: cli, quotas: quotas, log: log, pending: map[*Reservation]bool{}, byID: map[string]*Reservation{}, buckets: map[string]*tenant.Bucket{}}
	lctx, cancel := context.WithTimeout(ctx, loadTimeout)
	rev, err := u.load(lctx)
	cancel()
	if err != nil {
		return nil, err
	}
	go u.follow(ctx, rev)
	return u, nil
}

// load reads the whole catalog (in pages, at one revision), replacing the
// totals, and returns the revision read at.
func (u *Usage) load(ctx context.Context) (int64, error) {
	entries := map[string]usageEntry{}
	names := map[string]string{}
	var rev int64
	from, end := sandboxesPrefix, clientv3.GetPrefixRangeEnd(sandboxesPrefix)
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(usagePage)}
		if rev != 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := u.cli.Get(ctx, from, opts...)
		if err != nil {
			return 0, fmt.Errorf("read the sandbox catalog: %w", err)
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			k := string(kv.Key)
			if e, ok := decodeUsage(k, kv.Value, names); ok {
				entries[k] = e
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	u.entries = entries
	u.names = names
	u.totals = map[string]Totals{}
	for _, e := range entries {
		u.addLocked(e, 1)
		u.seenLocked(e.id)
	}
	return rev, nil
}

// decodeUsage decodes the catalog entry at key k; its ID shares k's
// bytes, and its tenant's name is interned in names.
func decodeUsage(k string, v []byte, names map[string]string) (usageEntry, bool) {
	var c CatalogEntry
	if json.Unmarshal(v, &c) != nil {
		return usageEntry{}, false
	}
	t, ok := names[c.Tenant]
	if !ok {
		t = c.Tenant
		names[t] = t
	}
	return usageEntry{id: k[strings.LastIndexByte(k, '/')+1:], tenant: t, memory: max(c.Memory, 0), milliCPU: max(c.MilliCPU, 0)}, true
}

func (u *Usage) addLocked(e usageEntry, sign int64) {
	if e.tenant == "" {
		return
	}
	t := u.totals[e.tenant]
	t.Sandboxes += sign
	t.Memory = satAdd(t.Memory, sign*e.memory)
	t.MilliCPU = satAdd(t.MilliCPU, sign*e.milliCPU)
	if t == (Totals{}) {
		delete(u.totals, e.tenant)
		return
	}
	u.totals[e.tenant] = t
}

// seenLocked ends the reservation of a create whose sandbox the catalog
// now shows (its totals count it from now on).
func (u *Usage) seenLocked(id string) {
	if r, ok := u.byID[id]; ok {
		delete(u.byID, id)
		delete(u.pending, r)
	}
}

// follow applies the watch's events; when the watch breaks it reloads and
// watches anew.
func (u *Usage) follow(ctx context.Context, rev int64) {
	follower{cli: u.cli, prefix: sandboxesPrefix, what: "the sandbox catalog", log: u.log, load: u.load, reloadTimeout: 30 * time.Second,
		apply: func(resp clientv3.WatchResponse) {
			u.mu.Lock()
			defer u.mu.Unlock()
			for _, ev := range resp.Events {
				k := string(ev.Kv.Key)
				if old, ok := u.entries[k]; ok {
					u.addLocked(old, -1)
					delete(u.entries, k)
				}
				if ev.Type != clientv3.EventTypePut {
					continue
				}
				if e, ok := decodeUsage(k, ev.Kv.Value, u.names); ok {
					u.entries[k] = e
					u.addLocked(e, 1)
					u.seenLocked(e.id)
				}
			}
		}}.run(ctx, rev)
}

// SetReplicas makes the replica's creates-per-second buckets its share
// (1/Count) of each tenant's rate. Call it before Reserve.
func (u *Usage) SetReplicas(r *Replica) { u.replicas = r }

// Of returns what tenant t's catalogued sandboxes take across the cluster.
func (u *Usage) Of(t string) Totals {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.totals[t]
}

// Tenants returns every tenant with a catalogued sandbox, with its totals.
func (u *Usage) Tenants() map[string]Totals {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := make(map[string]Totals, len(u.totals))
	for t, v := range u.totals {
		out[t] = v
	}
	return out
}

// Reserve claims memory and milliCPU of tenant t's quota for a create, or
// refuses it (resource_exhausted) when the tenant's sandboxes in the
// catalog plus this replica's reservations would pass its quota, or its
// creates-per-second bucket is empty. A create of no tenant (admin keys)
// reserves nothing (nil). Call Done when the create ends, and Created
// before that when it made a sandbox.
func (u *Usage) Reserve(t string, memory, milliCPU int64) (*Reservation, error) {
	if u == nil || t == "" {
		return nil, nil
	}
	q := u.quotas.Quota(t)
	now := time.Now()
	u.mu.Lock()
	defer u.mu.Unlock()
	mine := u.totals[t]
	for r := range u.pending {
		if !r.until.IsZero() && now.After(r.until) {
			u.dropLocked(r) // made, but never catalogued: the node's report would have
			continue
		}
		if r.tenant == t {
			mine.Sandboxes++
			mine.Memory = satAdd(mine.Memory, r.memory)
			mine.MilliCPU = satAdd(mine.MilliCPU, r.milliCPU)
		}
	}
	switch {
	case q.MaxSandboxes > 0 && mine.Sandboxes+1 > q.MaxSandboxes:
		return nil, errdefs.New(errdefs.ErrResourceExhausted,
			"tenant %s quota max-sandboxes: it has %d sandboxes of %d in the cluster: delete one first", t, mine.Sandboxes, q.MaxSandboxes)
	case q.MaxMemory > 0 && satAdd(mine.Memory, memory) > q.MaxMemory:
		return nil, errdefs.New(errdefs.ErrResourceExhausted,
			"tenant %s quota max-memory: its sandboxes have %d MiB of %d MiB in the cluster, and this one asks %d MiB", t, mine.Memory>>20, q.MaxMemory>>20, memory>>20)
	case q.MaxMilliCPU > 0 && satAdd(mine.MilliCPU, milliCPU) > q.MaxMilliCPU:
		return nil, errdefs.New(errdefs.ErrResourceExhausted,
			"tenant %s quota max-cpus: its sandboxes have %.3f cpus of %.3f in the cluster, and this one asks %.3f", t, float64(mine.MilliCPU)/1000, float64(q.MaxMilliCPU)/1000, float64(milliCPU)/1000)
	}
	r := &Reservation{u: u, tenant: t, memory: memory, milliCPU: milliCPU}
	if q.CreatesPerSecond > 0 {
		// This replica's share of the rate and burst.
		n := u.replicas.Count()
		rate, burst := q.CreatesPerSecond/float64(n), q.Burst
		if burst > 0 {
			burst = max(1, burst/n)
		}
		b := u.buckets[t]
		if b == nil || !b.Same(rate, burst) {
			b = tenant.NewBucket(rate, burst, now)
			u.buckets[t] = b
		}
		if !b.Take(now) {
			return nil, errdefs.New(errdefs.ErrResourceExhausted,
				"tenant %s quota creates-per-second: more than %g creates a second (burst %d) in the cluster (this control replica's share: 1/%d): retry later", t, q.CreatesPerSecond, q.Burst, n)
		}
		r.bucket = b
	} else {
		delete(u.buckets, t)
	}
	u.pending[r] = true
	return r, nil
}

func (u *Usage) dropLocked(r *Reservation) {
	delete(u.pending, r)
	if r.id != "" && u.byID[r.id] == r {
		delete(u.byID, r.id)
	}
}

// Created records the sandbox the create made: the reservation holds until
// the catalog shows it.
func (r *Reservation) Created(id string) {
	if r == nil || id == "" {
		return
	}
	r.u.mu.Lock()
	defer r.u.mu.Unlock()
	if !r.u.pending[r] {
		return
	}
	if _, ok := r.u.entries[sandboxesPrefix+TagOf(id)+"/"+id]; ok { // already catalogued (a fast watch)
		r.u.dropLocked(r)
		return
	}
	r.id = id
	r.u.byID[id] = r
}

// Done ends the create: a create that made no sandbox gives its
// reservation back now; one that did keeps it until the catalog shows the
// sandbox, for reservationHold at most.
func (r *Reservation) Done() {
	if r == nil {
		return
	}
	r.u.mu.Lock()
	defer r.u.mu.Unlock()
	if !r.u.pending[r] {
		return
	}
	if r.id == "" {
		r.u.dropLocked(r)
		if r.bucket != nil && r.u.buckets[r.tenant] == r.bucket {
			r.bucket.Put() // no sandbox made: the create does not count against the rate
		}
		return
	}
	r.until = time.Now().Add(reservationHold)
}

// satAdd adds without overflowing.
func satAdd(a, b int64) int64 {
	s := a + b
	if a > 0 && b > 0 && s < 0 {
		return 1<<63 - 1
	}
	if a < 0 && b < 0 && s >= 0 {
		return -1 << 63
	}
	return s
}
