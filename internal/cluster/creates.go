package cluster

// Creates with a client key are claimed in etcd before they are placed, so
// that a retry through any control replica lands on the node the first
// try went to, where the node's own client-key check returns the sandbox
// made for it (or waits for the one being made):
//
//	creates/<sha256 of tenant and key>   CreateClaim as JSON, under a lease
//	                                     of Claims' TTL (shared by the
//	                                     claims of a stretch of time)
//
// A claim names the node (pinned before the create is sent there) and,
// once made, the sandbox. Every change is a compare-and-swap on the key's
// revision, so two replicas that move one claim agree on where it is.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

const createsPrefix = Prefix + "creates/"

// CreateClaim is where a create with a client key went.
type CreateClaim struct {
	Node string `json:"node"`
	// ID of the sandbox made; empty while it is being made.
	ID      string    `json:"id,omitempty"`
	Tenant  string    `json:"tenant,omitempty"`
	Replica string    `json:"replica,omitempty"`
	Updated time.Time `json:"updated"`
}

// ClaimKey is the claim's key of a tenant's client key.
func ClaimKey(tenant, clientKey string) string {
	h := sha256.New()
	h.Write([]byte(tenant))
	h.Write([]byte{0})
	h.Write([]byte(clientKey))
	return hex.EncodeToString(h.Sum(nil))
}

// Claims reads and writes create claims.
type Claims struct {
	cli *clientv3.Client
	ttl time.Duration

	mu      sync.Mutex
	lease   clientv3.LeaseID // the lease new claims take; guarded by mu
	leaseAt time.Time        // when it was granted; guarded by mu
}

// NewClaims returns the claims of cli's etcd; each lives ttl (1 minute to
// 1 week; 0: 1 hour) after its last write, give or take a tenth.
func NewClaims(cli *clientv3.Client, ttl time.Duration) (*Claims, error) {
	if ttl == 0 {
		ttl = time.Hour
	}
	if ttl < time.Minute || ttl > 7*24*time.Hour {
		return nil, fmt.Errorf("client key TTL %s: want 1m to 168h", ttl)
	}
	return &Claims{cli: cli, ttl: ttl}, nil
}

// leaseFor returns a lease for a claim written now: one lease per tenth of
// the TTL, so that a burst of creates grants one lease, not one each.
func (c *Claims) leaseFor(ctx context.Context) (clientv3.LeaseID, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lease != 0 && time.Since(c.leaseAt) < c.ttl/10 {
		return c.lease, nil
	}
	l, err := c.cli.Grant(ctx, int64((c.ttl+c.ttl/10)/time.Second))
	if err != nil {
		return 0, err
	}
	c.lease, c.leaseAt = l.ID, time.Now()
	return l.ID, nil
}

// Get returns the claim of key and its revision (0: none).
func (c *Claims) Get(ctx context.Context, key string) (CreateClaim, int64, error) {
	resp, err := c.cli.Get(ctx, createsPrefix+key)
	if err != nil {
		return CreateClaim{}, 0, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("read a client key's claim from etcd: %w", err))
	}
	if len(resp.Kvs) == 0 {
		return CreateClaim{}, 0, nil
	}
	var cl CreateClaim
	if err := json.Unmarshal(resp.Kvs[0].Value, &cl); err != nil {
		return CreateClaim{}, 0, fmt.Errorf("decode a client key's claim: %w", err)
	}
	return cl, resp.Kvs[0].ModRevision, nil
}

// Put writes claim if key is still at revision ifRev (0: if it has no
// claim). It returns the claim's new revision and true; or, when someone
// else wrote it first, the claim there and its revision, and false.
func (c *Claims) Put(ctx context.Context, key string, claim CreateClaim, ifRev int64) (CreateClaim, int64, bool, error) {
	lease, err := c.leaseFor(ctx)
	if err != nil {
		return CreateClaim{}, 0, false, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("grant a lease for client keys in etcd: %w", err))
	}
	claim.Updated = time.Now().UTC()
	v, _ := json.Marshal(claim)
	k := createsPrefix + key
	cmp := clientv3.Compare(clientv3.ModRevision(k), "=", ifRev)
	if ifRev == 0 {
		cmp = clientv3.Compare(clientv3.CreateRevision(k), "=", 0)
	}
	resp, err := c.cli.Txn(ctx).If(cmp).Then(clientv3.OpPut(k, string(v), clientv3.WithLease(lease))).Else(clientv3.OpGet(k)).Commit()
	if err != nil {
		return CreateClaim{}, 0, false, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("write a client key's claim to etcd: %w", err))
	}
	if resp.Succeeded {
		return claim, resp.Header.Revision, true, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return CreateClaim{}, 0, false, nil // removed (its lease ran out)
	}
	var cur CreateClaim
	if err := json.Unmarshal(kvs[0].Value, &cur); err != nil {
		return CreateClaim{}, 0, false, fmt.Errorf("decode a client key's claim: %w", err)
	}
	return cur, kvs[0].ModRevision, false, nil
}
