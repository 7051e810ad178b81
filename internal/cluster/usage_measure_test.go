package cluster

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
)

// TestMeasureUsageLoad measures what a control replica's Usage costs:
// SHOAL_USAGE_MEASURE=N catalogs N sandboxes (160 nodes, 50 tenants) in an
// embedded etcd, then logs how long a replica takes to load them, the heap
// they take, and one Reserve+Done. Skipped unless set.
func TestMeasureUsageLoad(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("SHOAL_USAGE_MEASURE"))
	if n <= 0 {
		t.Skip("set SHOAL_USAGE_MEASURE=N to measure a replica's usage of N catalogued sandboxes")
	}
	ep := etcdtest.Start(t)
	ctx := context.Background()
	cli := client(t, ep)
	var ops []clientv3.Op
	for i := 0; i < n; i++ {
		tag := Tag(fmt.Sprint("n", i%160))
		id := fmt.Sprintf("%s%016d", tag, i)
		e := CatalogEntry{ID: id, Node: "n", Tenant: fmt.Sprint("team-", i%50), Memory: 512 << 20, MilliCPU: 1000, Created: time.Now()}
		ops = append(ops, clientv3.OpPut(sandboxesPrefix+tag+"/"+id, string(mustJSON(t, e))))
		if len(ops) == 100 || i == n-1 {
			if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
			ops = nil
		}
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	runtime.GC()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	start := time.Now()
	u, err := WatchUsage(ctx, cli, quotaMap{}, log)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	runtime.GC()
	runtime.ReadMemStats(&m1)
	t.Logf("loaded %d catalog entries in %v; heap +%d MiB (%d B/entry); team-7: %+v", n, took, (m1.HeapAlloc-m0.HeapAlloc)>>20, (m1.HeapAlloc-m0.HeapAlloc)/uint64(n), u.Of("team-7"))
	start = time.Now()
	for i := 0; i < 100000; i++ {
		r, _ := u.Reserve("team-7", 1, 1)
		r.Done()
	}
	t.Logf("Reserve+Done: %v each", time.Since(start)/100000)
}
