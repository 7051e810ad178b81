package control

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/audit"
	"github.com/shoal-sandbox/shoal/internal/dash"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/session"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// The dashboard's sessions. A browser logs in with an API key (POST
// /dash/login) and gets a session token that the page sends as its bearer
// token on ordinary API calls; the key itself is not kept by the browser.
// A WebSocket cannot carry an Authorization header, so the terminal takes a
// ticket instead: single use, valid for ticketTTL, fetched with the session
// token (POST /dash/ticket), and its upgrade must come from the page's own
// origin. Tokens live in memory: a restart of serve logs everyone out.
const (
	sessionPrefix = "sk_dash_"
	sessionTTL    = 12 * time.Hour
	ticketTTL     = 30 * time.Second
	maxSessions   = 1024 // the oldest session goes when a login would pass it
	maxTickets    = 1024
	// terminalMaxMessage bounds one message from the browser (keystrokes,
	// a paste, a resize).
	terminalMaxMessage = 64 << 10
)

type dashboard struct {
	auth  *Auth
	log   *slog.Logger
	audit func() *audit.Log // nil, or returning nil: nothing audited
	// open serves the terminal's WebSocket once the ticket is taken: a
	// node's own (Server.openTerminal) or a control replica's, passed on
	// to the sandbox's node (Forwarder.proxyTerminal).
	open func(w http.ResponseWriter, r *http.Request, p *tenant.Principal, key string)

	mu       sync.Mutex           // guards sessions and tickets
	sessions map[string]dashGrant // session token -> the key it was made from
	tickets  map[string]dashGrant // terminal ticket -> the key
}

// dashGrant: the API key a token stands for (re-resolved on every use, so
// deleting the key ends its sessions), until expires.
type dashGrant struct {
	key     string
	expires time.Time
}

func newDashboard(auth *Auth, log *slog.Logger, audit func() *audit.Log, open func(http.ResponseWriter, *http.Request, *tenant.Principal, string)) *dashboard {
	d := &dashboard{auth: auth, log: log, audit: audit, open: open, sessions: map[string]dashGrant{}, tickets: map[string]dashGrant{}}
	auth.session = d.sessionKey
	return d
}

// withSessionKeys passes requests on with a session token in their
// Authorization header replaced by its API key: for a control replica,
// which forwards the client's credentials to nodes that do not know its
// sessions.
func (d *dashboard) withSessionKeys(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if t, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "+sessionPrefix); ok {
			if key, ok := d.sessionKey(sessionPrefix + t); ok {
				r = r.Clone(r.Context())
				r.Header.Set("Authorization", "Bearer "+key)
			}
		}
		next.ServeHTTP(w, r)
	})
}

// sessionKey returns the API key of a live session token.
func (d *dashboard) sessionKey(token string) (string, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	g, ok := d.sessions[token]
	if !ok || time.Now().After(g.expires) {
		delete(d.sessions, token)
		return "", false
	}
	return g.key, true
}

func newToken(prefix string) string {
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return prefix + hex.EncodeToString(b[:])
}

// grant stores a new token for key in m (one of d's maps), dropping
// expired ones and, past max, the one closest to expiry. Called with d.mu.
func grant(m map[string]dashGrant, prefix, key string, ttl time.Duration, max int) (string, time.Time) {
	now := time.Now()
	for t, g := range m {
		if now.After(g.expires) {
			delete(m, t)
		}
	}
	for len(m) >= max {
		var oldest string
		for t, g := range m {
			if oldest == "" || g.expires.Before(m[oldest].expires) {
				oldest = t
			}
		}
		delete(m, oldest)
	}
	t := newToken(prefix)
	m[t] = dashGrant{key: key, expires: now.Add(ttl)}
	return t, m[t].expires
}

// handler serves /dash/... (and redirects / there) and passes every other
// request to api.
func (d *dashboard) handler(api http.Handler) http.Handler {
	mux := http.NewServeMux()
	files := http.FileServerFS(dash.Assets())
	mux.Handle("GET /dash/", http.StripPrefix("/dash", securityHeaders(files)))
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/dash/", http.StatusFound)
	})
	mux.HandleFunc("POST /dash/login", d.login)
	mux.HandleFunc("POST /dash/logout", d.logout)
	mux.Handle("POST /dash/ticket", d.auth.Middleware(http.HandlerFunc(d.ticket)))
	mux.HandleFunc("GET /dash/terminal", d.terminal)
	mux.Handle("/", api)
	return mux
}

// securityHeaders: the dashboard loads nothing from elsewhere and is not
// framed; sandbox output is shown as text only (textContent, xterm.js).
func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		next.ServeHTTP(w, r)
	})
}

// sameOrigin reports whether a browser request comes from a page of this
// server: its Origin header (set by browsers on POSTs and WebSockets)
// names the host the request was sent to. A request without Origin is not
// from a browser page and passes (it needs a key or ticket anyway).
func sameOrigin(r *http.Request, required bool) bool {
	o := r.Header.Get("Origin")
	if o == "" {
		return !required
	}
	u, err := url.Parse(o)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && strings.EqualFold(u.Host, r.Host)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// login exchanges an API key for a session token.
func (d *dashboard) login(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r, false) {
		writeHTTPError(w, http.StatusForbidden, "permission_denied", "login from another origin")
		return
	}
	var req struct {
		Key string `json:"key"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 4<<10)).Decode(&req); err != nil {
		writeHTTPError(w, http.StatusBadRequest, "invalid_argument", "want a JSON body {\"key\": \"<API key>\"}")
		return
	}
	key := strings.TrimSpace(req.Key)
	var p *tenant.Principal
	if key != "" && !strings.HasPrefix(key, sessionPrefix) {
		p = d.auth.principal(r.Context(), key)
	}
	if p == nil {
		d.log.Info("dashboard login refused", "remote", r.RemoteAddr)
		writeHTTPError(w, http.StatusUnauthorized, "unauthenticated", "invalid API key")
		return
	}
	d.mu.Lock()
	token, exp := grant(d.sessions, sessionPrefix, key, sessionTTL, maxSessions)
	d.mu.Unlock()
	d.record(p, "dashboard.login", "", "")
	writeJSON(w, http.StatusOK, map[string]any{
		"token": token, "expires_at": exp.UTC().Format(time.RFC3339),
		"name": p.Key, "tenant": p.Tenant, "admin": p.IsAdmin(),
	})
}

// logout ends the session whose token is the request's bearer token.
func (d *dashboard) logout(w http.ResponseWriter, r *http.Request) {
	token, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	d.mu.Lock()
	delete(d.sessions, token)
	d.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{})
}

// ticket gives the terminal's WebSocket a single-use ticket for the
// request's key (authenticated by the middleware).
func (d *dashboard) ticket(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r, false) {
		writeHTTPError(w, http.StatusForbidden, "permission_denied", "ticket from another origin")
		return
	}
	p := tenant.FromContext(r.Context())
	if err := p.Require("terminal", tenant.ScopeSandboxes); err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	got := requestKey(r)
	key := got
	if strings.HasPrefix(got, sessionPrefix) {
		var ok bool
		if key, ok = d.sessionKey(got); !ok {
			writeHTTPError(w, http.StatusUnauthorized, "unauthenticated", "session expired")
			return
		}
	}
	d.mu.Lock()
	t, exp := grant(d.tickets, "tk_", key, ticketTTL, maxTickets)
	d.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"ticket": t, "expires_at": exp.UTC().Format(time.RFC3339)})
}

// takeTicket consumes a ticket and returns its key.
func (d *dashboard) takeTicket(t string) (string, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for have, g := range d.tickets {
		if subtle.ConstantTimeCompare([]byte(have), []byte(t)) == 1 {
			delete(d.tickets, have)
			return g.key, time.Now().Before(g.expires)
		}
	}
	return "", false
}

func (d *dashboard) record(p *tenant.Principal, action, object, detail string) {
	if d.audit == nil {
		return
	}
	log := d.audit()
	if log == nil {
		return
	}
	e := audit.Entry{Key: p.String(), Action: action, Object: object, Detail: detail, Result: "ok"}
	if p != nil {
		e.Key, e.Tenant = p.Key, p.Tenant
	}
	log.Record(e)
}

// terminalShell runs bash when the sandbox has one, else sh, interactive.
var terminalShell = []string{"/bin/sh", "-c", "if [ -x /bin/bash ]; then exec /bin/bash -i; fi; exec /bin/sh -i"}

// terminal serves GET /dash/terminal?sandbox=ID&ticket=T&rows=R&cols=C: a
// WebSocket to a shell under a PTY in the sandbox (a command of the
// session layer, so it shows among the sandbox's commands). Binary
// messages from the browser are its input; text messages are JSON
// controls ({"type":"resize","rows":R,"cols":C}). The server sends the
// output as binary messages and, when the shell ends, a text message
// {"type":"exit","code":N} before closing. Closing the socket kills the
// shell.
func (d *dashboard) terminal(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r, true) {
		writeHTTPError(w, http.StatusForbidden, "permission_denied", "the terminal's WebSocket must come from the dashboard's own origin")
		return
	}
	q := r.URL.Query()
	key, ok := d.takeTicket(q.Get("ticket"))
	var p *tenant.Principal
	if ok {
		p = d.auth.principal(r.Context(), key)
	}
	if p == nil {
		writeHTTPError(w, http.StatusUnauthorized, "unauthenticated", "missing, used or expired ticket: get one from POST /dash/ticket")
		return
	}
	if err := p.Require("terminal", tenant.ScopeSandboxes); err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	d.open(w, r, p, key)
}

// openTerminal is a node's terminal (dashboard.terminal) after its ticket
// was taken: a shell in the sandbox, its PTY over the WebSocket.
func (s *Server) openTerminal(w http.ResponseWriter, r *http.Request, p *tenant.Principal, _ string) {
	d := s.dash
	q := r.URL.Query()
	ctx := tenant.WithPrincipal(r.Context(), p)
	id := q.Get("sandbox")
	if _, err := s.sandboxFor(ctx, id); err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	held, err := s.holdStream(ctx, id, "a terminal")
	if err != nil {
		writeConnectError(w, err)
		return
	}
	defer held()
	rows, _ := strconv.ParseUint(q.Get("rows"), 10, 32)
	cols, _ := strconv.ParseUint(q.Get("cols"), 10, 32)
	if rows == 0 && cols == 0 {
		rows, cols = 24, 80
	}
	if err := limits.Pty(uint32(rows), uint32(cols)); err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	c, _, err := s.sessions.Start(ctx, id, session.StartRequest{
		Args: terminalShell, Env: []string{"TERM=xterm-256color"}, StdinOpen: true,
		PTY: &agent.Winsize{Rows: uint16(rows), Cols: uint16(cols)},
	})
	if err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	cmdID := c.Info().ID
	d.record(p, "terminal.open", id, cmdID)
	defer func() {
		// The browser went away or the shell ended: end the shell and
		// whatever it started in the foreground.
		kctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if c.Info().State == session.StateRunning {
			s.sessions.Signal(kctx, c, syscall.SIGKILL)
		}
	}()
	// websocket.Accept checks Origin against Host too (no OriginPatterns).
	conn, err := websocket.Accept(w, r, nil)
	if err != nil {
		return
	}
	defer conn.CloseNow()
	conn.SetReadLimit(terminalMaxMessage)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		defer cancel()
		for {
			typ, data, err := conn.Read(ctx)
			if err != nil {
				return
			}
			if typ == websocket.MessageBinary {
				if err := s.sessions.SendStdin(ctx, c, data, false); err != nil {
					return
				}
				continue
			}
			var m struct {
				Type       string `json:"type"`
				Rows, Cols uint32
			}
			if json.Unmarshal(data, &m) != nil || m.Type != "resize" || limits.Pty(m.Rows, m.Cols) != nil {
				continue
			}
			s.sessions.Resize(ctx, c, agent.Winsize{Rows: uint16(m.Rows), Cols: uint16(m.Cols)})
		}
	}()
	err = s.sessions.Events(ctx, c, 0, keepAlive, func(ev session.Event) error {
		switch ev.Kind {
		case session.EventStdout, session.EventStderr:
			return conn.Write(ctx, websocket.MessageBinary, ev.Data)
		case session.EventExit:
			b, _ := json.Marshal(map[string]any{"type": "exit", "code": ev.Exit.Code, "signal": ev.Exit.Signal})
			return conn.Write(ctx, websocket.MessageText, b)
		case session.EventLost:
			return errors.New("lost")
		}
		return nil
	})
	if err != nil && ctx.Err() == nil {
		s.log.Debug("dashboard terminal ended", "sandbox_id", id, "command", cmdID, "err", err)
		conn.Close(websocket.StatusInternalError, truncate(fmt.Sprint(err), 100))
		return
	}
	conn.Close(websocket.StatusNormalClosure, "")
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
