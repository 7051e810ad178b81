package shoal

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// PortURL is the base URL of the API's HTTP proxy to a TCP port inside a
// sandbox, ending in "/": PortURL(id, 8080)+"api/x?y=1" reaches
// http://127.0.0.1:8080/api/x?y=1 in the sandbox. Requests to it need the
// API key like every API call (the Client's own HTTPClient adds it: see
// HTTPClient); the proxy removes the key before forwarding.
func (c *Client) PortURL(sandboxID string, port int) string {
	return c.url + "/v1/sandboxes/" + url.PathEscape(sandboxID) + "/ports/" + strconv.Itoa(port) + "/"
}

// HTTPClient returns the client's *http.Client, which sends the API key
// with every request: use it with PortURL. The key goes as X-API-Key, so
// an Authorization header a request sets reaches the app in the sandbox.
func (c *Client) HTTPClient() *http.Client { return c.hc }

// DialPort opens a TCP connection to port on a sandbox's loopback, tunnelled
// through the API (GET .../ports/{port}/tcp upgraded to "shoal-tcp"). The
// connection supports CloseWrite (a half-close passed on to the server in
// the sandbox) and deadlines. If nothing listens on the port the error is
// a *connect.Error with code Unavailable, saying so.
//
// It dials the API host itself (TCP, or TLS for an https URL) with a
// net.Dialer and ignores Options.HTTPClient and proxy settings. ctx bounds
// the dial and the handshake only.
func (c *Client) DialPort(ctx context.Context, sandboxID string, port int) (net.Conn, error) {
	u, err := url.Parse(c.PortURL(sandboxID, port) + "tcp")
	if err != nil {
		return nil, err
	}
	host := u.Host
	if u.Port() == "" {
		if u.Scheme == "https" {
			host = net.JoinHostPort(u.Hostname(), "443")
		} else {
			host = net.JoinHostPort(u.Hostname(), "80")
		}
	}
	d := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	var conn net.Conn
	if u.Scheme == "https" {
		conn, err = (&tls.Dialer{NetDialer: d, Config: &tls.Config{ServerName: u.Hostname()}}).DialContext(ctx, "tcp", host)
	} else {
		conn, err = d.DialContext(ctx, "tcp", host)
	}
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", host, err)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	fail := func(err error) (net.Conn, error) {
		stop()
		conn.Close()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	req, err := http.NewRequest(http.MethodGet, u.String(), nil)
	if err != nil {
		return fail(err)
	}
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "shoal-tcp")
	if c.key != "" {
		req.Header.Set("Authorization", "Bearer "+c.key)
	}
	if err := req.Write(conn); err != nil {
		return fail(fmt.Errorf("port %d in sandbox %s: send upgrade: %w", port, sandboxID, err))
	}
	br := bufio.NewReader(conn)
	res, err := http.ReadResponse(br, req)
	if err != nil {
		return fail(fmt.Errorf("port %d in sandbox %s: read upgrade reply: %w", port, sandboxID, err))
	}
	if res.StatusCode != http.StatusSwitchingProtocols {
		err := httpError(res)
		res.Body.Close()
		return fail(err)
	}
	if !stop() {
		conn.Close()
		return nil, ctx.Err()
	}
	conn.SetDeadline(time.Time{})
	return &tunnelConn{Conn: conn, r: br}, nil
}

// tunnelConn is the upgraded connection; reads drain what the handshake's
// reader buffered first.
type tunnelConn struct {
	net.Conn
	r *bufio.Reader
}

func (t *tunnelConn) Read(p []byte) (int, error) {
	if t.r != nil {
		if t.r.Buffered() > 0 {
			return t.r.Read(p)
		}
		t.r = nil
	}
	return t.Conn.Read(p)
}

// CloseWrite shuts down the writing half: the server in the sandbox reads
// end of stream, and can still answer.
func (t *tunnelConn) CloseWrite() error {
	if cw, ok := t.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.New("connection cannot half-close")
}
