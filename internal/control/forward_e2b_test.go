package control

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	"github.com/shoal-sandbox/shoal/internal/e2b"
	"github.com/shoal-sandbox/shoal/internal/metrics"
	"github.com/shoal-sandbox/shoal/internal/placement"
)

// TestE2BForwarder runs a control replica's E2B endpoint in front of two
// fake nodes' E2B endpoints registered in a real (embedded) etcd: a create
// refused by the first node placed (503, "node full") moves to the next
// and comes back with the replica's domain; sandbox traffic reaches the
// sandbox's node with its Host and headers; a list merges both nodes'
// pages in order with a token where the next starts; a sandbox whose node
// is down answers 404 (API) and 502 (traffic), saying so.
func TestE2BForwarder(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	cli := func() *clientv3.Client {
		c, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	const key = "sk_shoal_e2bforwardertest"
	const domain = "ctl.example:7481"
	full, ok := cluster.Tag("full"), cluster.Tag("ok")
	ts := func(s int) string { return time.Unix(1_700_000_000+int64(s), 0).UTC().Format(time.RFC3339Nano) }
	var creates [2]atomic.Int32
	fake := func(i int, tag string) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Upgrade") == "echo" {
				// An upgraded connection (a WebSocket's kind): 101, then
				// every line echoed back.
				c, rw, err := http.NewResponseController(w).Hijack()
				if err != nil {
					return
				}
				defer c.Close()
				rw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
				rw.Flush()
				for {
					line, err := rw.ReadString('\n')
					if err != nil {
						return
					}
					rw.WriteString(tag + ": " + line)
					rw.Flush()
				}
			}
			if r.Header.Get("E2b-Sandbox-Id") != "" || strings.HasPrefix(r.Host, "8000-") {
				fmt.Fprintf(w, "node %s: %s %s %s", tag, r.Host, r.Header.Get("E2b-Sandbox-Id"), r.URL.Path)
				return
			}
			if r.Header.Get("X-API-Key") != key {
				http.Error(w, "key not passed on", http.StatusUnauthorized)
				return
			}
			switch {
			case r.Method == "POST" && r.URL.Path == "/sandboxes":
				creates[i].Add(1)
				if tag == full {
					e2b.WriteError(w, http.StatusServiceUnavailable, "node full")
					return
				}
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"sandboxID":%q,"envdAccessToken":"tok","domain":"node.internal:1"}`, tag+"sbxsbxsbxsbxsbxs")
			case r.Method == "GET" && r.URL.Path == "/v2/sandboxes":
				w.Header().Set("X-Total-Running", "2")
				fmt.Fprintf(w, `[{"sandboxID":"%[1]s3","startedAt":%[2]q},{"sandboxID":"%[1]s1","startedAt":%[3]q}]`, tag, ts(i+2), ts(i))
			default:
				http.NotFound(w, r)
			}
		}))
	}
	nodes := []*httptest.Server{fake(0, full), fake(1, ok)}
	for _, n := range nodes {
		defer n.Close()
	}
	engine := placement.New(placement.Config{MaxWait: 5 * time.Second})
	dir, err := cluster.WatchDirectory(ctx, cli(), engine, log)
	if err != nil {
		t.Fatal(err)
	}
	stops := map[string]context.CancelFunc{}
	for i, name := range []string{"full", "ok"} {
		used := int64(i) << 32 // "full" looks emptier: placed first
		reg, err := cluster.Register(ctx, cli(), cluster.RegisterConfig{Name: name, URL: "http://unused", E2BURL: nodes[i].URL, TTL: 2 * time.Second, Log: log,
			Report: func() (placement.Node, []cluster.CatalogEntry) {
				return placement.Node{MilliCPU: 8000, Memory: 16 << 30, UsedMilliCPU: used >> 20, UsedMemory: used, Backends: []string{"container"}}, nil
			}})
		if err != nil {
			t.Fatal(err)
		}
		rctx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); reg.Run(rctx) }()
		stops[name] = func() { stop(); <-done }
		defer stops[name]()
	}
	waitUntil(t, "both nodes in the directory", func() bool { return len(dir.Live()) == 2 })
	fwd := NewForwarder(dir, engine, &Auth{key: []byte(key)}, log)
	mt := metrics.New()
	fwd.SetMetrics(mt)
	srv := httptest.NewServer(fwd.E2BHandler(domain))
	defer srv.Close()

	call := func(method, path string, h http.Header) (int, http.Header, string) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(`{"templateID":"base"}`))
		req.Header.Set("X-API-Key", key)
		for k, v := range h {
			req.Header[k] = v
		}
		if hs := h.Get("Host"); hs != "" {
			req.Host = hs
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, res.Header, string(b)
	}

	// A create: refused by "full", placed on "ok", with the replica's domain.
	st, _, body := call("POST", "/sandboxes", nil)
	var sb struct{ SandboxID, Domain string }
	if st != http.StatusCreated || json.Unmarshal([]byte(body), &sb) != nil || cluster.TagOf(sb.SandboxID) != ok || sb.Domain != domain {
		t.Fatalf("create: %d %s; want 201 on node ok with domain %s", st, body, domain)
	}
	if creates[0].Load() != 1 || creates[1].Load() != 1 {
		t.Fatalf("creates asked of full, ok: %d, %d; want 1, 1 (a refusal, then the next node)", creates[0].Load(), creates[1].Load())
	}
	// Without the key: refused by the replica.
	if st, _, _ := call("POST", "/sandboxes", http.Header{"X-Api-Key": {"wrong"}}); st != http.StatusUnauthorized {
		t.Fatalf("create with a wrong key: %d, want 401", st)
	}

	// Sandbox traffic, by header and by host name, to the sandbox's node.
	if st, _, body := call("GET", "/files", http.Header{"E2b-Sandbox-Id": {sb.SandboxID}}); st != 200 || body != "node "+ok+": "+strings.TrimPrefix(srv.URL, "http://")+" "+sb.SandboxID+" /files" {
		t.Fatalf("envd by header: %d %q", st, body)
	}
	host := "8000-" + sb.SandboxID + "." + domain
	if st, _, body := call("GET", "/x", http.Header{"Host": {host}, "X-Api-Key": {""}}); st != 200 || body != "node "+ok+": "+host+"  /x" {
		t.Fatalf("port by host name: %d %q", st, body)
	}

	// An upgraded connection to a port passes both ways.
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(conn, "GET /ws HTTP/1.1\r\nHost: %s\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n", host)
	br := bufio.NewReader(conn)
	res, err := http.ReadResponse(br, nil)
	if err != nil || res.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade through the replica: %v %v", res, err)
	}
	for _, msg := range []string{"one", "two"} {
		fmt.Fprintln(conn, msg)
		if got, err := br.ReadString('\n'); err != nil || got != ok+": "+msg+"\n" {
			t.Fatalf("upgraded connection: %q %v", got, err)
		}
	}

	// The list: both nodes' pages merged newest first, cut at the limit,
	// with the token of the last one given.
	st, h, body := call("GET", "/v2/sandboxes?limit=3", nil)
	var page []struct{ SandboxID string }
	json.Unmarshal([]byte(body), &page)
	want := []string{ok + "3", full + "3", ok + "1"}
	if st != 200 || len(page) != 3 || page[0].SandboxID != want[0] || page[1].SandboxID != want[1] || page[2].SandboxID != want[2] {
		t.Fatalf("list: %d %s; want %v", st, body, want)
	}
	if tok := h.Get("X-Next-Token"); tok != e2b.PageToken(time.Unix(1_700_000_001, 0), ok+"1") || h.Get("X-Total-Running") != "4" {
		t.Fatalf("list headers: next %q running %q", tok, h.Get("X-Total-Running"))
	}

	// Node "ok" down: its sandbox is gone as E2B says, and why.
	stops["ok"]()
	waitUntil(t, "node ok down", func() bool { return len(dir.Live()) == 1 })
	if st, _, body := call("GET", "/sandboxes/"+sb.SandboxID, nil); st != http.StatusNotFound || !strings.Contains(body, "which is down") {
		t.Fatalf("get of a lost sandbox: %d %s", st, body)
	}
	if st, _, body := call("GET", "/files", http.Header{"E2b-Sandbox-Id": {sb.SandboxID}}); st != http.StatusBadGateway || !strings.Contains(body, "which is down") {
		t.Fatalf("traffic of a lost sandbox: %d %s", st, body)
	}
	if st, _, body := call("GET", "/sandboxes/zzzzzzzzzzzzzzzzzzzz", nil); st != http.StatusNotFound {
		t.Fatalf("get of an unknown sandbox: %d %s", st, body)
	}
	// No live node answers a list: an error, not an empty list.
	nodes[0].Close()
	if st, _, body := call("GET", "/v2/sandboxes", nil); st != http.StatusServiceUnavailable {
		t.Fatalf("list with no node answering: %d %s, want 503", st, body)
	}
	// The replica counted its E2B requests, as a node counts its own.
	rec := httptest.NewRecorder()
	mt.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{
		`shoal_e2b_requests_total{code="503",route="GET /v2/sandboxes"} 1`,
		`shoal_e2b_requests_total{code="502",route="envd"} 1`,
		`shoal_e2b_requests_total{code="404",route="GET /sandboxes/{id}"} 2`,
	} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Fatalf("the replica's E2B metrics lack %s:\n%s", want, rec.Body.String())
		}
	}
}

func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
