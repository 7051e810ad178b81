package cluster

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
)

// A member whose lease is gone (revoked here; in life, expired while it
// was cut off from etcd) gets a new one and publishes itself again; while
// connected, its lease is kept alive past its TTL without a heartbeat;
// Run's end revokes it.
func TestReplicaLeaseRenewedAndReplaced(t *testing.T) {
	ep := etcdtest.Start(t)
	cli := client(t, ep)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	r, err := RegisterReplica(ctx, cli, "http://replica-a", 2*time.Second, log)
	if err != nil {
		t.Fatal(err)
	}
	key := replicasPrefix + r.ID()
	present := func() bool {
		resp, err := cli.Get(ctx, key)
		return err == nil && len(resp.Kvs) == 1
	}
	first, fresh, err := r.lease.lease(ctx)
	if err != nil || fresh {
		t.Fatalf("lease after register: %v fresh=%v err=%v", first, fresh, err)
	}
	// Kept alive by the session alone (no Run, no beat) well past its TTL.
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if !present() {
			t.Fatal("the replica's key expired while its session kept the lease alive")
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, err := cli.Revoke(ctx, first); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the key gone with its lease", func() bool { return !present() })
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { r.Run(runCtx); close(done) }()
	eventually(t, "the replica published again under a new lease", present)
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) != 1 || clientv3.LeaseID(resp.Kvs[0].Lease) == first {
		t.Fatalf("key %s after re-publish: %+v, %v (old lease %x)", key, resp, err, first)
	}
	stop()
	<-done
	if present() {
		t.Fatal("Run's end left the replica's key (its lease not revoked)")
	}
}
