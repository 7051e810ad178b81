package control

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	"github.com/shoal-sandbox/shoal/internal/e2b"
	"github.com/shoal-sandbox/shoal/internal/placement"
)

// fakeNode is a node's SandboxService as far as creates go: a client key
// gives one sandbox (a create of a key being made waits for it, as a
// node's lockKey does), it may be full, it may take a while (finishing a
// create whose caller went away, as a node may), and it may drop its
// answers to creates after making the sandbox (the connection cut).
type fakeNode struct {
	shoalv1connect.UnimplementedSandboxServiceHandler
	tag   string
	full  atomic.Bool
	drop  atomic.Int32 // answers to drop, after making the sandbox
	delay time.Duration

	mu        sync.Mutex
	keys      map[string]string      // client key → sandbox ID
	sandboxes map[string]bool        // live sandbox IDs
	locks     map[string]*sync.Mutex // client key → its lock
	made      int                    // sandboxes made in all
}

func newFakeNode(name string, delay time.Duration) *fakeNode {
	return &fakeNode{tag: cluster.Tag(name), delay: delay, keys: map[string]string{}, sandboxes: map[string]bool{}, locks: map[string]*sync.Mutex{}}
}

func (n *fakeNode) CreateSandbox(ctx context.Context, req *connect.Request[pb.CreateSandboxRequest]) (*connect.Response[pb.Sandbox], error) {
	if n.full.Load() {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("node full"))
	}
	k := req.Msg.ClientKey
	n.mu.Lock()
	l := n.locks[k]
	if l == nil {
		l = &sync.Mutex{}
		n.locks[k] = l
	}
	n.mu.Unlock()
	l.Lock()
	defer l.Unlock()
	n.mu.Lock()
	if id := n.keys[k]; k != "" && n.sandboxes[id] {
		n.mu.Unlock()
		return connect.NewResponse(&pb.Sandbox{Id: id}), nil
	}
	n.mu.Unlock()
	time.Sleep(n.delay) // not ctx: the create goes on if its caller leaves
	var b [8]byte
	rand.Read(b[:])
	id := n.tag + hex.EncodeToString(b[:])
	n.mu.Lock()
	n.sandboxes[id] = true
	n.made++
	if k != "" {
		n.keys[k] = id
	}
	n.mu.Unlock()
	return connect.NewResponse(&pb.Sandbox{Id: id}), nil
}

func (n *fakeNode) DeleteSandbox(ctx context.Context, req *connect.Request[pb.DeleteSandboxRequest]) (*connect.Response[pb.DeleteSandboxResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.sandboxes[req.Msg.Id] {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("no sandbox %s", req.Msg.Id))
	}
	delete(n.sandboxes, req.Msg.Id)
	return connect.NewResponse(&pb.DeleteSandboxResponse{}), nil
}

// live returns the node's sandboxes.
func (n *fakeNode) live() map[string]bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := map[string]bool{}
	for id := range n.sandboxes {
		out[id] = true
	}
	return out
}

// handler serves n (Shoal's creates, and E2B's on POST /sandboxes with
// the key of e2b.ClientKeyHeader), dropping the answer of a create while
// n.drop says so: the sandbox is made, then the connection is closed with
// no answer.
func (n *fakeNode) handler() http.Handler {
	path, h := shoalv1connect.NewSandboxServiceHandler(n)
	mux := http.NewServeMux()
	mux.Handle(path, h)
	mux.HandleFunc("POST /sandboxes", func(w http.ResponseWriter, r *http.Request) {
		res, err := n.CreateSandbox(r.Context(), connect.NewRequest(&pb.CreateSandboxRequest{ClientKey: r.Header.Get(e2b.ClientKeyHeader)}))
		if err != nil {
			e2b.WriteError(w, http.StatusServiceUnavailable, err.Error())
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"sandboxID":%q,"domain":"node.internal:1"}`, res.Msg.Id)
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		creating := r.URL.Path == shoalv1connect.SandboxServiceCreateSandboxProcedure || r.URL.Path == "/sandboxes"
		if !creating || n.drop.Load() <= 0 {
			mux.ServeHTTP(w, r)
			return
		}
		n.drop.Add(-1)
		mux.ServeHTTP(httptest.NewRecorder(), r) // made, answer thrown away
		if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
			c.Close()
		}
	})
}

// replicaCluster is two control replicas in front of fake nodes, in a real
// (embedded) etcd.
type replicaCluster struct {
	cli      *clientv3.Client
	leave    map[string]func() // a node leaves the cluster (its lease revoked)
	servers  map[string]*httptest.Server
	nodes    map[string]*fakeNode
	replicas []*httptest.Server
	e2b      []*httptest.Server // the replicas' E2B endpoints
}

const replicaTestKey = "sk_shoal_replicatest"

// startReplicas registers fake nodes (the first looks emptiest, so it is
// placed first) and starts two replicas.
func startReplicas(t testing.TB, ctx context.Context, names []string, delay time.Duration) *replicaCluster {
	t.Helper()
	ep := etcdtest.Start(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	cli := func() *clientv3.Client {
		c, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	rc := &replicaCluster{cli: cli(), leave: map[string]func(){}, servers: map[string]*httptest.Server{}, nodes: map[string]*fakeNode{}}
	for i, name := range names {
		n := newFakeNode(name, delay)
		rc.nodes[name] = n
		srv := httptest.NewServer(n.handler())
		t.Cleanup(srv.Close)
		rc.servers[name] = srv
		used := int64(i) << 32
		// A lease that a loaded host (the race detector, load 13) cannot
		// lose between two renewals: nodes here leave by revoking it.
		reg, err := cluster.Register(ctx, cli(), cluster.RegisterConfig{Name: name, URL: srv.URL, E2BURL: srv.URL, TTL: 10 * time.Second, Log: log,
			Report: func() (placement.Node, []cluster.CatalogEntry) {
				return placement.Node{MilliCPU: 1 << 20, Memory: 1 << 50, UsedMilliCPU: used >> 20, UsedMemory: used, Backends: []string{"container"}}, nil
			}})
		if err != nil {
			t.Fatal(err)
		}
		rctx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); reg.Run(rctx) }()
		rc.leave[name] = func() { stop(); <-done }
		t.Cleanup(rc.leave[name])
	}
	for range 2 {
		engine := placement.New(placement.Config{MaxWait: 5 * time.Second})
		dir, err := cluster.WatchDirectory(ctx, cli(), engine, log)
		if err != nil {
			t.Fatal(err)
		}
		waitUntil(t, "every node in a replica's directory", func() bool { return len(dir.Live()) == len(names) })
		f := NewForwarder(dir, engine, &Auth{key: []byte(replicaTestKey)}, log)
		srv := httptest.NewServer(f.Handler())
		t.Cleanup(srv.Close)
		rc.replicas = append(rc.replicas, srv)
		e2bSrv := httptest.NewServer(f.E2BHandler("ctl.example:7481"))
		t.Cleanup(e2bSrv.Close)
		rc.e2b = append(rc.e2b, e2bSrv)
	}
	return rc
}

// create creates through replica i.
func (rc *replicaCluster) create(ctx context.Context, i int, clientKey string) (string, error) {
	c := shoalv1connect.NewSandboxServiceClient(http.DefaultClient, rc.replicas[i].URL)
	req := connect.NewRequest(&pb.CreateSandboxRequest{Base: "debian:12", ClientKey: clientKey})
	req.Header().Set("Authorization", "Bearer "+replicaTestKey)
	res, err := c.CreateSandbox(ctx, req)
	if err != nil {
		return "", err
	}
	return res.Msg.Id, nil
}

// all returns every live sandbox of the fake nodes, and how many were
// made in all.
func (rc *replicaCluster) all() (map[string]bool, int) {
	out := map[string]bool{}
	made := 0
	for _, n := range rc.nodes {
		for id := range n.live() {
			out[id] = true
		}
		n.mu.Lock()
		made += n.made
		n.mu.Unlock()
	}
	return out, made
}

// TestKeyedCreateAcrossReplicas: a create retried with its client key
// through the other replica returns the same sandbox, also when both
// replicas get it at once; a key whose node is full moves to the next
// node, and a retry follows it there.
func TestKeyedCreateAcrossReplicas(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rc := startReplicas(t, ctx, []string{"n1", "n2", "n3"}, 0)

	id, err := rc.create(ctx, 0, "rollout-1/env-1")
	if err != nil {
		t.Fatal(err)
	}
	if again, err := rc.create(ctx, 1, "rollout-1/env-1"); err != nil || again != id {
		t.Fatalf("the retry through the other replica: %s %v; want %s", again, err, id)
	}

	// Both replicas at once, twice each, for many keys.
	const keys = 16
	ids := make([][4]string, keys)
	var wg sync.WaitGroup
	for k := range keys {
		for j := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got, err := rc.create(ctx, j%2, fmt.Sprintf("burst/%d", k))
				if err != nil {
					t.Errorf("key %d through replica %d: %v", k, j%2, err)
				}
				ids[k][j] = got
			}()
		}
	}
	wg.Wait()
	for k, got := range ids {
		if got[0] == "" || got[1] != got[0] || got[2] != got[0] || got[3] != got[0] {
			t.Errorf("key %d: sandboxes %v; want one", k, got)
		}
	}
	if live, made := rc.all(); len(live) != keys+1 || made != keys+1 {
		t.Fatalf("%d sandboxes live, %d made, for %d keys", len(live), made, keys+1)
	}

	// The first node fills up: a new key goes to another node (n2 or n3);
	// its retry (n1 full still) follows the claim there.
	rc.nodes["n1"].full.Store(true)
	id2, err := rc.create(ctx, 0, "full/1")
	if err != nil || cluster.TagOf(id2) == cluster.Tag("n1") || cluster.TagOf(id2) == "" {
		t.Fatalf("a create with n1 full: %s %v; want one on n2 or n3", id2, err)
	}
	rc.nodes["n1"].full.Store(false)
	if again, err := rc.create(ctx, 1, "full/1"); err != nil || again != id2 {
		t.Fatalf("its retry once n1 has room: %s %v; want %s", again, err, id2)
	}

	// A key claimed on n3, live but not reached (its API gone): not moved
	// (a try before may have made it there), the retry says so.
	claims, err := cluster.NewClaims(rc.cli, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok, err := claims.Put(ctx, cluster.ClaimKey("", "unreached/1"), cluster.CreateClaim{Node: "n3"}, 0); !ok || err != nil {
		t.Fatalf("claim: %v %v", ok, err)
	}
	rc.servers["n3"].Close()
	before, _ := rc.all()
	if _, err := rc.create(ctx, 0, "unreached/1"); connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "not reached") {
		t.Fatalf("a key claimed on a node not reached: %v; want unavailable, not reached", err)
	}
	if after, _ := rc.all(); len(after) != len(before) {
		t.Fatalf("a key claimed on a node not reached made a sandbox elsewhere: %d sandboxes, %d before", len(after), len(before))
	}
	rc.leave["n3"]()

	// n1 goes down: a key claimed there with no sandbox recorded (its
	// replica died between claim and answer) is placed anew on n2; a key
	// whose sandbox n1 made is lost, and the retry says so.
	if _, _, ok, err := claims.Put(ctx, cluster.ClaimKey("", "orphan/1"), cluster.CreateClaim{Node: "n1"}, 0); !ok || err != nil {
		t.Fatalf("claim: %v %v", ok, err)
	}
	rc.leave["n1"]()
	var orphan string
	waitUntil(t, "the orphan claim placed anew", func() bool {
		orphan, err = rc.create(ctx, 0, "orphan/1")
		return err == nil
	})
	if cluster.TagOf(orphan) != cluster.Tag("n2") {
		t.Fatalf("the orphan claim: %s; want a sandbox on n2", orphan)
	}
	if again, err := rc.create(ctx, 1, "orphan/1"); err != nil || again != orphan {
		t.Fatalf("its retry: %s %v; want %s", again, err, orphan)
	}
	if _, err := rc.create(ctx, 1, "rollout-1/env-1"); connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "lost") {
		t.Fatalf("a key whose sandbox is on n1, down: %v; want unavailable, lost", err)
	}
}

// TestLostCreateAnswer: a node that made the sandbox but whose answer was
// lost (the connection cut after the request went) is asked again, not
// passed over: exactly one sandbox, and the client gets it, with or
// without a client key.
func TestLostCreateAnswer(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rc := startReplicas(t, ctx, []string{"n1", "n2"}, 0)
	for i, key := range []string{"", "lost/1"} {
		rc.nodes["n1"].drop.Store(1)
		id, err := rc.create(ctx, 0, key)
		if err != nil {
			t.Fatalf("a create (client key %q) whose first answer is lost: %v", key, err)
		}
		live, made := rc.all()
		if !live[id] || len(live) != i+1 || made != i+1 || rc.nodes["n1"].drop.Load() != 0 {
			t.Fatalf("client key %q: got %s; %d sandboxes live (%v), %d made; want the one made on n1", key, id, len(live), live, made)
		}
	}

	// E2B's create through the replica's E2B endpoint, likewise.
	rc.nodes["n1"].drop.Store(1)
	req, _ := http.NewRequestWithContext(ctx, "POST", rc.e2b[0].URL+"/sandboxes", strings.NewReader(`{"templateID":"base"}`))
	req.Header.Set("X-API-Key", replicaTestKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	var sb struct{ SandboxID string }
	json.Unmarshal(b, &sb)
	live, made := rc.all()
	if res.StatusCode != http.StatusCreated || !live[sb.SandboxID] || len(live) != 3 || made != 3 {
		t.Fatalf("an E2B create whose first answer is lost: %d %s; %d sandboxes live (%v), %d made; want the one made on n1", res.StatusCode, b, len(live), live, made)
	}
}

// TestReplicaKilledMidBurst: a replica dies in the middle of a burst of
// keyed creates; the clients retry what it did not answer through the
// other one, and every key maps to exactly one sandbox.
func TestReplicaKilledMidBurst(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rc := startReplicas(t, ctx, []string{"n1", "n2"}, 50*time.Millisecond)
	const keys = 40
	ids := make([]string, keys)
	var viaA, retried atomic.Int32
	var wg sync.WaitGroup
	for k := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Sprintf("job/%d", k)
			id, err := rc.create(ctx, 0, key)
			if err == nil {
				viaA.Add(1)
				ids[k] = id
				return
			}
			retried.Add(1)
			for range 5 { // as a client does: retry, on the other replica
				if id, err = rc.create(ctx, 1, key); err == nil {
					ids[k] = id
					return
				}
			}
			t.Errorf("key %s: %v", key, err)
		}()
	}
	// Kill replica A once the nodes are busy with its creates.
	waitUntil(t, "creates under way", func() bool { _, made := rc.all(); return made >= 3 })
	rc.replicas[0].CloseClientConnections()
	rc.replicas[0].Config.SetKeepAlivesEnabled(false)
	rc.replicas[0].Listener.Close()
	wg.Wait()
	if retried.Load() == 0 {
		t.Fatal("no create was cut by the replica's death: the test proves nothing")
	}
	seen := map[string]bool{}
	for k, id := range ids {
		if id == "" || seen[id] {
			t.Fatalf("key %d: sandbox %q (seen before: %v)", k, id, seen[id])
		}
		seen[id] = true
	}
	// The dead replica's creates still running on the nodes finish; none
	// may leave a second sandbox.
	live, made := rc.all()
	if len(live) != keys || made != keys {
		t.Fatalf("%d sandboxes live, %d made, for %d keys (%d answered by replica A, %d retried)", len(live), made, keys, viaA.Load(), retried.Load())
	}
	for id := range seen {
		if !live[id] {
			t.Fatalf("sandbox %s returned but not live", id)
		}
	}
}

// BenchmarkReplicaCreate: a create through a replica in front of fake
// nodes (which answer at once) in an embedded etcd, with a client key (an
// etcd read and two compare-and-swaps) and without (a key of the
// replica's, no etcd).
func BenchmarkReplicaCreate(b *testing.B) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rc := startReplicas(b, ctx, []string{"n1", "n2"}, 0)
	for _, keyed := range []bool{false, true} {
		b.Run(map[bool]string{false: "unkeyed", true: "keyed"}[keyed], func(b *testing.B) {
			for i := range b.N {
				key := ""
				if keyed {
					key = fmt.Sprintf("bench/%d/%d", b.N, i)
				}
				if _, err := rc.create(ctx, i%2, key); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
