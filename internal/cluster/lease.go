package cluster

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// keeper keeps one etcd lease alive, through etcd's concurrency.Session
// (the client's KeepAlive stream), and grants a new one when the lease has
// expired (the member was cut off from etcd longer than its TTL). A node's
// registration and a control replica's each hold one. Not safe for
// concurrent use.
type keeper struct {
	cli *clientv3.Client
	ttl int // seconds
	s   *concurrency.Session
}

func newKeeper(cli *clientv3.Client, ttl time.Duration) *keeper {
	return &keeper{cli: cli, ttl: int(max(ttl/time.Second, 2))}
}

// lease returns the live lease; fresh says it was granted now, so that
// what was put under the previous one (gone with it) must be put again.
// ctx bounds the grant only: the lease lives until close.
func (k *keeper) lease(ctx context.Context) (id clientv3.LeaseID, fresh bool, err error) {
	if k.s != nil {
		select {
		case <-k.s.Done(): // expired, or the client closed
			k.s = nil
		default:
			return k.s.Lease(), false, nil
		}
	}
	l, err := k.cli.Grant(ctx, int64(k.ttl))
	if err != nil {
		return 0, false, fmt.Errorf("grant lease: %w", err)
	}
	s, err := concurrency.NewSession(k.cli, concurrency.WithLease(l.ID), concurrency.WithTTL(k.ttl))
	if err != nil {
		k.cli.Revoke(ctx, l.ID)
		return 0, false, fmt.Errorf("keep lease alive: %w", err)
	}
	k.s = s
	return l.ID, true, nil
}

// close stops renewing the lease and revokes it (bounded by the TTL: an
// unrevoked lease expires by itself then).
func (k *keeper) close() {
	if k.s != nil {
		k.s.Close()
		k.s = nil
	}
}

// drop stops renewing the lease without revoking it (it expires after its
// TTL); the next call of lease grants a new one.
func (k *keeper) drop() {
	if k.s != nil {
		k.s.Orphan()
		k.s = nil
	}
}
