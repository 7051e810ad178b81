package e2b

// The control plane: E2B's REST API for sandboxes (spec/openapi.yml of
// github.com/e2b-dev/E2B, as the SDK's generated client calls it), on the
// node manager. A Shoal sandbox is an E2B sandbox; an E2B template is a
// Shoal environment, else a base layer.

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
	"github.com/shoal-sandbox/shoal/internal/node"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// ClientKeyHeader makes a create idempotent, as CreateSandboxRequest's
// client_key does: a repeated create with the same key (and tenant)
// answers with the sandbox already made for it. A control replica sends
// one with every create it passes on, so that it can ask again when the
// answer is lost.
const ClientKeyHeader = "Shoal-Client-Key"

const (
	listDefaultLimit = 100
	listMaxLimit     = 100
	clientID         = "shoal" // E2B's deprecated clientID field, still required by its schema
)

func (s *Server) apiRoutes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"message": "Health check successful"})
	})
	// Every route but /health needs a key with the sandboxes scope
	// (scoped); a route of one sandbox is registered through sandbox,
	// which answers 404 for another tenant's sandbox as for a missing one.
	sandboxes := []tenant.Scope{tenant.ScopeSandboxes}
	create := []tenant.Scope{tenant.ScopeSandboxes, tenant.ScopeLayersRead}
	sandbox := func(pattern string, h http.HandlerFunc) { mux.HandleFunc(pattern, s.scoped(sandboxes, s.owned(h))) }
	mux.HandleFunc("POST /sandboxes", s.scoped(create, s.createSandbox))
	mux.HandleFunc("POST /v2/sandboxes", s.scoped(create, s.createSandbox))
	mux.HandleFunc("GET /sandboxes", s.scoped(sandboxes, s.listSandboxesV1))
	mux.HandleFunc("GET /v2/sandboxes", s.scoped(sandboxes, s.listSandboxes))
	sandbox("GET /sandboxes/{id}", s.getSandbox)
	sandbox("DELETE /sandboxes/{id}", s.killSandbox)
	sandbox("POST /sandboxes/{id}/timeout", s.setTimeout)
	sandbox("POST /sandboxes/{id}/refreshes", s.refreshSandbox)
	sandbox("POST /sandboxes/{id}/pause", s.pauseSandbox)
	sandbox("POST /sandboxes/{id}/resume", s.resumeSandbox)
	sandbox("POST /sandboxes/{id}/connect", s.connectSandbox)
	sandbox("POST /v2/sandboxes/{id}/connect", s.connectSandbox)
	sandbox("GET /sandboxes/{id}/metrics", func(w http.ResponseWriter, r *http.Request) {
		if _, ok := s.lookup(w, r.PathValue("id")); ok {
			writeJSON(w, http.StatusOK, []any{}) // Shoal keeps no metrics history yet
		}
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotImplemented, fmt.Sprintf("the E2B API call %s %s is not supported by Shoal's E2B endpoint yet (supported: create, get, list, timeout, pause, connect/resume, kill)", r.Method, r.URL.Path))
	})
	return mux
}

// --- wire types (components/schemas of E2B's OpenAPI spec) ---

type newSandbox struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	AutoPause           *bool             `json:"autoPause"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory"`
	AutoResume          *autoResume       `json:"autoResume"`
	Secure              *bool             `json:"secure"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Network             *networkConfig    `json:"network"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	Mcp                 json.RawMessage   `json:"mcp"`
	VolumeMounts        []json.RawMessage `json:"volumeMounts"`
	Iam                 json.RawMessage   `json:"iam"`
}

type autoResume struct {
	Enabled bool `json:"enabled"`
}

type networkConfig struct {
	AllowOut           []string        `json:"allowOut"`
	DenyOut            []string        `json:"denyOut"`
	AllowPublicTraffic *bool           `json:"allowPublicTraffic"`
	MaskRequestHost    string          `json:"maskRequestHost"`
	EgressProxy        json.RawMessage `json:"egressProxy"`
	Rules              json.RawMessage `json:"rules"`
	HTTPSPorts         []int           `json:"httpsPorts"`
}

// sandboxJSON is E2B's Sandbox: what create and connect return.
type sandboxJSON struct {
	TemplateID         string  `json:"templateID"`
	SandboxID          string  `json:"sandboxID"`
	Alias              string  `json:"alias,omitempty"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
}

// listedSandbox is E2B's ListedSandbox.
type listedSandbox struct {
	TemplateID   string            `json:"templateID"`
	Alias        string            `json:"alias,omitempty"`
	SandboxID    string            `json:"sandboxID"`
	ClientID     string            `json:"clientID"`
	StartedAt    string            `json:"startedAt"`
	EndAt        string            `json:"endAt"`
	CPUCount     int64             `json:"cpuCount"`
	MemoryMB     int64             `json:"memoryMB"`
	DiskSizeMB   int64             `json:"diskSizeMB"`
	Metadata     map[string]string `json:"metadata"`
	State        string            `json:"state"`
	EnvdVersion  string            `json:"envdVersion"`
	VolumeMounts []any             `json:"volumeMounts"`
}

// sandboxDetail is E2B's SandboxDetail.
type sandboxDetail struct {
	listedSandbox
	EnvdAccessToken     string    `json:"envdAccessToken"`
	Domain              *string   `json:"domain"`
	AllowInternetAccess bool      `json:"allowInternetAccess"`
	Lifecycle           lifecycle `json:"lifecycle"`
}

type lifecycle struct {
	AutoResume bool   `json:"autoResume"`
	OnTimeout  string `json:"onTimeout"`
}

// --- helpers ---

func decodeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	b, err := io.ReadAll(limits.Reader(r.Body, limits.JSONBodyBytes, "request body"))
	if errors.Is(err, limits.ErrTooLarge) {
		writeError(w, http.StatusRequestEntityTooLarge, err.Error())
		return false
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, "read request body: "+err.Error())
		return false
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return true // every body of this API is optional or all-optional
	}
	if err := json.Unmarshal(b, v); err != nil {
		writeError(w, http.StatusBadRequest, "request body: "+err.Error())
		return false
	}
	return true
}

// scoped serves h only to a key with scopes (permission_denied, 403,
// naming the missing one, otherwise).
func (s *Server) scoped(scopes []tenant.Scope, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := tenant.FromContext(r.Context()).Require(r.Pattern, scopes...); err != nil {
			writeErr(w, err)
			return
		}
		h(w, r)
	}
}

// owned serves h only for a sandbox {id} the key's tenant owns (or for an
// admin key); any other is answered as a missing sandbox is (404). Every
// route of one sandbox goes through it (apiRoutes).
func (s *Server) owned(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id := r.PathValue("id")
		if rec, err := s.node.Get(id); err == nil && !tenant.FromContext(r.Context()).Sees(rec.Tenant) {
			writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox %q not found", id))
			return
		}
		h(w, r)
	}
}

// lookup finds a sandbox or answers 404 in E2B's shape (the SDK tests
// error.code == 404).
func (s *Server) lookup(w http.ResponseWriter, id string) (node.Record, bool) {
	rec, err := s.node.Get(id)
	if err == nil && (rec.State == node.StateCreating || rec.State == node.StateDeleting) {
		// Not yet, or no longer, a sandbox as E2B sees one.
		err = errdefs.New(errdefs.ErrNotFound, "sandbox %s is %s", id, rec.State)
	}
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox %q not found", id))
		} else {
			writeErr(w, err)
		}
		return node.Record{}, false
	}
	return rec, true
}

func (s *Server) domain() *string {
	if s.cfg.Domain == "" {
		return nil
	}
	d := s.cfg.Domain
	return &d
}

// templateOf is the E2B template of a sandbox: what it was created from
// through E2B, else its base layer.
func (s *Server) templateOf(rec node.Record) string {
	if m, ok := s.store.sandbox(rec.ID); ok && m.Template != "" {
		return m.Template
	}
	for _, l := range rec.Layers {
		if l.Kind == string(layer.KindBase) {
			return l.Ref
		}
	}
	return ""
}

func (s *Server) sandboxJSON(rec node.Record) sandboxJSON {
	out := sandboxJSON{
		TemplateID: s.templateOf(rec), SandboxID: rec.ID, ClientID: clientID,
		EnvdVersion: EnvdVersion, EnvdAccessToken: s.envdToken(rec.ID), Domain: s.domain(),
	}
	out.Alias = out.TemplateID
	if !s.portsPublic(rec.ID) {
		t := s.trafficToken(rec.ID)
		out.TrafficAccessToken = &t
	}
	return out
}

func (s *Server) listed(rec node.Record) listedSandbox {
	m, _ := s.store.sandbox(rec.ID)
	state := "running"
	switch rec.State {
	case node.StateRunning:
	case node.StatePaused:
		state = "paused"
	default:
		state = string(rec.State) // creating, deleting, error: Shoal's own words
	}
	md := rec.Metadata
	if md == nil {
		md = map[string]string{}
	}
	t := s.templateOf(rec)
	end := rec.Expires
	if !m.Deadline.IsZero() && rec.State != node.StatePaused {
		end = m.Deadline
	}
	return listedSandbox{
		TemplateID: t, Alias: t, SandboxID: rec.ID, ClientID: clientID,
		StartedAt: rec.Created.UTC().Format(time.RFC3339Nano), EndAt: end.UTC().Format(time.RFC3339Nano),
		CPUCount: max(1, (rec.Resources.MilliCPU+999)/1000), MemoryMB: rec.Resources.MemoryBytes >> 20,
		Metadata: md, State: state, EnvdVersion: EnvdVersion, VolumeMounts: []any{},
	}
}

// resolveTemplate fills req with what template names as req.Owner sees
// it: a Shoal environment, else a base layer (the tenant's own, else a
// shared one; another tenant's is not found); the SDK's default "base"
// falls back on Config.DefaultTemplate.
func (s *Server) resolveTemplate(t string, req *node.CreateRequest) error {
	if t == "" {
		return errdefs.New(errdefs.ErrInvalidArgument, "templateID is required")
	}
	ls := s.node.Layers().As(req.Owner)
	if _, err := ls.GetEnv(t); err == nil {
		req.Template = t
		return nil
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	l, err := ls.Resolve(t)
	switch {
	case err == nil && l.Kind != layer.KindBase:
		return errdefs.New(errdefs.ErrInvalidArgument, "template %q is a %s layer: a template must name a Shoal environment (shoal env ls) or a base layer", t, l.Kind)
	case err == nil:
		req.Base = t
		return nil
	case !errors.Is(err, layer.ErrNotFound) && !errors.Is(err, layer.ErrInvalidRef):
		return err
	}
	if t == "base" && s.cfg.DefaultTemplate != "" && s.cfg.DefaultTemplate != "base" {
		if err := s.resolveTemplate(s.cfg.DefaultTemplate, req); err != nil {
			return fmt.Errorf("E2B's default template %q is not a Shoal environment or layer, and neither is serve's --e2b-default-template: %w", t, err)
		}
		return nil
	}
	return errdefs.New(errdefs.ErrNotFound, "template %q not found: it is neither a Shoal environment (shoal env ls) nor a base layer (shoal layer ls; a layer is NAME:VERSION)", t)
}

// badRequest answers 400 with E2B's error body.
func badRequest(w http.ResponseWriter, format string, args ...any) {
	writeError(w, http.StatusBadRequest, fmt.Sprintf(format, args...))
}

// --- handlers ---

func (s *Server) createSandbox(w http.ResponseWriter, r *http.Request) {
	var in newSandbox
	if !decodeBody(w, r, &in) {
		return
	}
	// Refuse what Shoal cannot honour rather than pretend.
	switch {
	case in.AutoPause != nil && *in.AutoPause && s.cfg.Pause == PauseRefuse:
		badRequest(w, "autoPause (lifecycle onTimeout: 'pause') needs pause, which is turned off on this server (serve runs with --e2b-pause=refuse)")
		return
	case in.AutoResume != nil && in.AutoResume.Enabled && (in.AutoPause == nil || !*in.AutoPause):
		badRequest(w, "autoResume needs autoPause (lifecycle onTimeout: 'pause')")
		return
	case len(in.VolumeMounts) > 0:
		badRequest(w, "volumeMounts are not supported by Shoal yet")
		return
	case len(in.Iam) > 0 && string(in.Iam) != "null":
		badRequest(w, "iam (workload identity tokens) is not supported by Shoal yet")
		return
	case in.Timeout != nil && *in.Timeout <= 0:
		// As E2B's API refuses it (its setTimeout takes 0: the sandbox's
		// time ends now).
		badRequest(w, "Timeout must be greater than 0")
		return
	}
	public := true // E2B's default: allowPublicTraffic
	if n := in.Network; n != nil {
		switch {
		case len(n.EgressProxy) > 0 && string(n.EgressProxy) != "null", len(n.Rules) > 0 && string(n.Rules) != "null":
			badRequest(w, "network egressProxy and rules are not supported by Shoal yet (allowOut and denyOut are: IPv4 addresses and CIDRs)")
			return
		case n.MaskRequestHost != "", len(n.HTTPSPorts) > 0:
			badRequest(w, "network maskRequestHost and httpsPorts are not supported by Shoal yet")
			return
		}
		public = n.AllowPublicTraffic == nil || *n.AllowPublicTraffic
	}
	timeout := s.cfg.DefaultTimeout
	if in.Timeout != nil && *in.Timeout > 0 {
		timeout = limits.Seconds(*in.Timeout)
	}
	autoPause := in.AutoPause != nil && *in.AutoPause
	p := tenant.FromContext(r.Context())
	req := node.CreateRequest{Timeout: s.nodeTimeout(autoPause, timeout), Metadata: in.Metadata, Env: in.EnvVars, Tenant: p.Tenant,
		ClientKey: r.Header.Get(ClientKeyHeader)} // bounded by the node
	// A template is the tenant's own environment or base layer, else a
	// shared one (internal/layer's owner.go).
	if p != nil {
		req.Owner = layer.OwnerOf(p.Tenant, p.IsAdmin())
	}
	// Network: E2B's allowInternetAccess (the public internet; unset is
	// false here: Shoal sandboxes have no network unless asked), denyOut
	// taken out of it, allowOut allowed whatever denyOut says.
	if (in.AllowInternetAccess != nil && *in.AllowInternetAccess) || (in.Network != nil && len(in.Network.AllowOut) > 0) {
		req.Network = &netpolicy.Request{Internet: in.AllowInternetAccess != nil && *in.AllowInternetAccess}
		if n := in.Network; n != nil {
			req.Network.AllowOut, req.Network.DenyOut = n.AllowOut, n.DenyOut
		}
	}
	if err := s.resolveTemplate(in.TemplateID, &req); err != nil {
		writeErr(w, err)
		return
	}
	rec, err := s.node.Create(r.Context(), req)
	s.record(r.Context(), "sandbox.create", rec.ID, "template "+in.TemplateID, err)
	if err != nil {
		writeErr(w, err)
		return
	}
	meta := sandboxMeta{Template: in.TemplateID, Public: &public, Deadline: rec.Created.Add(timeout), AutoPause: autoPause,
		AutoPauseFSOnly: autoPause && in.AutoPauseMemory != nil && !*in.AutoPauseMemory}
	if err := s.store.putSandbox(rec.ID, meta); err != nil {
		s.log.Warn("e2b: record sandbox", "sandbox_id", rec.ID, "err", err)
	}
	s.log.Info("e2b: sandbox created", "sandbox_id", rec.ID, "template", in.TemplateID)
	writeJSON(w, http.StatusCreated, s.sandboxJSON(rec))
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request) {
	rec, ok := s.lookup(w, r.PathValue("id"))
	if !ok {
		return
	}
	writeJSON(w, http.StatusOK, sandboxDetail{
		listedSandbox: s.listed(rec), EnvdAccessToken: s.envdToken(rec.ID), Domain: s.domain(),
		Lifecycle: s.lifecycleOf(rec.ID),
	})
}

// autoPauseMargin is how much longer than its E2B timeout the node's own
// idle timeout of an auto-pausing sandbox is: E2B's deadline (checked every
// second) must come first, so that the sandbox is paused, not deleted.
const autoPauseMargin = time.Minute

// nodeTimeout is the node's idle timeout for an E2B timeout d.
func (s *Server) nodeTimeout(autoPause bool, d time.Duration) time.Duration {
	if autoPause && s.node.CheckTimeout(d+autoPauseMargin) == nil {
		return d + autoPauseMargin
	}
	return d
}

// lifecycleOf is E2B's lifecycle of a sandbox: killed or paused at its
// timeout; a paused sandbox is resumed by any traffic (autoResume), which
// Shoal does for every paused sandbox.
func (s *Server) lifecycleOf(id string) lifecycle {
	if m, _ := s.store.sandbox(id); m.AutoPause {
		return lifecycle{OnTimeout: "pause", AutoResume: true}
	}
	return lifecycle{OnTimeout: "kill"}
}

func (s *Server) killSandbox(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if _, ok := s.lookup(w, id); !ok {
		return
	}
	// A delete is not abandoned half way when the client goes away.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 2*time.Minute)
	defer cancel()
	err := s.node.Delete(ctx, id)
	s.record(r.Context(), "sandbox.delete", id, "", err)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox %q not found", id))
			return
		}
		writeErr(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// listFilter is the query of GET /v2/sandboxes.
type listFilter struct {
	metadata     map[string]string
	states       map[string]bool
	startedAfter time.Time
	template     string
}

func parseListFilter(q url.Values) (listFilter, error) {
	f := listFilter{states: map[string]bool{}}
	if m := q.Get("metadata"); m != "" {
		// "k=v&k2=v2", each key and value URL-encoded once more (the SDK
		// encodes them, then encodes the whole query string).
		vals, err := url.ParseQuery(m)
		if err != nil {
			return f, fmt.Errorf("metadata %q: %w", m, err)
		}
		f.metadata = map[string]string{}
		for k, vs := range vals {
			key, err1 := url.QueryUnescape(k)
			val, err2 := url.QueryUnescape(vs[0])
			if err1 != nil || err2 != nil {
				return f, fmt.Errorf("metadata %q: bad encoding", m)
			}
			f.metadata[key] = val
		}
	}
	for _, v := range q["state"] {
		for _, st := range strings.Split(v, ",") {
			switch st = strings.TrimSpace(st); st {
			case "running", "paused":
				f.states[st] = true
			case "":
			default:
				return f, fmt.Errorf("state %q: want running or paused", st)
			}
		}
	}
	if len(f.states) == 0 {
		f.states = map[string]bool{"running": true, "paused": true}
	}
	if v := q.Get("startedAfter"); v != "" {
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			return f, fmt.Errorf("startedAfter %q: want an RFC 3339 time", v)
		}
		f.startedAfter = t
	}
	f.template = q.Get("template")
	return f, nil
}

func (f listFilter) match(l listedSandbox, created time.Time) bool {
	if !f.states[l.State] {
		return false
	}
	if !f.startedAfter.IsZero() && created.Before(f.startedAfter) {
		return false
	}
	if f.template != "" && l.TemplateID != f.template {
		return false
	}
	for k, v := range f.metadata {
		if got, ok := l.Metadata[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// pageToken is the opaque X-Next-Token: where the next page starts.
func pageToken(rec node.Record) string { return PageToken(rec.Created, rec.ID) }

// PageToken is the X-Next-Token of a list page that ends with the sandbox
// id created at created: the next page starts after it (in the list's
// order: creation time, then ID), on any node, since it names a position,
// not a sandbox a node must hold (the control role merges nodes' pages).
func PageToken(created time.Time, id string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(created.UnixNano(), 10) + "/" + id))
}

func parsePageToken(tok string) (int64, string, error) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return 0, "", err
	}
	ns, id, ok := strings.Cut(string(b), "/")
	if !ok {
		return 0, "", errors.New("malformed")
	}
	n, err := strconv.ParseInt(ns, 10, 64)
	return n, id, err
}

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f, err := parseListFilter(q)
	if err != nil {
		badRequest(w, "%v", err)
		return
	}
	limit := listDefaultLimit
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > listMaxLimit {
			badRequest(w, "limit %q: want 1 to %d", v, listMaxLimit)
			return
		}
		limit = n
	}
	desc := true
	switch q.Get("order") {
	case "", "desc":
	case "asc":
		desc = false
	default:
		badRequest(w, "order %q: want asc or desc", q.Get("order"))
		return
	}
	recs := s.visible(r) // oldest first
	if desc {
		sort.SliceStable(recs, func(i, j int) bool { return !before(recs[i], recs[j]) })
	}
	start := 0
	if tok := q.Get("nextToken"); tok != "" {
		ns, id, err := parsePageToken(tok)
		if err != nil {
			badRequest(w, "nextToken %q is not a token this server gave", tok)
			return
		}
		cursor := node.Record{ID: id, Created: time.Unix(0, ns)}
		start = sort.Search(len(recs), func(i int) bool {
			if desc {
				return before(recs[i], cursor)
			}
			return before(cursor, recs[i])
		})
	}
	out := []listedSandbox{}
	running := 0
	var last node.Record
	more := false
	for i, rec := range recs {
		if rec.State != node.StateRunning && rec.State != node.StatePaused {
			continue
		}
		l := s.listed(rec)
		if l.State == "running" {
			running++
		}
		if i < start || !f.match(l, rec.Created) {
			continue
		}
		if len(out) == limit {
			more = true
			continue
		}
		out = append(out, l)
		last = rec
	}
	if more {
		w.Header().Set("X-Next-Token", pageToken(last))
	}
	w.Header().Set("X-Total-Running", strconv.Itoa(running))
	writeJSON(w, http.StatusOK, out)
}

// visible lists the sandboxes the key of r sees (its tenant's; every one
// for an admin key), oldest first.
func (s *Server) visible(r *http.Request) []node.Record {
	p := tenant.FromContext(r.Context())
	all := s.node.List()
	out := all[:0]
	for _, rec := range all {
		if p.Sees(rec.Tenant) {
			out = append(out, rec)
		}
	}
	return out
}

// before orders sandboxes by creation time, then ID (node.List's order).
func before(a, b node.Record) bool {
	if !a.Created.Equal(b.Created) {
		return a.Created.Before(b.Created)
	}
	return a.ID < b.ID
}

// listSandboxesV1 is the deprecated GET /sandboxes: running sandboxes, no
// paging.
func (s *Server) listSandboxesV1(w http.ResponseWriter, r *http.Request) {
	f, err := parseListFilter(url.Values{"metadata": r.URL.Query()["metadata"], "state": {"running"}})
	if err != nil {
		badRequest(w, "%v", err)
		return
	}
	out := []listedSandbox{}
	for _, rec := range s.visible(r) {
		if rec.State != node.StateRunning {
			continue
		}
		if l := s.listed(rec); f.match(l, rec.Created) {
			out = append(out, l)
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) setTimeout(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Timeout *int64 `json:"timeout"`
	}
	if !decodeBody(w, r, &in) {
		return
	}
	if in.Timeout == nil {
		badRequest(w, "timeout (seconds) is required")
		return
	}
	id := r.PathValue("id")
	rec, ok := s.lookup(w, id)
	if !ok {
		return
	}
	if *in.Timeout <= 0 {
		// As E2B's API: 0 (a negative timeout counts as 0) ends the
		// sandbox's time now, and what its timeout does is done at once:
		// killed, or paused if it was created with autoPause.
		if rec.State == node.StatePaused {
			writeError(w, http.StatusConflict, fmt.Sprintf("sandbox %s is paused: a timeout of 0 applies to a running sandbox (connect resumes it; kill deletes it)", id))
			return
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 2*time.Minute)
		defer cancel()
		s.timeUp(ctx, id)
		if m, _ := s.store.sandbox(id); !m.AutoPause {
			s.record(r.Context(), "sandbox.delete", id, "timeout 0", nil)
		}
		w.WriteHeader(http.StatusNoContent)
		return
	}
	d := limits.Seconds(*in.Timeout)
	if err := s.node.CheckTimeout(d); err != nil {
		writeErr(w, err)
		return
	}
	m, ok := s.store.sandbox(id)
	if ok && m.Paused {
		// Applies when the sandbox is resumed.
		m.ResumeTimeout = d
		if err := s.store.putSandbox(id, m); err != nil {
			writeErr(w, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if _, err := s.node.SetTimeout(id, s.nodeTimeout(m.AutoPause, d)); err != nil {
		writeErr(w, err)
		return
	}
	if ok && !m.Deadline.IsZero() {
		m.Deadline = time.Now().Add(d)
		if err := s.store.putSandbox(id, m); err != nil {
			writeErr(w, err)
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// extend pushes a sandbox's expiry (and its deadline, if it has one) to at
// least now+d, never shortening its idle timeout.
func (s *Server) extend(rec node.Record, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	until := time.Now().Add(d)
	if until.After(rec.Expires) {
		m, _ := s.store.sandbox(rec.ID)
		if _, err := s.node.SetTimeout(rec.ID, max(s.nodeTimeout(m.AutoPause, d), rec.Timeout)); err != nil {
			return err
		}
	}
	if m, ok := s.store.sandbox(rec.ID); ok && !m.Deadline.IsZero() && until.After(m.Deadline) {
		m.Deadline = until
		return s.store.putSandbox(rec.ID, m)
	}
	return nil
}

func (s *Server) refreshSandbox(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Duration *int64 `json:"duration"`
	}
	if !decodeBody(w, r, &in) {
		return
	}
	rec, ok := s.lookup(w, r.PathValue("id"))
	if !ok {
		return
	}
	d := rec.Timeout
	if in.Duration != nil && *in.Duration > 0 {
		d = limits.Seconds(*in.Duration)
	}
	if err := s.extend(rec, d); err != nil {
		writeErr(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) pauseSandbox(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Memory *bool `json:"memory"`
	}
	if !decodeBody(w, r, &in) {
		return
	}
	rec, ok := s.lookup(w, r.PathValue("id"))
	if !ok {
		return
	}
	if s.cfg.Pause == PauseRefuse {
		writeError(w, http.StatusNotImplemented, "pause is turned off on this server (serve runs with --e2b-pause=refuse); keep the sandbox running, or kill it")
		return
	}
	// The timeout it gets back on connect (E2B: a connect without timeout
	// restores the one it had).
	m, _ := s.store.sandbox(rec.ID)
	resumeTimeout := rec.Timeout
	if !m.Deadline.IsZero() {
		resumeTimeout = max(time.Until(m.Deadline), time.Second)
	}
	// keepMemory: false: the processes end, the files are kept.
	paused, err := s.pause(r.Context(), rec.ID, resumeTimeout, in.Memory != nil && !*in.Memory)
	if err != nil {
		writeErr(w, err)
		return
	}
	if !paused {
		writeError(w, http.StatusConflict, fmt.Sprintf("sandbox %s is already paused", rec.ID))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// pause pauses a sandbox (false: it was paused already), without its
// processes when fsOnly, and records that a connect gives it
// resumeTimeout.
func (s *Server) pause(ctx context.Context, id string, resumeTimeout time.Duration, fsOnly bool) (bool, error) {
	pause := s.node.Pause
	if fsOnly {
		pause = s.node.PauseFSOnly
	}
	rec, paused, err := pause(ctx, id)
	if err != nil || !paused {
		return paused, err
	}
	m, _ := s.store.sandbox(rec.ID)
	m.Paused, m.ResumeTimeout = true, resumeTimeout
	if err := s.store.putSandbox(rec.ID, m); err != nil {
		return true, err
	}
	s.log.Info("e2b: sandbox paused", "sandbox_id", rec.ID)
	return true, nil
}

// resume resumes a paused sandbox (if it still is: a request may have
// resumed it) and gives it timeout d (0: its timeout before the pause).
func (s *Server) resume(ctx context.Context, rec node.Record, m sandboxMeta, d time.Duration) (node.Record, error) {
	if _, _, err := s.node.Resume(ctx, rec.ID); err != nil {
		return rec, err
	}
	if d <= 0 {
		d = m.ResumeTimeout
	}
	if d <= 0 {
		d = s.cfg.DefaultTimeout
	}
	m.Paused, m.ResumeTimeout = false, 0
	if !m.Deadline.IsZero() {
		m.Deadline = time.Now().Add(d)
	}
	if err := s.store.putSandbox(rec.ID, m); err != nil {
		return rec, err
	}
	s.log.Info("e2b: sandbox resumed", "sandbox_id", rec.ID)
	return s.node.SetTimeout(rec.ID, s.nodeTimeout(m.AutoPause, d))
}

func (s *Server) connectSandbox(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Timeout *int64 `json:"timeout"`
		Memory  *bool  `json:"memory"`
	}
	if !decodeBody(w, r, &in) {
		return
	}
	rec, ok := s.lookup(w, r.PathValue("id"))
	if !ok {
		return
	}
	if in.Memory != nil && !*in.Memory {
		badRequest(w, "resuming from disk state only (onResume: 'reboot') is not supported by Shoal yet")
		return
	}
	var d time.Duration
	if in.Timeout != nil && *in.Timeout > 0 {
		d = limits.Seconds(*in.Timeout)
	}
	status := http.StatusOK
	var err error
	if m, _ := s.store.sandbox(rec.ID); m.Paused || rec.State == node.StatePaused {
		status = http.StatusCreated
		rec, err = s.resume(r.Context(), rec, m, d)
	} else {
		if d == 0 {
			d = s.cfg.DefaultTimeout
		}
		err = s.extend(rec, d)
	}
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, status, s.sandboxJSON(rec))
}

// resumeSandbox is the deprecated POST /sandboxes/{id}/resume.
func (s *Server) resumeSandbox(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Timeout   *int64 `json:"timeout"`
		AutoPause *bool  `json:"autoPause"`
	}
	if !decodeBody(w, r, &in) {
		return
	}
	rec, ok := s.lookup(w, r.PathValue("id"))
	if !ok {
		return
	}
	m, _ := s.store.sandbox(rec.ID)
	if !m.Paused && rec.State != node.StatePaused {
		writeError(w, http.StatusConflict, fmt.Sprintf("sandbox %s is already running", rec.ID))
		return
	}
	var d time.Duration
	if in.Timeout != nil && *in.Timeout > 0 {
		d = limits.Seconds(*in.Timeout)
	}
	rec, err := s.resume(r.Context(), rec, m, d)
	if err != nil {
		writeErr(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.sandboxJSON(rec))
}
