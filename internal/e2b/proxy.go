package e2b

// HTTP (and WebSocket) to a TCP port inside a sandbox: what the SDK's
// getHost(port) addresses. Each connection is spliced through the guest
// agent (agent.Client.DialPort), so it reaches the sandbox's own loopback
// although the sandbox has no network.

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/node"
)

// trafficTokenHeader opens a private sandbox's ports (E2B's header).
const trafficTokenHeader = "E2b-Traffic-Access-Token"

type portProxy struct {
	s         *Server
	transport *http.Transport
}

func newPortProxy(s *Server) *portProxy {
	p := &portProxy{s: s}
	p.transport = &http.Transport{
		DialContext:         p.dial,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     30 * time.Second,
		// The agent's splice is plain TCP; TLS inside a sandbox port is the
		// sandbox's business (E2B's httpsPorts): not supported.
	}
	return p
}

// upstreamHost names a sandbox port for the transport's connection pool.
func upstreamHost(id string, port int) string {
	return id + "-" + strconv.Itoa(port) + ".sandbox"
}

func (p *portProxy) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	id, ps, ok := strings.Cut(strings.TrimSuffix(host, ".sandbox"), "-")
	port, err := strconv.Atoi(ps)
	if !ok || err != nil {
		return nil, fmt.Errorf("bad upstream %q", addr)
	}
	ag, err := p.s.node.Agent(id)
	if err != nil {
		return nil, err
	}
	return ag.DialPort(ctx, port)
}

// portsPublic reports whether sandbox id's ports are served without its
// traffic access token: only a sandbox made through E2B with public
// traffic allowed (E2B's default). One made through Shoal's own API is
// reached there with the API key, or here with its token (returned by
// E2B's connect).
func (s *Server) portsPublic(id string) bool {
	m, ok := s.store.sandbox(id)
	return ok && m.public()
}

func (p *portProxy) dropSandbox(string) { p.transport.CloseIdleConnections() }

func (p *portProxy) serve(w http.ResponseWriter, r *http.Request, rec node.Record, port int) {
	if !p.s.portsPublic(rec.ID) {
		tok := r.Header.Get(trafficTokenHeader)
		if subtle.ConstantTimeCompare([]byte(tok), []byte(p.s.trafficToken(rec.ID))) != 1 {
			writeError(w, http.StatusForbidden, "this sandbox's ports are private: send its traffic access token (trafficAccessToken of the sandbox, from create or connect) in the e2b-traffic-access-token header")
			return
		}
	}
	// Counted, public ports included (no key then): one client holding
	// connections open cannot take the node's descriptors.
	held, err := p.s.holdStream(r.Context(), rec.ID, "a connection to port "+strconv.Itoa(port))
	if err != nil {
		writeErr(w, err)
		return
	}
	defer held()
	// Not idle (auto-pause) while the request or tunnel lasts.
	if release, err := p.s.node.Hold(rec.ID); err == nil {
		defer release()
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = upstreamHost(rec.ID, port)
			pr.Out.Host = pr.In.Host // the server in the sandbox sees the client's Host
			pr.SetXForwarded()
			for _, h := range []string{"E2b-Sandbox-Id", "E2b-Sandbox-Port", trafficTokenHeader} {
				pr.Out.Header.Del(h)
			}
		},
		Transport:     p.transport,
		FlushInterval: -1, // server-sent events and other streams pass at once
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			var ae *agent.Error
			if errors.As(err, &ae) && ae.Code == agent.CodeRefused {
				writeJSON(w, http.StatusBadGateway, map[string]any{
					"code": http.StatusBadGateway, "sandboxId": rec.ID, "port": port,
					"message": fmt.Sprintf("The sandbox is running but port %d is not open: nothing listens on it inside the sandbox", port),
				})
				return
			}
			if r.Context().Err() != nil {
				return // the client went away
			}
			p.s.log.Debug("e2b: port proxy", "sandbox_id", rec.ID, "port", port, "err", err)
			writeError(w, http.StatusBadGateway, fmt.Sprintf("sandbox %s port %d: %v", rec.ID, port, err))
		},
	}
	rp.ServeHTTP(w, r)
}
