package control

// E2B's API for a whole cluster, served by a control replica (serve
// --role control --e2b-listen): an E2B client points E2B_API_URL and
// E2B_SANDBOX_URL at a replica and its sandboxes land on many nodes.
// Every node serves its own E2B endpoint (internal/e2b) and publishes its
// URL in etcd (cluster.NodeInfo.E2BURL); the replica only places and
// routes, passing requests on to a node's endpoint as they are:
//
//   - POST /sandboxes (and /v2/sandboxes) goes through placement, as
//     Shoal's own creates do (the same engine, queue, tenant fairness):
//     the best node's E2B endpoint is asked, and its refusal (503: node
//     full) moves the create to the next candidate.
//   - A call of one sandbox (get, kill, timeout, refreshes, pause,
//     resume, connect, metrics) goes to its node, read off its ID.
//   - GET /v2/sandboxes (and /sandboxes) asks every live node with the
//     same query and merges their pages: a page token names a position in
//     the order (creation time, ID), which every node can start from.
//   - Sandbox traffic (envd's process and filesystem services, /files,
//     /health, and ports: by E2B's headers or a host name
//     PORT-ID.DOMAIN; WebSockets and streams too) is reverse-proxied to
//     the node's endpoint, Host and headers unchanged; the node checks the
//     sandbox's access tokens.
//   - The domain in the answers is the replica's own, so that getHost and
//     TLS host names (PORT-ID.DOMAIN) come back to a replica.
//
// A sandbox whose node is down answers as E2B answers for a sandbox that
// is gone (404 on the API, 502 on its traffic), saying that its node is
// down. Keys: the API takes the cluster's admin key and tenants' keys, as
// the replica's Shoal API does (forward_admin.go), checks a create
// against its tenant's quota across the cluster, and passes the key on:
// the node checks it again, and the sandbox's tenant.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/e2b"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/placement"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// e2bAnswerBytes bounds an answer of a node's E2B API read by the replica
// (a list page of 100 sandboxes is ~60 KiB).
const e2bAnswerBytes = 4 << 20

// e2bListTimeout bounds one node's answer to a list: a node slower than
// that is left out rather than holding the list.
const e2bListTimeout = 15 * time.Second

// e2bListMax is E2B's largest list page (as a node's).
const e2bListMax = 100

// E2BHandler returns the E2B endpoint of the cluster. domain is what the
// answers give clients as the sandbox domain (the replica's own, e.g.
// "shoal.localhost:7481"); empty: clients use their E2B_DOMAIN.
func (f *Forwarder) E2BHandler(domain string) http.Handler {
	g := &e2bForwarder{f: f, domain: domain}
	routes := g.routes()
	api := e2b.KeyAlias(f.auth.Middleware(routes, "/health"))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, port, ok, err := e2b.SandboxTarget(r)
		if f.metrics != nil {
			// Counted as a node counts its own (shoal_e2b_requests_total):
			// an API route by pattern, sandbox traffic as "envd" or "port".
			route := "unmatched"
			switch {
			case ok && port == e2b.EnvdPort:
				route = "envd"
			case ok:
				route = "port"
			default:
				if _, pattern := routes.Handler(r); pattern != "" && pattern != "/" {
					route = pattern
				}
			}
			start := time.Now()
			sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
			w = sw
			defer func() { f.metrics.E2BRequest(route, strconv.Itoa(sw.status), time.Since(start)) }()
		}
		switch {
		case err != nil:
			e2b.WriteError(w, http.StatusBadRequest, err.Error())
		case ok:
			g.traffic(w, r, id)
		case r.Method == http.MethodConnect:
			e2b.WriteError(w, http.StatusMethodNotAllowed, "Shoal's E2B endpoint is not an HTTP CONNECT proxy")
		default:
			api.ServeHTTP(w, r)
		}
	})
}

type e2bForwarder struct {
	f      *Forwarder
	domain string
}

func (g *e2bForwarder) routes() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintln(w, `{"message":"Health check successful"}`)
	})
	mux.HandleFunc("POST /sandboxes", g.create)
	mux.HandleFunc("POST /v2/sandboxes", g.create)
	mux.HandleFunc("GET /sandboxes", g.list)
	mux.HandleFunc("GET /v2/sandboxes", g.list)
	for _, p := range []string{
		"GET /sandboxes/{id}", "DELETE /sandboxes/{id}", "GET /sandboxes/{id}/metrics",
		"POST /sandboxes/{id}/timeout", "POST /sandboxes/{id}/refreshes", "POST /sandboxes/{id}/pause",
		"POST /sandboxes/{id}/resume", "POST /sandboxes/{id}/connect", "POST /v2/sandboxes/{id}/connect",
	} {
		mux.HandleFunc(p, g.ofSandbox)
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		e2b.WriteError(w, http.StatusNotImplemented, fmt.Sprintf("the E2B API call %s %s is not supported by Shoal's E2B endpoint yet (supported: create, get, list, timeout, pause, connect/resume, kill)", r.Method, r.URL.Path))
	})
	return mux
}

// nodeOf returns the node of sandbox id with its E2B endpoint, or answers
// as E2B does for a gone sandbox (status: 404 on the API, 502 on sandbox
// traffic) and returns false.
func (g *e2bForwarder) nodeOf(w http.ResponseWriter, id string, status int) (cluster.NodeInfo, *url.URL, bool) {
	n, err := g.f.dir.ForSandbox(id)
	if err != nil {
		msg := fmt.Sprintf("sandbox %q not found", id)
		if errors.Is(err, cluster.ErrLost) {
			msg = fmt.Sprintf("sandbox %q not found: %v", id, err)
		}
		if status == http.StatusBadGateway {
			msg = fmt.Sprintf("The sandbox %s was not found or is not running", id)
			if errors.Is(err, cluster.ErrLost) {
				msg += ": " + err.Error()
			}
		}
		e2b.WriteError(w, status, msg)
		return n, nil, false
	}
	u, err := nodeE2BURL(n)
	if err != nil {
		e2b.WriteErr(w, err)
		return n, nil, false
	}
	return n, u, true
}

func nodeE2BURL(n cluster.NodeInfo) (*url.URL, error) {
	if n.E2BURL == "" {
		return nil, errdefs.New(errdefs.ErrUnavailable, "node %s serves no E2B endpoint (start it with --e2b-listen)", n.Name)
	}
	u, err := url.Parse(n.E2BURL)
	if err != nil || u.Host == "" {
		return nil, errdefs.New(errdefs.ErrUnavailable, "node %s has a bad E2B URL %q", n.Name, n.E2BURL)
	}
	return u, nil
}

// traffic passes sandbox traffic (envd, ports) to the sandbox's node as
// it is, streaming both ways (Upgrades too).
func (g *e2bForwarder) traffic(w http.ResponseWriter, r *http.Request, id string) {
	n, target, ok := g.nodeOf(w, strings.ToLower(id), http.StatusBadGateway)
	if !ok {
		return
	}
	p := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Host = r.Host // PORT-ID.DOMAIN names the sandbox and port to the node
		},
		Transport:     g.f.client.Transport,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				return // the client went away
			}
			e2b.WriteError(w, http.StatusBadGateway, fmt.Sprintf("The sandbox %s was not found or is not running: its node %s does not answer: %v", id, n.Name, err))
		},
	}
	p.ServeHTTP(w, r)
}

// nodeAnswer is a node's answer to an API call, read whole (bounded).
type nodeAnswer struct {
	status int
	header http.Header
	body   []byte
}

func (a *nodeAnswer) Error() string {
	return fmt.Sprintf("E2B answered %d: %s", a.status, bytes.TrimSpace(a.body))
}

// call sends an API request to a node's E2B endpoint with the client's
// key and reads the answer. A node that cannot be reached is unavailable.
func (g *e2bForwarder) call(ctx context.Context, n cluster.NodeInfo, in *http.Request, method, path, rawQuery string, body []byte) (*nodeAnswer, error) {
	u, err := nodeE2BURL(n)
	if err != nil {
		return nil, err
	}
	u = u.JoinPath(path)
	u.RawQuery = rawQuery
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), rd)
	if err != nil {
		return nil, err
	}
	for _, k := range []string{"X-Api-Key", "Authorization", "Content-Type", e2b.ClientKeyHeader} {
		if v := in.Header.Get(k); v != "" {
			req.Header.Set(k, v)
		}
	}
	res, err := g.f.client.Do(req)
	if err != nil {
		return nil, errdefs.Mark(errdefs.ErrUnavailable, &noAnswerError{node: n.Name, err: err})
	}
	defer res.Body.Close()
	b, err := io.ReadAll(limits.Reader(res.Body, e2bAnswerBytes, "a node's E2B answer"))
	if err != nil {
		return nil, errdefs.Mark(errdefs.ErrUnavailable, &noAnswerError{node: n.Name, err: fmt.Errorf("read its answer: %w", err)})
	}
	return &nodeAnswer{status: res.StatusCode, header: res.Header, body: b}, nil
}

// noAnswerError is a call to a node that got no (whole) answer.
type noAnswerError struct {
	node string
	err  error
}

func (e *noAnswerError) Error() string { return fmt.Sprintf("node %s: %v", e.node, e.err) }
func (e *noAnswerError) Unwrap() error { return e.err }

// createOn sends an E2B create (with its client key, ClientKeyHeader) to
// node n, as sendCreate does a Shoal create: a request that never left is
// unavailable (the next node); an answer lost on the way is asked for
// again, from the same node, until it answers, leaves or lostAnswerWait
// passes.
func (g *e2bForwarder) createOn(ctx context.Context, n cluster.NodeInfo, r *http.Request, body []byte) (*nodeAnswer, error) {
	var deadline time.Time
	backoff := 100 * time.Millisecond
	for try := 0; ; try++ {
		a, err := g.call(ctx, n, r, http.MethodPost, r.URL.Path, r.URL.RawQuery, body)
		var na *noAnswerError
		switch {
		case err == nil:
			return a, nil
		case !errors.As(err, &na), try == 0 && notSent(err):
			return nil, err
		case ctx.Err() != nil:
			return nil, ctx.Err()
		}
		if deadline.IsZero() {
			deadline = time.Now().Add(lostAnswerWait)
			g.f.log.Warn("cluster: an E2B create's answer was lost: asking its node again", "node", n.Name, "err", err)
		}
		if _, live := g.f.dir.Node(n.Name); !live || time.Now().After(deadline) {
			// The client's answer, not a refusal: no other node.
			msg, _ := json.Marshal(map[string]any{"code": http.StatusBadGateway,
				"message": fmt.Sprintf("node %s did not answer the create (%v): the sandbox may exist there", n.Name, na.err)})
			return nil, &nodeAnswer{status: http.StatusBadGateway, header: http.Header{"Content-Type": {"application/json"}}, body: msg}
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

// write relays a node's answer, with the replica's domain in a sandbox's
// JSON (create, get, connect).
func (g *e2bForwarder) write(w http.ResponseWriter, a *nodeAnswer) {
	body := a.body
	if a.status/100 == 2 && len(body) > 0 && body[0] == '{' {
		var m map[string]json.RawMessage
		if json.Unmarshal(body, &m) == nil {
			if _, ok := m["domain"]; ok {
				m["domain"], _ = json.Marshal(g.domainJSON())
				if b, err := json.Marshal(m); err == nil {
					body = append(b, '\n')
				}
			}
		}
	}
	for _, k := range []string{"Content-Type", "X-Next-Token", "X-Total-Running"} {
		if v := a.header.Get(k); v != "" {
			w.Header().Set(k, v)
		}
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(a.status)
	w.Write(body)
}

func (g *e2bForwarder) domainJSON() *string {
	if g.domain == "" {
		return nil
	}
	return &g.domain
}

// ofSandbox passes a call of one sandbox to its node.
func (g *e2bForwarder) ofSandbox(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	n, _, ok := g.nodeOf(w, id, http.StatusNotFound)
	if !ok {
		return
	}
	body, err := io.ReadAll(limits.Reader(r.Body, limits.JSONBodyBytes, "request body"))
	if err != nil {
		e2b.WriteErr(w, err)
		return
	}
	ctx := r.Context()
	if r.Method == http.MethodDelete {
		// A kill is not abandoned half way when the client goes away.
		c, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
		defer cancel()
		ctx = c
	}
	a, err := g.call(ctx, n, r, r.Method, r.URL.Path, r.URL.RawQuery, body)
	if err != nil {
		e2b.WriteErr(w, err)
		return
	}
	if r.Method == http.MethodDelete && (a.status == http.StatusNoContent || a.status == http.StatusNotFound && tenant.FromContext(ctx).IsAdmin()) {
		// Out of the catalog now (the node's heartbeat would, later).
		// A tenant's 404 may be another tenant's sandbox: it stays.
		if err := g.f.dir.Uncatalog(ctx, id); err != nil {
			g.f.log.Warn("cluster: uncatalog a deleted sandbox", "sandbox_id", id, "err", err)
		}
	}
	g.write(w, a)
}

// create places an E2B create on a node through the control's placement.
func (g *e2bForwarder) create(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(limits.Reader(r.Body, limits.JSONBodyBytes, "request body"))
	if err != nil {
		e2b.WriteErr(w, err)
		return
	}
	var in struct {
		TemplateID string `json:"templateID"`
	}
	if len(bytes.TrimSpace(body)) > 0 {
		if err := json.Unmarshal(body, &in); err != nil {
			e2b.WriteError(w, http.StatusBadRequest, "request body: "+err.Error())
			return
		}
	}
	ctx := r.Context()
	if !slices.ContainsFunc(g.f.dir.Live(), func(n cluster.NodeInfo) bool { return n.E2BURL != "" }) {
		e2b.WriteError(w, http.StatusServiceUnavailable, "no live node of the cluster serves an E2B endpoint (start nodes with --e2b-listen)")
		return
	}
	pr := g.placementRequest(ctx, r, in.TemplateID)
	rsv, err := g.f.reserve(ctx, "e2b.sandbox.create", in.TemplateID, pr.Memory, pr.MilliCPU) // the tenant's quota across the cluster
	if err != nil {
		e2b.WriteErr(w, err)
		return
	}
	defer rsv.Done()
	// Every create reaches its node with a client key (idempotent.go): a
	// lost answer is asked of the same node again.
	keyed := r.Clone(ctx)
	if keyed.Header.Get(e2b.ClientKeyHeader) == "" {
		keyed.Header.Set(e2b.ClientKeyHeader, attemptKey())
	}
	var answer *nodeAnswer
	node, err := g.f.place.Place(ctx, pr, func(ctx context.Context, name string) error {
		n, ok := g.f.dir.Node(name)
		if !ok {
			return errdefs.New(errdefs.ErrUnavailable, "node %s left the cluster", name)
		}
		a, err := g.createOn(ctx, n, keyed, body)
		if err != nil {
			return err // unavailable (no endpoint, not reached): the next candidate
		}
		switch {
		case a.status == http.StatusServiceUnavailable:
			return errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("node %s: %w", name, a)) // node full: the next candidate
		case a.status/100 != 2:
			return a // the create's own fault (a bad template...): the client's answer
		}
		answer = a
		return nil
	})
	if err != nil {
		var a *nodeAnswer
		if errors.As(err, &a) {
			g.write(w, a)
			return
		}
		e2b.WriteErr(w, err)
		return
	}
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	if json.Unmarshal(answer.body, &sb) == nil && sb.SandboxID != "" {
		rsv.Created(sb.SandboxID)
		// The catalog has it before the client does, as for Shoal's
		// creates (forward.go).
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		err := g.f.dir.Catalog(cctx, cluster.CatalogEntry{ID: sb.SandboxID, Node: node, Tenant: tenant.FromContext(ctx).Tenant, Created: time.Now().UTC(),
			MilliCPU: pr.MilliCPU, Memory: pr.Memory}) // E2B's answer has no limits: a node's defaults, as placement counted
		cancel()
		if err != nil {
			g.f.log.Warn("cluster: catalog a new sandbox", "sandbox_id", sb.SandboxID, "node", node, "err", err)
		}
	}
	g.write(w, answer)
}

// placementRequest is what placement knows of an E2B create: the
// template's backend and layers when it is a Shoal environment (read from
// etcd, best effort), else the template as a base layer; a node's
// default CPU and memory (E2B's creates name none).
func (g *e2bForwarder) placementRequest(ctx context.Context, r *http.Request, template string) placement.Request {
	pr := placement.Request{Tenant: tenant.FromContext(ctx).Tenant, Backend: "container", MilliCPU: placeDefaultMilliCPU, Memory: placeDefaultMemory}
	if template == "" {
		return pr
	}
	pr.Layers = []string{template}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	e, err := clusterEnv(cctx, g.f.dir.Client(), template) // the cluster's environments as the tenant sees them (envs_cluster.go)
	if err != nil {
		if !errors.Is(err, errdefs.ErrNotFound) {
			g.f.log.Debug("e2b create: look the template up", "template", template, "err", err)
		}
		return pr
	}
	if e.Backend != "" {
		pr.Backend = e.Backend
	}
	pr.Layers = nil
	if e.Base != "" {
		pr.Layers = append(pr.Layers, e.Base)
	}
	pr.Layers = append(append(pr.Layers, e.Workspaces...), e.Toolkits...)
	return pr
}

// listed is what the replica reads of a listed sandbox to merge pages.
type listed struct {
	raw     json.RawMessage
	id      string
	started time.Time
}

// list asks every live node with the client's query and merges their
// answers: the first limit sandboxes in the order asked (creation time,
// then ID), and a page token where the next page starts.
func (g *e2bForwarder) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	v2 := strings.HasPrefix(r.URL.Path, "/v2/")
	limit, desc := e2bListMax, v2 // v1: every running sandbox, oldest first
	if v2 {
		if v := q.Get("limit"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > e2bListMax {
				e2b.WriteError(w, http.StatusBadRequest, fmt.Sprintf("limit %q: want 1 to %d", v, e2bListMax))
				return
			}
			limit = n
		}
		switch q.Get("order") {
		case "", "desc":
		case "asc":
			desc = false
		default:
			e2b.WriteError(w, http.StatusBadRequest, fmt.Sprintf("order %q: want asc or desc", q.Get("order")))
			return
		}
	}
	var live []cluster.NodeInfo
	for _, n := range g.f.dir.Live() {
		if n.E2BURL != "" {
			live = append(live, n)
		}
	}
	answers, errs := onEveryNode(live, func(n cluster.NodeInfo) (*nodeAnswer, error) {
		ctx, cancel := context.WithTimeout(r.Context(), e2bListTimeout)
		defer cancel()
		return g.call(ctx, n, r, http.MethodGet, r.URL.Path, r.URL.RawQuery, nil)
	})
	var all []listed
	more, running, answered := false, 0, 0
	for i, a := range answers {
		if errs[i] != nil || a.status/100 == 5 {
			// A node that does not answer (its lease not ended yet): its
			// sandboxes are left out (E2B's list has no state for them);
			// Shoal's own list reports them lost.
			g.f.log.Warn("e2b list: a node does not answer: its sandboxes are left out", "node", live[i].Name, "err", cmpErr(errs[i], a))
			continue
		}
		if a.status != http.StatusOK {
			g.write(w, a) // the query's fault: every node says the same
			return
		}
		var page []json.RawMessage
		if err := json.Unmarshal(a.body, &page); err != nil {
			e2b.WriteError(w, http.StatusBadGateway, fmt.Sprintf("node %s answered a list with %v", live[i].Name, err))
			return
		}
		for _, raw := range page {
			var s struct {
				SandboxID string `json:"sandboxID"`
				StartedAt string `json:"startedAt"`
			}
			if json.Unmarshal(raw, &s) != nil {
				continue
			}
			t, _ := time.Parse(time.RFC3339Nano, s.StartedAt)
			all = append(all, listed{raw: raw, id: s.SandboxID, started: t})
		}
		answered++
		more = more || a.header.Get("X-Next-Token") != ""
		if n, err := strconv.Atoi(a.header.Get("X-Total-Running")); err == nil {
			running += n
		}
	}
	if answered == 0 && len(live) > 0 {
		e2b.WriteError(w, http.StatusServiceUnavailable, fmt.Sprintf("none of the %d live nodes answered the list: retry", len(live)))
		return
	}
	slices.SortFunc(all, func(a, b listed) int {
		c := a.started.Compare(b.started)
		if c == 0 {
			c = strings.Compare(a.id, b.id)
		}
		if desc {
			return -c
		}
		return c
	})
	if v2 && len(all) > limit {
		all, more = all[:limit], true
	}
	out := make([]json.RawMessage, len(all))
	for i, l := range all {
		out[i] = l.raw
	}
	if v2 {
		if more && len(all) > 0 {
			last := all[len(all)-1]
			w.Header().Set("X-Next-Token", e2b.PageToken(last.started, last.id))
		}
		w.Header().Set("X-Total-Running", strconv.Itoa(running))
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}

func cmpErr(err error, a *nodeAnswer) error {
	if err != nil {
		return err
	}
	return a
}
