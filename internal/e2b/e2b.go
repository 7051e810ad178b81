// Package e2b is Shoal's E2B-compatible face: it answers the stock e2b SDKs
// (npm "e2b", PyPI "e2b") with Shoal's own sandboxes, commands and files, so
// that code written for E2B runs on Shoal with nothing changed but the SDK's
// settings (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY; see the README).
//
// One HTTP handler serves two kinds of request, told apart per request:
//
//   - Sandbox traffic, addressed by the request headers E2b-Sandbox-Id and
//     E2b-Sandbox-Port (what the SDK sends when E2B_SANDBOX_URL is set), or
//     by a host name PORT-SANDBOXID.DOMAIN (E2B's own scheme). Port 49983 is
//     envd, E2B's in-sandbox daemon, answered here: its process and
//     filesystem services (Connect RPC, api/e2b) and its /files, /health and
//     /envs HTTP endpoints, on top of the session layer (every process is an
//     ordinary durable Shoal command) and the guest agent. Any other port is
//     proxied to that TCP port inside the sandbox through the agent.
//   - The control plane (everything else): E2B's REST API for sandboxes
//     (create, get, list, timeout, pause, connect, kill), on the node
//     manager, behind Shoal's API key (E2B's X-API-Key header).
//
// Envd calls are authenticated by a per-sandbox access token (the SDK's
// X-Access-Token header), an HMAC of the sandbox ID under a secret kept in
// DATA/e2b/secret; the control plane hands it out with the sandbox.
//
// What E2B has and Shoal's records lack (a sandbox's template, its E2B
// deadline and pause state; a process's tag and configuration as the client
// gave it) is kept beside them in the node's store (store.go). E2B's
// timeout is a time to live, enforced here on top of the node's idle
// timeout.
package e2b

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/audit"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/node"
	"github.com/shoal-sandbox/shoal/internal/session"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// EnvdPort is the port of E2B's in-sandbox daemon; requests for it are
// answered by Shoal itself.
const EnvdPort = 49983

// EnvdVersion is the envd version Shoal reports. The SDK gates features on
// it: 0.4.0 drops the implicit "user" user, 0.5.2 adds closeStdin, 0.5.7
// octet-stream uploads, 0.6.3 entries in watch events.
const EnvdVersion = "0.6.4"

// Pause modes (Config.Pause).
const (
	// PauseOn: pause pauses the sandbox (node.Manager.Pause: its
	// processes frozen, its memory reclaimed); connect resumes it.
	PauseOn = "on"
	// PauseKeepRunning is the old name of PauseOn, accepted still (it
	// once kept the sandbox running, when Shoal could not pause).
	PauseKeepRunning = "keep-running"
	// PauseRefuse: pause answers 501 Not Implemented.
	PauseRefuse = "refuse"
)

// Config configures the E2B face.
type Config struct {
	// DataDir holds DATA/e2b (the token secret, the TLS certificates).
	DataDir string
	// Domain is returned to clients as the sandbox domain: the SDK's
	// getHost(port) is PORT-SANDBOXID.Domain, and without E2B_SANDBOX_URL
	// the SDK reaches envd at https://49983-SANDBOXID.Domain. It may carry a
	// port ("shoal.localhost:7481"). Empty: clients use their E2B_DOMAIN.
	Domain string
	// DefaultTemplate is what the SDK's default template "base" means when
	// no environment or layer is named "base" (a Shoal environment name or
	// a base layer reference). Empty: "base" must exist.
	DefaultTemplate string
	// HomeDir is root's home: where relative paths resolve and where
	// commands start without a cwd when they act as root, if it exists in
	// the sandbox (a user's own home is in the sandbox's /etc/passwd).
	HomeDir string
	// DefaultUser is the sandbox user of requests that name none (E2B's
	// templates have "user"; see users.go); root when the sandbox has no
	// such user. Default "user"; "root": root.
	DefaultUser string
	// TemplateUsers overrides DefaultUser per template (the name given to
	// create).
	TemplateUsers map[string]string
	// DefaultTimeout is a sandbox's timeout when a create or connect gives
	// none (E2B's default: 300 s).
	DefaultTimeout time.Duration
	// Pause is PauseOn (default) or PauseRefuse. How long a paused
	// sandbox is kept is the node's (serve --paused-timeout).
	Pause string
	// Audit records creates, kills and process starts (nil: not audited).
	Audit *audit.Log
}

// Validate fills defaults and checks the configuration.
func (c *Config) Validate() error {
	if c.DataDir == "" {
		return errors.New("e2b config: data dir is required")
	}
	if c.HomeDir == "" {
		c.HomeDir = "/root"
	}
	if c.DefaultUser == "" {
		c.DefaultUser = "user"
	}
	if !strings.HasPrefix(c.HomeDir, "/") {
		return fmt.Errorf("e2b config: home dir %q must be absolute", c.HomeDir)
	}
	if c.DefaultTimeout == 0 {
		c.DefaultTimeout = 300 * time.Second
	}
	switch c.Pause {
	case "", PauseKeepRunning:
		c.Pause = PauseOn
	case PauseOn, PauseRefuse:
	default:
		return fmt.Errorf("e2b config: pause mode %q: want %s or %s", c.Pause, PauseOn, PauseRefuse)
	}
	return nil
}

// Sandboxes is what the E2B face needs of the node's sandbox manager
// (*node.Manager).
type Sandboxes interface {
	Create(ctx context.Context, req node.CreateRequest) (node.Record, error)
	Get(id string) (node.Record, error)
	List() []node.Record
	Delete(ctx context.Context, id string) error
	SetTimeout(id string, d time.Duration) (node.Record, error)
	CheckTimeout(d time.Duration) error
	Agent(id string) (*agent.Client, error)
	Pause(ctx context.Context, id string) (node.Record, bool, error)
	PauseFSOnly(ctx context.Context, id string) (node.Record, bool, error)
	Resume(ctx context.Context, id string) (node.Record, bool, error)
	Hold(id string) (release func(), err error)
	Layers() *layer.Store
}

// Commands is what the E2B face needs of the session layer
// (*session.Manager).
type Commands interface {
	Start(ctx context.Context, sandboxID string, req session.StartRequest) (*session.Command, bool, error)
	Get(sandboxID, id string) (*session.Command, error)
	List(sandboxID string) []session.Info
	Events(ctx context.Context, c *session.Command, from int64, keepAlive time.Duration, fn func(session.Event) error) error
	SendStdin(ctx context.Context, c *session.Command, data []byte, close bool) error
	Signal(ctx context.Context, c *session.Command, sig syscall.Signal) error
	Resize(ctx context.Context, c *session.Command, size agent.Winsize) error
}

var (
	_ Sandboxes = (*node.Manager)(nil)
	_ Commands  = (*session.Manager)(nil)
)

// Server is the E2B face. It is safe for concurrent use.
type Server struct {
	cfg      Config
	log      *slog.Logger
	node     Sandboxes
	sessions Commands
	secret   []byte
	store    *store

	api  http.Handler // control plane
	envd http.Handler // envd face; the sandbox ID is in the request context

	// Request counting (metrics.go), set by CountRequests before serving.
	count           func(route, code string, took time.Duration)
	apiMux, envdMux *http.ServeMux
	envdProcs       map[string]bool

	proxy *portProxy
	// streams caps concurrent streams (SetStreams; nil: none).
	streams *limits.Streams

	watchers *watcherRegistry // non-streaming directory watchers
	stop     chan struct{}    // closed by Close
	stopOnce sync.Once

	mu        sync.Mutex          // guards sandboxes and expiring
	sandboxes map[string]*sbInfo  // facts about a sandbox's root, learnt on first use
	expiring  map[string]struct{} // sandboxes being deleted for their deadline
}

// New returns the E2B face. apiAuth wraps the control plane with Shoal's API
// key check (control.Auth.Middleware). Call Recover once the node and the
// session layer have recovered, and register OnDelete with the node.
func New(cfg Config, db *bbolt.DB, sandboxes Sandboxes, commands Commands, apiAuth func(http.Handler) http.Handler, log *slog.Logger) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	dir := filepath.Join(cfg.DataDir, "e2b")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	secret, err := loadOrCreateSecret(filepath.Join(dir, "secret"))
	if err != nil {
		return nil, err
	}
	st, err := openStore(db)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg: cfg, log: log, node: sandboxes, sessions: commands,
		secret: secret, store: st, sandboxes: map[string]*sbInfo{},
		expiring: map[string]struct{}{}, stop: make(chan struct{}),
	}
	s.watchers = newWatcherRegistry(s)
	s.proxy = newPortProxy(s)
	s.api = KeyAlias(apiAuth(s.apiRoutes()))
	s.envd = s.envdRoutes()
	return s, nil
}

// Recover drops what the E2B face remembers about sandboxes that are gone
// (deleted while Shoal was down), then starts enforcing E2B's deadlines
// (until Close).
func (s *Server) Recover() error {
	live := map[string]bool{}
	for _, r := range s.node.List() {
		live[r.ID] = true
	}
	if err := s.store.prune(live); err != nil {
		return err
	}
	go s.expire()
	return nil
}

// expire kills sandboxes whose E2B deadline has passed. E2B's timeout is a
// time to live: unlike Shoal's idle timeout, a running command does not
// keep the sandbox alive past it.
func (s *Server) expire() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case now := <-t.C:
			for _, id := range s.store.expired(now) {
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
					defer cancel()
					s.timeUp(ctx, id)
				}()
			}
		}
	}
}

// timeUp does what a sandbox's E2B timeout does when it passes: it kills
// the sandbox, or pauses it when it was created with autoPause. It does
// nothing when the same is already under way for id.
func (s *Server) timeUp(ctx context.Context, id string) {
	s.mu.Lock()
	_, busy := s.expiring[id]
	s.expiring[id] = struct{}{}
	s.mu.Unlock()
	if busy {
		return
	}
	defer func() {
		s.mu.Lock()
		delete(s.expiring, id)
		s.mu.Unlock()
	}()
	if m, _ := s.store.sandbox(id); m.AutoPause {
		// onTimeout: 'pause': paused, not killed; a connect resumes it
		// with the timeout it was created with.
		s.log.Info("e2b: sandbox timeout: auto-pause", "sandbox_id", id)
		d := s.cfg.DefaultTimeout
		if rec, err := s.node.Get(id); err == nil && rec.Timeout > autoPauseMargin {
			d = rec.Timeout - autoPauseMargin // the E2B timeout (nodeTimeout)
		}
		if _, err := s.pause(ctx, id, d, m.AutoPauseFSOnly); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			s.log.Error("e2b: auto-pause expired sandbox", "sandbox_id", id, "err", err)
		}
		return
	}
	s.log.Info("e2b: sandbox timeout", "sandbox_id", id)
	err := s.node.Delete(ctx, id)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		s.store.dropSandbox(id)
	case err != nil:
		s.log.Error("e2b: delete expired sandbox", "sandbox_id", id, "err", err)
	}
}

// OnDelete forgets a deleted sandbox; register it with node.Manager.OnDelete.
func (s *Server) OnDelete(id string) {
	s.mu.Lock()
	delete(s.sandboxes, id)
	s.mu.Unlock()
	s.watchers.dropSandbox(id)
	s.proxy.dropSandbox(id)
	if err := s.store.dropSandbox(id); err != nil {
		s.log.Warn("e2b: forget sandbox", "sandbox_id", id, "err", err)
	}
}

// OnPrune forgets what the face kept of commands the session layer's
// retention policy pruned; register it with session.Manager.OnPrune.
func (s *Server) OnPrune(sandboxID string, commandIDs []string) {
	if err := s.store.dropCommands(sandboxID, commandIDs); err != nil {
		s.log.Warn("e2b: forget pruned commands", "sandbox_id", sandboxID, "err", err)
	}
}

// Close stops the background work (deadlines, watchers).
func (s *Server) Close() {
	s.stopOnce.Do(func() { close(s.stop) })
	s.watchers.close()
}

// ServeHTTP routes a request to sandbox traffic (by header or host name) or
// to the control plane.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if s.count != nil {
		s.counting(w, r, s.serveHTTP)
		return
	}
	s.serveHTTP(w, r)
}

func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request) {
	id, port, ok, err := SandboxTarget(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if ok {
		s.sandboxTraffic(w, r, id, port)
		return
	}
	if r.Method == http.MethodConnect {
		writeError(w, http.StatusMethodNotAllowed, "Shoal's E2B endpoint is not an HTTP CONNECT proxy")
		return
	}
	s.api.ServeHTTP(w, r)
}

// SandboxTarget says whether r is sandbox traffic, and for which sandbox
// and port: by the headers E2b-Sandbox-Id and E2b-Sandbox-Port (default
// EnvdPort), else by a host name PORT-SANDBOXID.DOMAIN. ok is false for
// the control plane. A bad E2b-Sandbox-Port is an error.
func SandboxTarget(r *http.Request) (id string, port int, ok bool, err error) {
	if id := r.Header.Get("E2b-Sandbox-Id"); id != "" {
		port := EnvdPort
		if p := r.Header.Get("E2b-Sandbox-Port"); p != "" {
			n, err := strconv.Atoi(p)
			if err != nil || n < 1 || n > 65535 {
				return "", 0, false, fmt.Errorf("E2b-Sandbox-Port %q is not a port number", p)
			}
			port = n
		}
		return id, port, true, nil
	}
	if port, id, ok := parseSandboxHost(r.Host); ok {
		return id, port, true, nil
	}
	return "", 0, false, nil
}

// KeyAlias accepts Shoal's generated API key ("sk_shoal_<hex>") in E2B's
// format as well, "e2b_<hex>": some SDK versions refuse a key that does not
// look like E2B's (unless E2B_VALIDATE_API_KEY=false).
func KeyAlias(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if k := r.Header.Get("X-API-Key"); strings.HasPrefix(k, "e2b_") {
			r.Header.Set("X-API-Key", "sk_shoal_"+k[len("e2b_"):])
		}
		next.ServeHTTP(w, r)
	})
}

// parseSandboxHost parses a host name of the form PORT-SANDBOXID.DOMAIN
// (with or without :port): E2B's address of a port of a sandbox. Any domain
// is accepted: the first label decides.
func parseSandboxHost(host string) (port int, id string, ok bool) {
	if h, _, err := splitHostPort(host); err == nil {
		host = h
	}
	label, _, found := strings.Cut(host, ".")
	if !found {
		return 0, "", false
	}
	p, id, found := strings.Cut(label, "-")
	if !found || p == "" || id == "" {
		return 0, "", false
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > 65535 {
		return 0, "", false
	}
	return n, strings.ToLower(id), true
}

func splitHostPort(hostport string) (host, port string, err error) {
	i := strings.LastIndexByte(hostport, ':')
	if i < 0 || strings.Contains(hostport[i:], "]") {
		return hostport, "", errors.New("no port")
	}
	return strings.Trim(hostport[:i], "[]"), hostport[i+1:], nil
}

type sandboxKey struct{}

// sandboxID returns the sandbox a request of the envd face is for.
func sandboxID(ctx context.Context) string {
	id, _ := ctx.Value(sandboxKey{}).(string)
	return id
}

// sandboxTraffic serves a request addressed to port of sandbox id: envd
// itself, or a TCP port inside the sandbox.
func (s *Server) sandboxTraffic(w http.ResponseWriter, r *http.Request, id string, port int) {
	rec, err := s.node.Get(id)
	// A paused sandbox's traffic resumes it (node.Manager.Agent), except
	// envd's /health: isRunning() is false for a paused sandbox.
	if err != nil || (rec.State != node.StateRunning && rec.State != node.StatePaused) {
		// What E2B's edge answers for a sandbox that is gone: the SDK
		// reports it as not running (isRunning() == false).
		writeError(w, http.StatusBadGateway, fmt.Sprintf("The sandbox %s was not found or is not running", id))
		return
	}
	if port != EnvdPort {
		s.proxy.serve(w, r, rec, port)
		return
	}
	if r.URL.Path != "/health" && !s.envdAuthorized(r, id) {
		writeError(w, http.StatusUnauthorized, "missing or invalid X-Access-Token for this sandbox (it is returned with the sandbox by create and connect)")
		return
	}
	user, err := requestUser(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	s.envd.ServeHTTP(w, r.WithContext(withUser(context.WithValue(r.Context(), sandboxKey{}, id), user)))
}

// record writes an audit entry for an action of the key of ctx (or, for
// envd's calls, which carry the sandbox's access token and no key, "envd"
// with the sandbox's tenant).
func (s *Server) record(ctx context.Context, action, sandboxID, detail string, err error) {
	if s.cfg.Audit == nil {
		return
	}
	e := audit.Entry{Key: "envd", Action: "e2b." + action, Object: sandboxID, Detail: detail, Result: errdefs.Code(err)}
	if p := tenant.FromContext(ctx); p != nil {
		e.Key, e.Tenant = p.Key, p.Tenant
	} else if rec, gerr := s.node.Get(sandboxID); gerr == nil {
		e.Tenant = rec.Tenant
	}
	s.cfg.Audit.Record(e)
}

// envdAuthorized checks a request's X-Access-Token, or a signed /files URL.
func (s *Server) envdAuthorized(r *http.Request, id string) bool {
	tok := r.Header.Get("X-Access-Token")
	if tok != "" {
		return subtle.ConstantTimeCompare([]byte(tok), []byte(s.envdToken(id))) == 1
	}
	if r.URL.Path == "/files" && r.URL.Query().Get("signature") != "" {
		return s.validSignature(r, id) == nil
	}
	return false
}

// envdToken is the access token of a sandbox's envd face.
func (s *Server) envdToken(id string) string { return s.token("envd", id) }

// trafficToken is the token that opens a private sandbox's ports.
func (s *Server) trafficToken(id string) string { return s.token("traffic", id) }

func (s *Server) token(kind, id string) string {
	m := hmac.New(sha256.New, s.secret)
	m.Write([]byte(kind + ":" + id))
	return hex.EncodeToString(m.Sum(nil)[:20])
}

func loadOrCreateSecret(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err == nil && len(b) >= 32 {
		return b, nil
	}
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("read e2b secret: %w", err)
	}
	b = make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return nil, err
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return nil, fmt.Errorf("write e2b secret: %w", err)
	}
	return b, nil
}

// apiError is E2B's error body: {"code": <HTTP status>, "message": ...}.
type apiError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// WriteError answers status with E2B's error body (what the SDK reads).
func WriteError(w http.ResponseWriter, status int, msg string) { writeError(w, status, msg) }

func writeError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(apiError{Code: status, Message: msg})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}
