package cluster

// Control replicas register too (replicas/<id>, under a lease): not for
// routing (clients reach replicas through their own load balancer), but so
// that a replica knows its peers: `shoal audit` through one replica reads
// every replica's log, and a tenant's creates-per-second is split among
// the live replicas.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

const replicasPrefix = Prefix + "replicas/"

// ReplicaInfo is what a control replica publishes about itself.
type ReplicaInfo struct {
	ID      string    `json:"id"`
	URL     string    `json:"url"` // its API, as the other replicas reach it
	Started time.Time `json:"started"`
}

// Replica is a control replica's membership of the cluster. It is safe
// for concurrent use.
type Replica struct {
	cli   *clientv3.Client
	info  ReplicaInfo
	ttl   time.Duration
	log   *slog.Logger
	lease *keeper      // only Run's goroutine, after RegisterReplica
	count atomic.Int64 // live replicas, as last read (at least 1)
}

// RegisterReplica publishes a replica whose API is at url under a lease of
// ttl (0: 10 s); Run keeps it alive.
func RegisterReplica(ctx context.Context, cli *clientv3.Client, url string, ttl time.Duration, log *slog.Logger) (*Replica, error) {
	if ttl == 0 {
		ttl = 10 * time.Second
	}
	if ttl < 2*time.Second || ttl > 10*time.Minute {
		return nil, fmt.Errorf("control replica lease TTL %s: want 2s to 10m", ttl)
	}
	var raw [8]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return nil, err
	}
	r := &Replica{cli: cli, ttl: ttl, log: log, lease: newKeeper(cli, ttl), info: ReplicaInfo{ID: hex.EncodeToString(raw[:]), URL: url, Started: time.Now().UTC()}}
	r.count.Store(1)
	if err := r.beat(ctx); err != nil {
		return nil, err
	}
	return r, nil
}

// ID is the replica's ID in etcd.
func (r *Replica) ID() string { return r.info.ID }

// Run heartbeats until ctx ends, then leaves.
func (r *Replica) Run(ctx context.Context) {
	t := time.NewTicker(r.ttl / 3)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			r.lease.close()
			return
		case <-t.C:
		}
		c, cancel := context.WithTimeout(ctx, r.ttl/3)
		if err := r.beat(c); err != nil && ctx.Err() == nil {
			r.log.Warn("cluster: control replica heartbeat", "err", err)
		}
		cancel()
	}
}

// beat publishes the replica when its lease is new (the first, or one
// granted after the last expired) and counts the live ones.
func (r *Replica) beat(ctx context.Context) error {
	lease, fresh, err := r.lease.lease(ctx)
	if err != nil {
		return err
	}
	if fresh {
		b, _ := json.Marshal(r.info)
		if _, err := r.cli.Put(ctx, replicasPrefix+r.info.ID, string(b), clientv3.WithLease(lease)); err != nil {
			r.lease.drop() // publish under a new lease next time
			return fmt.Errorf("publish the replica: %w", err)
		}
	}
	resp, err := r.cli.Get(ctx, replicasPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return fmt.Errorf("count replicas: %w", err)
	}
	r.count.Store(max(resp.Count, 1))
	return nil
}

// Count is how many control replicas are live (at the last heartbeat; at
// least 1).
func (r *Replica) Count() int64 {
	if r == nil {
		return 1
	}
	return r.count.Load()
}

// Peers returns the other live replicas.
func (r *Replica) Peers(ctx context.Context) ([]ReplicaInfo, error) {
	resp, err := r.cli.Get(ctx, replicasPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("read the control replicas: %w", err)
	}
	var out []ReplicaInfo
	for _, kv := range resp.Kvs {
		var p ReplicaInfo
		if json.Unmarshal(kv.Value, &p) != nil || p.ID == r.info.ID || !strings.HasPrefix(p.URL, "http") {
			continue
		}
		out = append(out, p)
	}
	return out, nil
}
