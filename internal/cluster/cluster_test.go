package cluster

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/placement"
)

func client(t *testing.T, ep string) *clientv3.Client {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// eventually waits for cond, failing after a generous deadline.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestRegistryAndDirectory(t *testing.T) {
	resyncEvery = 2
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	engine := placement.New(placement.Config{})
	dir, err := WatchDirectory(ctx, client(t, ep), engine, log)
	if err != nil {
		t.Fatal(err)
	}
	sbs := map[string][]CatalogEntry{}
	register := func(name string, used int64) (*Registration, context.CancelFunc) {
		var reg *Registration
		reg, err := Register(ctx, client(t, ep), RegisterConfig{Name: name, URL: "http://" + name, E2BURL: "http://e2b." + name, TTL: 2 * time.Second, Log: log,
			Report: func() (placement.Node, []CatalogEntry) {
				return placement.Node{MilliCPU: 8000, Memory: 16 << 30, UsedMilliCPU: used, Backends: []string{"container"}}, sbs[name]
			}})
		if err != nil {
			t.Fatal(err)
		}
		rctx, stop := context.WithCancel(ctx)
		go reg.Run(rctx)
		return reg, stop
	}
	tagA, tagB := Tag("node-a"), Tag("node-b")
	idA, idB := tagA+strings.Repeat("a", 16), tagB+strings.Repeat("b", 16)
	sbs["node-a"] = []CatalogEntry{{ID: idA, Tenant: "t1"}}
	sbs["node-b"] = []CatalogEntry{{ID: idB}}
	_, stopA := register("node-a", 1000)
	regB, stopB := register("node-b", 0)
	defer stopA()
	eventually(t, "both nodes in the directory", func() bool { return len(dir.Live()) == 2 })
	if c := engine.Candidates(placement.Request{MilliCPU: 100}, 2); len(c) != 2 || c[0] != "node-b" {
		t.Fatalf("placement candidates %v: want node-b (emptier) then node-a", c)
	}
	if n, err := dir.ForSandbox(idA); err != nil || n.Name != "node-a" || n.URL != "http://node-a" || n.E2BURL != "http://e2b.node-a" {
		t.Fatalf("sandbox %s: %+v %v", idA, n, err)
	}
	if _, err := dir.ForSandbox("zzzz" + strings.Repeat("a", 16)); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown tag: %v, want not found", err)
	}
	// A second node with a name of the same tag is refused (none here:
	// the same name again is the same node, and is accepted).
	if _, err := Register(ctx, client(t, ep), RegisterConfig{Name: "node-a", TTL: 2 * time.Second, Report: func() (placement.Node, []CatalogEntry) { return placement.Node{}, nil }}); err != nil {
		t.Fatalf("re-register node-a: %v", err)
	}
	// node-b leaves (Run revokes its lease when stopped; a killed node's
	// lease expires after its TTL: test/cluster).
	_ = regB
	stopB()
	eventually(t, "node-b gone", func() bool { _, ok := dir.Node("node-b"); return !ok })
	if _, err := dir.ForSandbox(idB); !errors.Is(err, ErrLost) || !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("sandbox of the dead node: %v, want lost (unavailable)", err)
	}
	lost, err := dir.Lost(ctx)
	if err != nil || len(lost) != 1 || lost[0].ID != idB || lost[0].Node != "node-b" {
		t.Fatalf("lost %+v %v, want %s on node-b", lost, err, idB)
	}
	if c := engine.Candidates(placement.Request{}, 3); len(c) != 1 || c[0] != "node-a" {
		t.Fatalf("candidates after node-b died: %v", c)
	}
	// A control replica started now knows the dead node's tag too.
	dir2, err := WatchDirectory(ctx, client(t, ep), placement.New(placement.Config{}), log)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dir2.ForSandbox(idB); !errors.Is(err, ErrLost) {
		t.Fatalf("new replica, sandbox of the dead node: %v, want lost", err)
	}
	// node-a's sandbox goes: the catalog follows at the next heartbeat;
	// so does an entry a control replica wrote for a sandbox the node
	// never reported (created and deleted between two heartbeats).
	if err := dir.Catalog(ctx, CatalogEntry{ID: tagA + strings.Repeat("c", 16), Node: "node-a"}); err != nil {
		t.Fatal(err)
	}
	sbs["node-a"] = nil
	cli := client(t, ep)
	eventually(t, "catalog entries deleted", func() bool {
		r, err := cli.Get(ctx, sandboxesPrefix+tagA+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		return err == nil && r.Count == 0
	})
}

func TestTag(t *testing.T) {
	if Tag("a") == Tag("b") || len(Tag("x")) != TagLen || Tag("x") != Tag("x") {
		t.Fatal("tags")
	}
	for _, c := range Tag("node-1") {
		if !(c >= 'a' && c <= 'z' || c >= '2' && c <= '7') {
			t.Fatalf("tag %q outside the ID alphabet", Tag("node-1"))
		}
	}
	if ValidNodeName("Node_1") == nil || ValidNodeName("") == nil || ValidNodeName("node-1") != nil {
		t.Fatal("names")
	}
}
