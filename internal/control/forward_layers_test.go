package control

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"go.etcd.io/bbolt"
	clientv3 "go.etcd.io/etcd/client/v3"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/metrics"
	"github.com/shoal-sandbox/shoal/internal/placement"
)

// fakeLayerNode is a node's layer API that answers with its own name.
type fakeLayerNode struct {
	shoalv1connect.UnimplementedLayerServiceHandler
	name string
}

func (n *fakeLayerNode) GetLayer(ctx context.Context, req *connect.Request[pb.GetLayerRequest]) (*connect.Response[pb.Layer], error) {
	if req.Msg.Ref == "nope:1" {
		return nil, connect.NewError(connect.CodeNotFound, errors.New("layer nope:1 not found"))
	}
	// Each node's own users of the layer.
	return connect.NewResponse(&pb.Layer{Ref: req.Msg.Ref, Source: n.name, UsedBySandboxes: []string{n.name + "-sb"},
		UsedByEnvironments: []string{"env"}, Mounts: 1}), nil
}

func (n *fakeLayerNode) TagLayer(ctx context.Context, req *connect.Request[pb.TagLayerRequest]) (*connect.Response[pb.TagLayerResponse], error) {
	return connect.NewResponse(&pb.TagLayerResponse{Layer: &pb.Layer{Ref: req.Msg.Target, Source: n.name}}), nil
}

func (n *fakeLayerNode) DeleteLayer(ctx context.Context, req *connect.Request[pb.DeleteLayerRequest]) (*connect.Response[pb.DeleteLayerResponse], error) {
	return connect.NewResponse(&pb.DeleteLayerResponse{Untagged: []string{n.name}}), nil
}

func (n *fakeLayerNode) BuildLayer(ctx context.Context, req *connect.Request[pb.BuildLayerRequest], ss *connect.ServerStream[pb.BuildLayerResponse]) error {
	if err := ss.Send(&pb.BuildLayerResponse{Event: &pb.BuildLayerResponse_Progress{Progress: "building on " + n.name}}); err != nil {
		return err
	}
	return ss.Send(&pb.BuildLayerResponse{Event: &pb.BuildLayerResponse_Layer{Layer: &pb.Layer{Ref: req.Msg.Ref, Source: n.name}}})
}

// TestForwarderLayers: through a control replica, layer calls go to one
// node chosen for the layer, not to "unimplemented": a read to the node
// that holds it, a build, a tag and an upload to the node with a layer
// store, an export to the node that holds the layer, a tag's removal to
// one node.
func TestForwarderLayers(t *testing.T) {
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
	const adminKey = "sk_shoal_forwarderlayers"
	// n1 has a layer store and holds base:1; n2 has none and holds own:1.
	for _, n := range []struct {
		name, store string
		layers      []string
	}{{"n1", "file:///shared", []string{"base:1"}}, {"n2", "", []string{"own:1"}}} {
		mux := http.NewServeMux()
		mux.Handle(shoalv1connect.NewLayerServiceHandler(&fakeLayerNode{name: n.name}))
		for _, p := range []string{"GET /v1/layers/export", "POST /v1/layers/import", "POST /v1/layers/build"} {
			mux.HandleFunc(p, func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				io.WriteString(w, n.name+" "+r.URL.Path+" "+r.URL.RawQuery+" "+string(b))
			})
		}
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)
		reg, err := cluster.Register(ctx, cli(), cluster.RegisterConfig{Name: n.name, URL: srv.URL, LayerStore: n.store, TTL: 2 * time.Second, Log: log,
			Report: func() (placement.Node, []cluster.CatalogEntry) {
				return placement.Node{MilliCPU: 64000, Memory: 64 << 30, Backends: []string{"container"}, Layers: n.layers}, nil
			}})
		if err != nil {
			t.Fatal(err)
		}
		go reg.Run(ctx)
	}
	engine := placement.New(placement.Config{MaxWait: 5 * time.Second})
	dir, err := cluster.WatchDirectory(ctx, cli(), engine, log)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); len(dir.Live()) < 2; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d nodes live; want 2", len(dir.Live()))
		}
	}
	f := NewForwarder(dir, engine, &Auth{key: []byte(adminKey)}, log)
	f.SetMetrics(metrics.New())
	rep := httptest.NewServer(f.Handler())
	defer rep.Close()
	keyed := func(r interface{ Header() http.Header }) { r.Header().Set("Authorization", "Bearer "+adminKey) }
	lc := shoalv1connect.NewLayerServiceClient(http.DefaultClient, rep.URL)

	// The cluster's tags are listed from etcd (no node lists them here).
	if _, _, err := cluster.PutLayerTag(ctx, cli(), layer.Layer{Name: "etcdonly", Version: "1", Kind: layer.KindBase,
		Digest: "sha256:" + strings.Repeat("ab", 32), Size: 4096}); err != nil {
		t.Fatal(err)
	}
	ls := connect.NewRequest(&pb.ListLayersRequest{})
	keyed(ls)
	if res, err := lc.ListLayers(ctx, ls); err != nil || len(res.Msg.Layers) != 1 || res.Msg.Layers[0].Ref != "etcdonly:1" {
		t.Fatalf("list through the replica: %v %v; want etcd's one tag", res, err)
	}

	// An inspect through the replica: the holder's answer, with every
	// node's users; a layer no node knows is not found.
	inspect := connect.NewRequest(&pb.GetLayerRequest{Ref: "own:1"})
	keyed(inspect)
	if res, err := lc.GetLayer(ctx, inspect); err != nil || res.Msg.Source != "n2" || strings.Join(res.Msg.UsedBySandboxes, ",") != "n1-sb,n2-sb" ||
		strings.Join(res.Msg.UsedByEnvironments, ",") != "env" || res.Msg.Mounts != 2 {
		t.Fatalf("inspect through the replica: %v %v; want n2's answer with both nodes' sandboxes, one environment, 2 mounts", res, err)
	}
	nope := connect.NewRequest(&pb.GetLayerRequest{Ref: "nope:1"})
	keyed(nope)
	if _, err := lc.GetLayer(ctx, nope); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("inspect of an unknown layer through the replica: %v, want not found", err)
	}

	// Each call a few times: a random pick would miss sometimes.
	for range 8 {
		get := connect.NewRequest(&pb.GetLayerRequest{Ref: "own:1"})
		keyed(get)
		if res, err := lc.GetLayer(ctx, get); err != nil || res.Msg.Source != "n2" {
			t.Fatalf("get own:1 through the replica: %v %v; want it from n2, which holds it", res, err)
		}
		tag := connect.NewRequest(&pb.TagLayerRequest{Source: "base:1", Target: "py:3"})
		keyed(tag)
		if res, err := lc.TagLayer(ctx, tag); err != nil || res.Msg.Layer.Source != "n1" {
			t.Fatalf("tag through the replica: %v %v; want it on n1", res, err)
		}
		del := connect.NewRequest(&pb.DeleteLayerRequest{Ref: "own:1"})
		keyed(del)
		if res, err := lc.DeleteLayer(ctx, del); err != nil || strings.Join(res.Msg.Untagged, ",") != "n2" {
			t.Fatalf("remove a tag through the replica: %v %v; want it removed by n2 alone", res, err)
		}
		build := connect.NewRequest(&pb.BuildLayerRequest{Ref: "new:1", Source: "/src"})
		keyed(build)
		st, err := lc.BuildLayer(ctx, build)
		if err != nil {
			t.Fatal(err)
		}
		var events []string
		for st.Receive() {
			events = append(events, st.Msg().GetProgress()+st.Msg().GetLayer().GetSource())
		}
		if err := st.Err(); err != nil || strings.Join(events, "|") != "building on n1|n1" {
			t.Fatalf("build through the replica: %q %v; want it streamed from n1 (the node with a store)", events, err)
		}
		for _, c := range []struct{ method, path, body, want string }{
			{"POST", "/v1/layers/build?kind=base&ref=up:1", "TAR", "n1 /v1/layers/build kind=base&ref=up:1 TAR"},
			{"POST", "/v1/layers/import", "EXPORT", "n1 /v1/layers/import  EXPORT"},
			{"GET", "/v1/layers/export?ref=own:1", "", "n2 /v1/layers/export ref=own:1 "},
		} {
			req, _ := http.NewRequest(c.method, rep.URL+c.path, strings.NewReader(c.body))
			req.Header.Set("Authorization", "Bearer "+adminKey)
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != 200 || string(b) != c.want {
				t.Fatalf("%s %s through the replica: %d %q; want %q", c.method, c.path, res.StatusCode, b, c.want)
			}
		}
	}

	// The replica's own /metrics (admin): its RPCs and routes, placement,
	// the nodes it knows; without the key, refused.
	get := func(key string) (int, string) {
		req, _ := http.NewRequest("GET", rep.URL+"/metrics", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		return res.StatusCode, string(b)
	}
	if st, _ := get(""); st != http.StatusUnauthorized {
		t.Fatalf("/metrics without a key: %d", st)
	}
	st, body := get(adminKey)
	for _, want := range []string{
		`shoal_api_requests_total{code="ok",procedure="/shoal.v1.LayerService/GetLayer"} 9`,
		`shoal_api_requests_total{code="not_found",procedure="/shoal.v1.LayerService/GetLayer"} 1`,
		`shoal_api_requests_total{code="ok",procedure="GET /v1/layers/export"} 8`,
		`shoal_cluster_nodes{state="live"} 2`,
		`shoal_placement_decisions_total{result="placed"} 0`,
	} {
		if st != 200 || !strings.Contains(body, want) {
			t.Fatalf("/metrics of the replica: %d, no %s in\n%s", st, want, body)
		}
	}
}

// TestParseLayerTags: the header a node reads from its replica (or from
// anyone calling it) is bounded and strict.
func TestParseLayerTags(t *testing.T) {
	got := parseLayerTags("a:1=5,b:2=0,c=3,sha256:00=4,d:1=x,e:1=-2,f:1=9223372036854775807,a:1=7")
	if len(got) != 2 || got["a:1"] != 7 || got["f:1"] != 9223372036854775807 {
		t.Fatalf("parsed %v; want a:1=7 and f:1 alone", got)
	}
	var b strings.Builder
	for i := range 1000 {
		fmt.Fprintf(&b, "t%d:1=%d,", i, i+1)
	}
	if n := len(parseLayerTags(b.String())); n != limits.Layers {
		t.Fatalf("%d tags parsed from 1000; want at most %d", n, limits.Layers)
	}
}

// TestCatchUpTags: a node whose copy of a tag is older than the revision
// its replica read (LayerTagsHeader) reads the tag from etcd before the
// create resolves it.
func TestCatchUpTags(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	dir := t.TempDir()
	db, err := bbolt.Open(filepath.Join(dir, "shoal.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	store, err := layer.Open(filepath.Join(dir, "layers"), db, nil)
	if err != nil {
		t.Fatal(err)
	}
	at := func(i int) layer.Layer {
		return layer.Layer{Name: "x", Version: "1", Kind: layer.KindBase, Digest: fmt.Sprintf("sha256:%064x", i), Size: 1}
	}
	if _, _, err := cluster.PutLayerTag(ctx, c, at(1)); err != nil {
		t.Fatal(err)
	}
	// The node's copy has x:1 at its first layer, and follows no more.
	mctx, stop := context.WithCancel(ctx)
	m, err := cluster.MirrorLayers(mctx, c, store, log)
	if err != nil {
		t.Fatal(err)
	}
	store.SetClusterTags(m)
	stop()
	moved, _, err := cluster.PutLayerTag(ctx, c, at(2))
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{envs: &ClusterEnvs{Client: c, Mirror: m}, log: log}
	h := http.Header{}
	h.Set(LayerTagsHeader, fmt.Sprintf("x:1=%d", moved.Revision))
	s.catchUpTags(ctx, h)
	if l, err := store.Resolve("x:1"); err != nil || l.Digest != at(2).Digest {
		t.Fatalf("x:1 after the node caught up with revision %d: %s %v; want %s", moved.Revision, l.Digest, err, at(2).Digest)
	}
}
