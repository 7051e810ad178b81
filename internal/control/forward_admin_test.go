package control

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
	"github.com/shoal-sandbox/shoal/internal/audit"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	"github.com/shoal-sandbox/shoal/internal/placement"
)

// fakeTenantNode is a node's API as far as the replica's tenant paths use
// it: creates (counted; the key passed on is recorded) and its audit log.
type fakeTenantNode struct {
	shoalv1connect.UnimplementedSandboxServiceHandler
	shoalv1connect.UnimplementedAdminServiceHandler
	tag     string
	creates atomic.Int32
	lastKey atomic.Value
	mu      sync.Mutex
	sbs     []cluster.CatalogEntry // guarded by mu
}

func (n *fakeTenantNode) CreateSandbox(ctx context.Context, req *connect.Request[pb.CreateSandboxRequest]) (*connect.Response[pb.Sandbox], error) {
	i := n.creates.Add(1)
	n.lastKey.Store(req.Header().Get("Authorization"))
	sb := &pb.Sandbox{Id: n.tag + strings.Repeat("x", 15) + string(rune('a'+i)), Tenant: "team-a",
		MemoryBytes: req.Msg.MemoryBytes, Millicpu: 1000, CreatedAt: timestamppb.Now()}
	n.mu.Lock()
	n.sbs = append(n.sbs, cluster.CatalogEntry{ID: sb.Id, Tenant: sb.Tenant, Memory: sb.MemoryBytes, MilliCPU: sb.Millicpu})
	n.mu.Unlock()
	return connect.NewResponse(sb), nil
}

func (n *fakeTenantNode) ReadAudit(ctx context.Context, req *connect.Request[pb.ReadAuditRequest]) (*connect.Response[pb.ReadAuditResponse], error) {
	return connect.NewResponse(&pb.ReadAuditResponse{Entries: []*pb.AuditEntry{
		{Time: timestamppb.New(time.Unix(1, 0)), Key: "ten-a", Tenant: "team-a", Action: "sandbox.create", Result: "ok"},
	}}), nil
}

// TestForwarderTenants runs two control replicas (their Shoal APIs, in
// process) over a real etcd and a fake node: a tenant's key made through
// one is accepted at once by the other, which passes it on to the node
// unchanged; the tenant's quota is held across the cluster before any
// node is asked; refusals and key changes are in the replica's audit log,
// and ReadAudit through one replica merges the other's and the node's.
func TestForwarderTenants(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	cli := func() *clientv3.Client {
		c, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	const adminKey = "sk_shoal_forwardertenants"
	node := &fakeTenantNode{tag: cluster.Tag("n1")}
	mux := http.NewServeMux()
	mux.Handle(shoalv1connect.NewSandboxServiceHandler(node))
	mux.Handle(shoalv1connect.NewAdminServiceHandler(node))
	nodeSrv := httptest.NewServer(mux)
	defer nodeSrv.Close()
	reg, err := cluster.Register(ctx, cli(), cluster.RegisterConfig{Name: "n1", URL: nodeSrv.URL, TTL: 2 * time.Second, Log: log,
		Report: func() (placement.Node, []cluster.CatalogEntry) {
			node.mu.Lock()
			defer node.mu.Unlock()
			return placement.Node{MilliCPU: 64000, Memory: 64 << 30, Backends: []string{"container"}}, slices.Clone(node.sbs)
		}})
	if err != nil {
		t.Fatal(err)
	}
	go reg.Run(ctx)
	type replica struct {
		srv *httptest.Server
		log *audit.Log
	}
	var reps [2]replica
	for i := range reps {
		engine := placement.New(placement.Config{MaxWait: 5 * time.Second})
		dir, err := cluster.WatchDirectory(ctx, cli(), engine, log)
		if err != nil {
			t.Fatal(err)
		}
		keys, err := cluster.WatchTenancy(ctx, cli(), log)
		if err != nil {
			t.Fatal(err)
		}
		usage, err := cluster.WatchUsage(ctx, cli(), keys, log)
		if err != nil {
			t.Fatal(err)
		}
		al, err := audit.Open(filepath.Join(t.TempDir(), "audit.log"), 0, log, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { al.Close() })
		f := NewForwarder(dir, engine, &Auth{key: []byte(adminKey)}, log)
		f.SetTenancy(keys, usage, al)
		srv := httptest.NewUnstartedServer(nil)
		srv.Start()
		t.Cleanup(srv.Close)
		rep, err := cluster.RegisterReplica(ctx, cli(), srv.URL, 0, log)
		if err != nil {
			t.Fatal(err)
		}
		f.SetPeers(rep)
		srv.Config.Handler = f.Handler()
		reps[i] = replica{srv: srv, log: al}
	}
	admin := shoalv1connect.NewAdminServiceClient(http.DefaultClient, reps[0].srv.URL)
	withKey := func(m any, key string) {
		switch r := m.(type) {
		case interface{ Header() http.Header }:
			r.Header().Set("Authorization", "Bearer "+key)
		}
	}
	ck := connect.NewRequest(&pb.CreateKeyRequest{Name: "ten-a", Tenant: "team-a", Scopes: []string{"sandboxes,layers:read"}})
	withKey(ck, adminKey)
	made, err := admin.CreateKey(ctx, ck)
	if err != nil {
		t.Fatal(err)
	}
	secret := made.Msg.Secret
	sq := connect.NewRequest(&pb.SetTenantRequest{Name: "team-a", Quota: &pb.Quota{MaxSandboxes: 1}})
	withKey(sq, adminKey)
	if _, err := admin.SetTenant(ctx, sq); err != nil {
		t.Fatal(err)
	}
	// At once through the other replica: whoami, and a create passed on
	// to the node with the tenant's key unchanged.
	other := shoalv1connect.NewAdminServiceClient(http.DefaultClient, reps[1].srv.URL)
	wr := connect.NewRequest(&pb.WhoAmIRequest{})
	withKey(wr, secret)
	if k, err := other.WhoAmI(ctx, wr); err != nil || k.Msg.Tenant != "team-a" {
		t.Fatalf("whoami at the other replica: %v %v", k, err)
	}
	sbx := shoalv1connect.NewSandboxServiceClient(http.DefaultClient, reps[1].srv.URL)
	cr := connect.NewRequest(&pb.CreateSandboxRequest{Base: "b:1", MemoryBytes: 64 << 20})
	withKey(cr, secret)
	if _, err := sbx.CreateSandbox(ctx, cr); err != nil {
		t.Fatalf("create with the tenant's key: %v", err)
	}
	if got := node.lastKey.Load(); got != "Bearer "+secret {
		t.Fatalf("the node got Authorization %q, want the tenant's key", got)
	}
	// Its quota (1) is taken: a second create is refused before the node
	// is asked, through the replica that made the first at once, and
	// through the other once the catalog (its watch) shows the first.
	lt := connect.NewRequest(&pb.ListTenantsRequest{})
	withKey(lt, adminKey)
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := admin.ListTenants(ctx, lt)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Msg.Tenants) == 1 && res.Msg.Tenants[0].Sandboxes == 1 && res.Msg.Tenants[0].MemoryBytes == 64<<20 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the first replica's tenants: %v", res.Msg.Tenants)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, r := range []replica{reps[1], reps[0]} {
		c := shoalv1connect.NewSandboxServiceClient(http.DefaultClient, r.srv.URL)
		cr := connect.NewRequest(&pb.CreateSandboxRequest{Base: "b:1", MemoryBytes: 64 << 20})
		withKey(cr, secret)
		if _, err := c.CreateSandbox(ctx, cr); connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "max-sandboxes: it has 1 sandboxes of 1 in the cluster") {
			t.Fatalf("a second create through %s: %v, want resource_exhausted", r.srv.URL, err)
		}
	}
	if n := node.creates.Load(); n != 1 {
		t.Fatalf("the node was asked %d creates, want 1", n)
	}
	// A key without the scope is refused at the replica, and audited.
	ck = connect.NewRequest(&pb.CreateKeyRequest{Name: "ro", Tenant: "team-a", Scopes: []string{"layers:read"}})
	withKey(ck, adminKey)
	ro, err := admin.CreateKey(ctx, ck)
	if err != nil {
		t.Fatal(err)
	}
	cr = connect.NewRequest(&pb.CreateSandboxRequest{Base: "b:1"})
	withKey(cr, ro.Msg.Secret)
	if _, err := sbx.CreateSandbox(ctx, cr); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("create with a layers:read key: %v", err)
	}
	// ReadAudit through the first replica: its key changes and refusals,
	// the second replica's refusals, the node's entry.
	want := map[string]bool{"key.create ok": false, "tenant.set ok": false, "sandbox.create resource_exhausted": false,
		"sandbox.create permission_denied": false, "sandbox.create ok": false}
	deadline = time.Now().Add(30 * time.Second)
	for {
		ra := connect.NewRequest(&pb.ReadAuditRequest{Tail: 100})
		withKey(ra, adminKey)
		res, err := admin.ReadAudit(ctx, ra)
		if err != nil {
			t.Fatal(err)
		}
		for k := range want {
			want[k] = false
		}
		for _, e := range res.Msg.Entries {
			if _, ok := want[e.Action+" "+e.Result]; ok {
				want[e.Action+" "+e.Result] = true
			}
		}
		missing := ""
		for k, ok := range want {
			if !ok {
				missing += k + "; "
			}
		}
		if missing == "" {
			break
		}
		if time.Now().After(deadline) { // the logs are written off the request path
			t.Fatalf("audit through a replica lacks %s: %v", missing, res.Msg.Entries)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
