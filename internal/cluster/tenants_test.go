package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// TestTenancy runs two processes' copies of the cluster's keys over one
// real etcd: a key made through one resolves at once there and at the
// other when its watch has it; a name is taken once, even by two racing
// creates; a removal and a quota change reach the other copy; only the
// hash is stored; a new copy loads what is there; a bad value in etcd is
// ignored, not trusted.
func TestTenancy(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	a, err := WatchTenancy(ctx, client(t, ep), log)
	if err != nil {
		t.Fatal(err)
	}
	b, err := WatchTenancy(ctx, client(t, ep), log)
	if err != nil {
		t.Fatal(err)
	}
	secret, k, err := a.CreateKey(ctx, "ci", "team-a", []tenant.Scope{tenant.ScopeSandboxes})
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := a.Resolve(secret); !ok || got.Tenant != "team-a" || got.Name != "ci" {
		t.Fatalf("resolve where it was made: %+v %v", got, ok) // no wait: its own copy has it when CreateKey returns
	}
	eventually(t, "the key at the other copy", func() bool { _, ok := b.Resolve(secret); return ok })
	if _, ok := b.Resolve(secret + "x"); ok {
		t.Fatal("a wrong secret resolved")
	}
	raw, err := client(t, ep).Get(ctx, tenantKeys+"ci")
	if err != nil || len(raw.Kvs) != 1 {
		t.Fatalf("etcd: %v %v", raw, err)
	}
	if strings.Contains(string(raw.Kvs[0].Value), secret) || !strings.Contains(string(raw.Kvs[0].Value), k.Hash) {
		t.Fatalf("etcd holds %s: want the hash only", raw.Kvs[0].Value)
	}
	// A name is taken once: through the other copy, and by racing creates.
	if _, _, err := b.CreateKey(ctx, "ci", "team-b", []tenant.Scope{tenant.ScopeSandboxes}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("second key named ci: %v, want already exists", err)
	}
	var wg sync.WaitGroup
	var won [2]bool
	for i, s := range []*Tenancy{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := s.CreateKey(ctx, "race", fmt.Sprint("t", i), []tenant.Scope{tenant.ScopeSandboxes})
			won[i] = err == nil
		}()
	}
	wg.Wait()
	if won[0] == won[1] {
		t.Fatalf("two racing creates of one name: %v, want exactly one", won)
	}
	if _, _, err := a.CreateKey(ctx, "x", "", []tenant.Scope{tenant.ScopeSandboxes}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("key without tenant: %v", err)
	}
	// A quota set through one copy bounds the tenant at the other.
	q := tenant.Quota{MaxSandboxes: 3, MaxMemory: 1 << 30}
	if err := b.SetQuota(ctx, "team-a", q); err != nil {
		t.Fatal(err)
	}
	if b.Quota("team-a") != q {
		t.Fatalf("quota where it was set: %+v", b.Quota("team-a"))
	}
	eventually(t, "the quota at the other copy", func() bool { return a.Quota("team-a") == q })
	if err := a.SetQuota(ctx, "team-a", tenant.Quota{MaxSandboxes: -1}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("negative quota: %v", err)
	}
	if ts := a.Tenants(); len(ts) != 2 || ts["team-a"] != q {
		t.Fatalf("tenants: %+v, want team-a (quota), and t0 or t1 (a key)", ts)
	}
	// A new copy (a process started later) loads what is there; a bad
	// value in etcd is ignored.
	if _, err := client(t, ep).Put(ctx, tenantKeys+"forged", `{"name":"forged","tenant":"team-a","scopes":["admin"],"hash":"nothex"}`); err != nil {
		t.Fatal(err)
	}
	if _, err := client(t, ep).Put(ctx, tenantKeys+"renamed", string(mustJSON(t, tenant.Key{Name: "other", Tenant: "team-a", Scopes: []tenant.Scope{tenant.ScopeSandboxes}, Hash: k.Hash}))); err != nil {
		t.Fatal(err)
	}
	c, err := WatchTenancy(ctx, client(t, ep), log)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := c.Resolve(secret); !ok || got.Name != "ci" {
		t.Fatalf("a new copy resolves %+v %v", got, ok)
	}
	if n := len(c.Keys()); n != 2 {
		t.Fatalf("new copy has %d keys (%v), want ci and the race's winner (bad values left out)", n, c.Keys())
	}
	// Removal through the other copy: the key stops working everywhere.
	if _, err := b.DeleteKey(ctx, "ci"); err != nil {
		t.Fatal(err)
	}
	if _, ok := b.Resolve(secret); ok {
		t.Fatal("a removed key still resolves where it was removed")
	}
	eventually(t, "the removal at the first copy", func() bool { _, ok := a.Resolve(secret); return !ok })
	eventually(t, "the removal at the third copy", func() bool { _, ok := c.Resolve(secret); return !ok })
	if _, err := a.DeleteKey(ctx, "ci"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("remove again: %v, want not found", err)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type quotaMap map[string]tenant.Quota

func (m quotaMap) Quota(t string) tenant.Quota { return m[t] }

// TestUsageQuotas checks the cluster-wide quota of a control replica
// against a real etcd catalog: sandboxes of two nodes count together,
// creates in flight count until the catalog shows them, a refused create
// says which quota, a failed create gives its reservation back, and a
// deletion frees the quota.
func TestUsageQuotas(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	cli := client(t, ep)
	quotas := quotaMap{"team-a": {MaxSandboxes: 3, MaxMemory: 4 << 30}, "team-r": {CreatesPerSecond: 0.001, Burst: 1}}
	catalog := func(node, id, tn string, mem int64) {
		e := CatalogEntry{ID: id, Node: node, Tenant: tn, Memory: mem, MilliCPU: 1000}
		if _, err := cli.Put(ctx, sandboxesPrefix+Tag(node)+"/"+id, string(mustJSON(t, e))); err != nil {
			t.Fatal(err)
		}
	}
	catalog("n1", Tag("n1")+"aaaa", "team-a", 1<<30) // before the replica starts: loaded
	u, err := WatchUsage(ctx, cli, quotas, log)
	if err != nil {
		t.Fatal(err)
	}
	if got := u.Of("team-a"); got.Sandboxes != 1 || got.Memory != 1<<30 {
		t.Fatalf("loaded usage %+v", got)
	}
	catalog("n2", Tag("n2")+"bbbb", "team-a", 1<<30) // another node's
	catalog("n2", Tag("n2")+"cccc", "team-b", 1<<30) // another tenant's
	eventually(t, "n2's sandbox counted", func() bool { return u.Of("team-a").Sandboxes == 2 })
	// The third: reserved (in flight), so a fourth is refused even before
	// the catalog has the third.
	r3, err := u.Reserve("team-a", 1<<30, 1000)
	if err != nil {
		t.Fatal(err)
	}
	_, err = u.Reserve("team-a", 1<<30, 1000)
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "max-sandboxes: it has 3 sandboxes of 3 in the cluster") {
		t.Fatalf("fourth create with the third in flight: %v", err)
	}
	r3.Created(Tag("n1") + "dddd")
	r3.Done()
	if _, err := u.Reserve("team-a", 1<<30, 1000); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("fourth create with the third made, not catalogued yet: %v", err)
	}
	catalog("n1", Tag("n1")+"dddd", "team-a", 1<<30)
	eventually(t, "the third catalogued", func() bool { return u.Of("team-a").Sandboxes == 3 })
	if _, err := u.Reserve("team-a", 1<<30, 1000); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("fourth create with the third catalogued: %v", err)
	}
	u.mu.Lock()
	pending := len(u.pending)
	u.mu.Unlock()
	if pending != 0 {
		t.Fatalf("%d reservations left once the catalog has the sandbox", pending)
	}
	// A delete frees one; memory is the bound then.
	if _, err := cli.Delete(ctx, sandboxesPrefix+Tag("n2")+"/"+Tag("n2")+"bbbb"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the deletion counted", func() bool { return u.Of("team-a").Sandboxes == 2 })
	if _, err := u.Reserve("team-a", 3<<30, 1000); !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "max-memory") {
		t.Fatalf("a create past the memory quota: %v", err)
	}
	r, err := u.Reserve("team-a", 1<<30, 1000)
	if err != nil {
		t.Fatal(err)
	}
	r.Done() // failed: nothing made, the reservation is given back
	if r, err = u.Reserve("team-a", 1<<30, 1000); err != nil {
		t.Fatalf("after a failed create: %v", err)
	}
	r.Done()
	// No tenant, or no quota: no bound.
	if r, err := u.Reserve("", 1<<40, 1<<20); err != nil || r != nil {
		t.Fatalf("admin create: %v %v", r, err)
	}
	if _, err := u.Reserve("team-b", 1<<40, 1<<20); err != nil {
		t.Fatalf("tenant without quota: %v", err)
	}
	// The rate: one create, then refused; a failed one gives its token back.
	r, err = u.Reserve("team-r", 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	r.Done()
	r, err = u.Reserve("team-r", 1, 1)
	if err != nil {
		t.Fatalf("after a failed create, its token back: %v", err)
	}
	r.Created(Tag("n1") + "rrrr")
	r.Done()
	if _, err := u.Reserve("team-r", 1, 1); !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "creates-per-second") {
		t.Fatalf("second create at 0.001/s: %v", err)
	}
}

// TestResolveFresh: a key made through one process is accepted by the
// first request that uses it at another whose watch has not delivered it
// yet (the miss catches up with etcd), and a wrong key is refused in
// bounded time.
func TestResolveFresh(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	a, err := WatchTenancy(ctx, client(t, ep), log)
	if err != nil {
		t.Fatal(err)
	}
	// b has loaded, but its watch starts only once its first miss is
	// catching up: its copy is behind when the request comes.
	b := newTenancy(client(t, ep), log)
	rev, err := b.load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	secret, _, err := a.CreateKey(ctx, "fresh", "team-a", []tenant.Scope{tenant.ScopeSandboxes})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := b.Resolve(secret); ok {
		t.Fatal("b's copy has the key before its watch ran")
	}
	got := make(chan bool, 1)
	go func() { _, ok := b.ResolveFresh(ctx, secret); got <- ok }()
	eventually(t, "b's miss catching up", func() bool {
		if b.catchMu.TryLock() { // not yet: the catch-up holds it until it ends
			b.catchMu.Unlock()
			return false
		}
		return true
	})
	go b.follow(ctx, rev)
	select {
	case ok := <-got:
		if !ok {
			t.Fatal("a key made elsewhere was refused at its first use")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("ResolveFresh hung")
	}
	start := time.Now()
	if _, ok := b.ResolveFresh(ctx, secret+"x"); ok {
		t.Fatal("a wrong key resolved")
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("a wrong key took %v to refuse", d)
	}
}

// TestReplicasSplitRate: control replicas register; each finds the others
// (for the audit), and a tenant's creates per second is split among them.
func TestReplicasSplitRate(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	r1, err := RegisterReplica(ctx, client(t, ep), "http://r1", 0, log)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := RegisterReplica(ctx, client(t, ep), "http://r2", 0, log)
	if err != nil {
		t.Fatal(err)
	}
	if err := r1.beat(ctx); err != nil { // r1 counts r2 at its next heartbeat
		t.Fatal(err)
	}
	if r1.Count() != 2 || r2.Count() != 2 {
		t.Fatalf("replicas counted %d and %d, want 2", r1.Count(), r2.Count())
	}
	peers, err := r1.Peers(ctx)
	if err != nil || len(peers) != 1 || peers[0].URL != "http://r2" {
		t.Fatalf("r1's peers: %v %v", peers, err)
	}
	// A burst of 2 split between 2 replicas: 1 here.
	u, err := WatchUsage(ctx, client(t, ep), quotaMap{"team-r": {CreatesPerSecond: 0.001, Burst: 2}}, log)
	if err != nil {
		t.Fatal(err)
	}
	u.SetReplicas(r1)
	r, err := u.Reserve("team-r", 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	r.Created(Tag("n1") + "r001")
	r.Done()
	if _, err := u.Reserve("team-r", 1, 1); !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "share: 1/2") {
		t.Fatalf("second create at burst 2 over 2 replicas: %v, want refused", err)
	}
	// r2 leaves: r1 has the whole rate at its next heartbeat.
	cctx, ccancel := context.WithCancel(ctx)
	ccancel()
	r2.Run(cctx) // revokes its lease at once
	if err := r1.beat(ctx); err != nil {
		t.Fatal(err)
	}
	if r1.Count() != 1 {
		t.Fatalf("after r2 left: %d replicas", r1.Count())
	}
	if _, err := u.Reserve("team-r", 1, 1); err != nil {
		t.Fatalf("the second create with the whole burst: %v", err)
	}
}
