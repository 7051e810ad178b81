package control

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/agent"
)

// Ports: reaching TCP ports inside a sandbox. A sandbox has no network of
// its own (only loopback); the node reaches its ports through the guest
// agent (agent.Client.DialPort), which connects from inside the sandbox's
// network namespace, so this works the same for every backend.
//
//	ANY /v1/sandboxes/{id}/ports/{port}/{path...}
//	    reverse-proxied to http://127.0.0.1:{port}/{path...} in the sandbox
//	    (query kept; WebSockets and other Upgrades pass through). The
//	    API key is consumed here and not forwarded: X-API-Key always,
//	    Authorization when the key came in it (a request with the key in
//	    X-API-Key passes its own Authorization on to the app, unless it is
//	    "Bearer <the key>"); X-Forwarded-For/-Host/-Proto and X-Forwarded-Prefix
//	    (/v1/sandboxes/{id}/ports/{port}) are set; Host is 127.0.0.1:{port}.
//	GET /v1/sandboxes/{id}/ports/{port}/tcp  with
//	    "Connection: Upgrade" and "Upgrade: shoal-tcp"
//	    → 101 Switching Protocols, then the connection carries the raw
//	    bytes of a TCP connection to the port (what `shoal port-forward`
//	    uses). Half-closes pass through both ways.
//
// Errors are JSON {code, message}: unknown sandbox 404, bad port 400,
// nothing listening on the port 502. A proxied request or an open tunnel
// keeps the sandbox from idling out for as long as it lasts.

// TCPUpgrade is the Upgrade protocol token of the raw TCP tunnel.
const TCPUpgrade = "shoal-tcp"

type portProxy struct {
	s  *Server
	rp *httputil.ReverseProxy
}

func (s *Server) portRoutes(mux *http.ServeMux) {
	p := &portProxy{s: s}
	tr := &http.Transport{
		// The pool is keyed by the outgoing URL's host, which is
		// "<sandbox id>:<port>" (see rewrite): connections to different
		// sandboxes never mix.
		DialContext:           p.dial,
		MaxIdleConns:          1024, // each idle one holds an agent connection
		MaxIdleConnsPerHost:   8,
		IdleConnTimeout:       30 * time.Second,
		ExpectContinueTimeout: time.Second,
		// Pass the client's Accept-Encoding through; do not add gzip and
		// decompress behind its back.
		DisableCompression: true,
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite:      p.rewrite,
		Transport:    tr,
		ErrorHandler: p.proxyError,
	}
	s.sandboxRoute(mux, "/v1/sandboxes/{id}/ports/{port}/{path...}", p.serve) // authz.go
}

// portOf parses and checks the {port} path value.
func portOf(r *http.Request) (int, error) {
	s := r.PathValue("port")
	port, err := strconv.Atoi(s)
	if err != nil || port < 1 || port > 65535 {
		return 0, fmt.Errorf("port %q must be a number from 1 to 65535", s)
	}
	return port, nil
}

func (p *portProxy) serve(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	port, err := portOf(r)
	if err != nil {
		writeHTTPError(w, http.StatusBadRequest, connect.CodeInvalidArgument.String(), err.Error())
		return
	}
	a, err := p.s.node.Agent(id) // counts as activity
	if err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	held, err := p.s.holdStream(r.Context(), id, "a port connection")
	if err != nil {
		writeConnectError(w, err)
		return
	}
	defer held()
	release, err := p.s.node.Hold(id) // not idle while the request or tunnel lasts
	if err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	defer release()
	if r.PathValue("path") == "tcp" && headerHasToken(r.Header, "Upgrade", TCPUpgrade) {
		p.tunnel(w, r, a, id, port)
		return
	}
	p.rp.ServeHTTP(w, r)
}

// rewrite aims the request at the port in the sandbox.
func (p *portProxy) rewrite(pr *httputil.ProxyRequest) {
	in := pr.In
	id, portStr := in.PathValue("id"), in.PathValue("port")
	prefix := "/v1/sandboxes/" + id + "/ports/" + portStr
	out := pr.Out
	out.URL.Scheme = "http"
	out.URL.Host = id + ":" + portStr // the transport's pool key; see dial
	rest, ok := strings.CutPrefix(in.URL.EscapedPath(), prefix)
	if !ok { // the prefix itself was percent-encoded
		rest = "/" + url.PathEscape(in.PathValue("path"))
	}
	if rest == "" {
		rest = "/"
	}
	if p, err := url.PathUnescape(rest); err == nil {
		out.URL.Path, out.URL.RawPath = p, rest
	} else {
		out.URL.Path, out.URL.RawPath = "/"+in.PathValue("path"), ""
	}
	out.URL.RawQuery = in.URL.RawQuery
	out.Host = "127.0.0.1:" + portStr
	// The API key is Shoal's, never the app's: with the key in
	// X-API-Key, an Authorization header is the app's and passes (unless
	// it repeats the key); without, it was the key.
	if key := in.Header.Get("X-API-Key"); key == "" || out.Header.Get("Authorization") == "Bearer "+key {
		out.Header.Del("Authorization")
	}
	out.Header.Del("X-API-Key")
	pr.SetXForwarded()
	out.Header.Set("X-Forwarded-Prefix", prefix)
}

// dial connects to "<sandbox id>:<port>" through the sandbox's agent.
func (p *portProxy) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	id, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, err
	}
	a, err := p.s.node.Agent(id)
	if err != nil {
		return nil, err
	}
	return a.DialPort(ctx, port)
}

func (p *portProxy) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(err, context.Canceled) && r.Context().Err() != nil {
		return // the client went away
	}
	port, _ := portOf(r)
	status, msg := portError(r.PathValue("id"), port, err)
	if status == 0 {
		writeConnectError(w, toConnect(err))
		return
	}
	p.s.log.Debug("port proxy", "sandbox_id", r.PathValue("id"), "port", port, "err", err)
	writeHTTPError(w, status, connect.CodeUnavailable.String(), msg)
}

// portError explains a failure to reach a port: 502 with a message, or
// status 0 when err is about the sandbox itself (not found, not running),
// which keeps its own code.
func portError(id string, port int, err error) (int, string) {
	var ae *agent.Error
	if errors.As(err, &ae) && ae.Code == agent.CodeRefused {
		return http.StatusBadGateway, fmt.Sprintf("nothing is listening on port %d in sandbox %s (start a server on 127.0.0.1:%d or [::1]:%d inside it)", port, id, port, port)
	}
	if ae == nil {
		var ce *connect.Error
		if errors.As(toConnect(err), &ce) && (ce.Code() == connect.CodeNotFound || ce.Code() == connect.CodeFailedPrecondition) {
			return 0, ""
		}
	}
	return http.StatusBadGateway, fmt.Sprintf("port %d in sandbox %s: %v", port, id, err)
}

// tunnel serves the raw TCP upgrade: 101, then bytes both ways.
func (p *portProxy) tunnel(w http.ResponseWriter, r *http.Request, a *agent.Client, id string, port int) {
	if r.Method != http.MethodGet {
		writeHTTPError(w, http.StatusMethodNotAllowed, connect.CodeInvalidArgument.String(), "the "+TCPUpgrade+" upgrade needs GET")
		return
	}
	if r.ProtoMajor != 1 || !headerHasToken(r.Header, "Connection", "upgrade") {
		writeHTTPError(w, http.StatusBadRequest, connect.CodeInvalidArgument.String(), "the "+TCPUpgrade+" upgrade needs HTTP/1.1 with \"Connection: Upgrade\"")
		return
	}
	conn, err := a.DialPort(r.Context(), port)
	if err != nil {
		status, msg := portError(id, port, err)
		if status == 0 {
			writeConnectError(w, toConnect(err))
		} else {
			writeHTTPError(w, status, connect.CodeUnavailable.String(), msg)
		}
		return
	}
	defer conn.Close()
	client, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		writeHTTPError(w, http.StatusInternalServerError, connect.CodeInternal.String(), "cannot take over the connection: "+err.Error())
		return
	}
	defer client.Close()
	client.SetDeadline(time.Time{})
	brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + TCPUpgrade + "\r\n\r\n")
	if err := brw.Flush(); err != nil {
		return
	}
	// Bytes the client sent right after its request may already sit in
	// the server's read buffer.
	var src io.Reader = client
	if n := brw.Reader.Buffered(); n > 0 {
		src = io.MultiReader(io.LimitReader(brw.Reader, int64(n)), client)
	}
	spliceConns(client, src, conn)
}

// spliceConns copies client→upstream (reading from src, which starts with
// any bytes already buffered from client) and upstream→client until both
// directions end, passing each end of stream on as a half-close; if a
// direction breaks, both connections are closed.
func spliceConns(client net.Conn, src io.Reader, upstream net.Conn) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		copyHalf(upstream, src, client, upstream)
	}()
	copyHalf(client, upstream, client, upstream)
	<-done
}

type closeWriter interface{ CloseWrite() error }

func copyHalf(dst io.Writer, src io.Reader, a, b net.Conn) {
	if _, err := io.Copy(dst, src); err == nil {
		if cw, ok := dst.(closeWriter); ok && cw.CloseWrite() == nil {
			return
		}
	}
	a.Close()
	b.Close()
}

// headerHasToken reports whether a comma-separated header contains token
// (case-insensitive).
func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}
