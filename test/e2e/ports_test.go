package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha1"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// startInSandbox starts a long-running command in a sandbox (shoal exec -d).
func startInSandbox(t *testing.T, id string, args ...string) {
	t.Helper()
	out, code := run(nil, append([]string{"exec", "-d", id, "--"}, args...)...)
	if code != 0 {
		t.Fatalf("exec -d %q: %s", args, out)
	}
}

// waitHTTP polls url through the proxy until something answers there (not
// a 502 from the proxy) and returns that response's status.
func waitHTTP(t *testing.T, hc *http.Client, url string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		res, err := hc.Get(url)
		if err == nil {
			io.Copy(io.Discard, res.Body)
			res.Body.Close()
			if res.StatusCode != http.StatusBadGateway {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing answers at %s: %v", url, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func get(t *testing.T, hc *http.Client, url string) (int, string, http.Header) {
	t.Helper()
	res, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b), res.Header
}

// errorBody checks a JSON {code, message} error reply.
func errorBody(t *testing.T, body string) (string, string) {
	t.Helper()
	var e struct{ Code, Message string }
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Code == "" || e.Message == "" {
		t.Fatalf("error body %q is not JSON {code, message}", body)
	}
	return e.Code, e.Message
}

// busybox httpd in a sandbox, reached through the API's proxy.
func TestPortProxyBusyboxHTTPD(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	page := "<h1>hello from the sandbox</h1>\n"
	if _, err := c.WriteFile(ctx, id, "/www/index.html", 0o644, strings.NewReader(page)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile(ctx, id, "/www/sub/file.txt", 0o644, strings.NewReader("sub file")); err != nil {
		t.Fatal(err)
	}
	startInSandbox(t, id, "httpd", "-f", "-p", "8080", "-h", "/www")
	hc := c.HTTPClient()
	base := c.PortURL(id, 8080)
	waitHTTP(t, hc, base)

	if code, body, _ := get(t, hc, base); code != 200 || body != page {
		t.Fatalf("GET /: %d %q", code, body)
	}
	if code, body, _ := get(t, hc, base+"sub/file.txt"); code != 200 || body != "sub file" {
		t.Fatalf("GET /sub/file.txt: %d %q", code, body)
	}
	if code, _, _ := get(t, hc, base+"missing"); code != 404 {
		t.Fatalf("GET /missing: %d, want httpd's 404", code)
	}
	// Without the trailing slash: redirected to it, so relative links work.
	if code, body, _ := get(t, hc, strings.TrimSuffix(base, "/")); code != 200 || body != page {
		t.Fatalf("GET without the trailing slash: %d %q", code, body)
	}
	// The proxy needs the API key like every call.
	code, body, _ := get(t, http.DefaultClient, base)
	if code != http.StatusUnauthorized {
		t.Fatalf("GET without a key: %d %s", code, body)
	}
	if c, _ := errorBody(t, body); c != "unauthenticated" {
		t.Fatalf("GET without a key: code %q", c)
	}
	// Nothing listening on another port: 502 naming the port.
	code, body, _ = get(t, hc, c.PortURL(id, 8081)+"x")
	if code != http.StatusBadGateway {
		t.Fatalf("GET to a closed port: %d %s", code, body)
	}
	if _, msg := errorBody(t, body); !strings.Contains(msg, "nothing is listening on port 8081") {
		t.Fatalf("502 message does not say which port: %q", msg)
	}
}

// A Go server in the sandbox: headers, query, escaped paths, POST bodies,
// a WebSocket, and the proxy's errors.
func TestPortProxyHTTPServer(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	startInSandbox(t, id, "portsrv", "http", "127.0.0.1:9090")
	hc := c.HTTPClient()
	base := c.PortURL(id, 9090)
	waitHTTP(t, hc, base+"info")

	t.Run("request", func(t *testing.T) {
		req, _ := http.NewRequest("GET", base+"info/a%2Fb?x=1&y=%2F", nil)
		req.Header.Set("X-API-Key", apiKey)
		req.Header.Set("X-Custom", "kept")
		req.Header.Set("X-Forwarded-For", "6.6.6.6") // spoofed: replaced
		res, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		var info struct {
			Method, Host, URI, Path, Query string
			Headers                        http.Header
			HasAuth                        bool `json:"has_auth"`
		}
		if err := json.NewDecoder(res.Body).Decode(&info); err != nil {
			t.Fatal(err)
		}
		u, _ := url.Parse(apiURL)
		prefix := "/v1/sandboxes/" + id + "/ports/9090"
		switch {
		case info.HasAuth:
			t.Error("the API key reached the sandbox")
		case info.Host != "127.0.0.1:9090":
			t.Errorf("Host %q", info.Host)
		case info.URI != "/info/a%2Fb?x=1&y=%2F":
			t.Errorf("request URI %q", info.URI)
		case info.Headers.Get("X-Custom") != "kept":
			t.Errorf("X-Custom not passed: %v", info.Headers)
		case info.Headers.Get("X-Forwarded-Host") != u.Host:
			t.Errorf("X-Forwarded-Host %q, want %q", info.Headers.Get("X-Forwarded-Host"), u.Host)
		case info.Headers.Get("X-Forwarded-Proto") != "http":
			t.Errorf("X-Forwarded-Proto %q", info.Headers.Get("X-Forwarded-Proto"))
		case info.Headers.Get("X-Forwarded-For") != "127.0.0.1":
			t.Errorf("X-Forwarded-For %q", info.Headers.Get("X-Forwarded-For"))
		case info.Headers.Get("X-Forwarded-Prefix") != prefix:
			t.Errorf("X-Forwarded-Prefix %q", info.Headers.Get("X-Forwarded-Prefix"))
		}
	})

	// The app's own Authorization: the key in X-API-Key (as the SDK's
	// client sends it), Authorization passes to the app, unless it is
	// the key again; the key in Authorization is consumed.
	t.Run("authorization", func(t *testing.T) {
		headers := func(c *http.Client, set map[string]string) http.Header {
			t.Helper()
			req, _ := http.NewRequest("GET", base+"info", nil)
			for k, v := range set {
				req.Header.Set(k, v)
			}
			res, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Body.Close()
			var info struct{ Headers http.Header }
			if res.StatusCode != 200 || json.NewDecoder(res.Body).Decode(&info) != nil {
				t.Fatalf("GET info with %v: %d", set, res.StatusCode)
			}
			return info.Headers
		}
		if h := headers(hc, map[string]string{"Authorization": "Bearer app-token"}); h.Get("Authorization") != "Bearer app-token" || h.Get("X-Api-Key") != "" {
			t.Errorf("through the SDK's client, the app got Authorization %q, X-API-Key %q", h.Get("Authorization"), h.Get("X-Api-Key"))
		}
		if h := headers(hc, map[string]string{"Authorization": "Bearer " + apiKey}); h.Get("Authorization") != "" {
			t.Error("the API key repeated in Authorization reached the app")
		}
		plain := &http.Client{}
		if h := headers(plain, map[string]string{"Authorization": "Bearer " + apiKey}); h.Get("Authorization") != "" {
			t.Error("the API key in Authorization reached the app")
		}
		if h := headers(plain, map[string]string{"X-API-Key": apiKey, "Authorization": "Basic dXNlcjpwdw=="}); h.Get("Authorization") != "Basic dXNlcjpwdw==" {
			t.Errorf("the app got Authorization %q", h.Get("Authorization"))
		}
	})

	t.Run("post", func(t *testing.T) {
		body := make([]byte, 5<<20)
		rand.Read(body)
		for _, method := range []string{"POST"} {
			req, _ := http.NewRequest(method, base+"echo", bytes.NewReader(body))
			res, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(res.Body)
			res.Body.Close()
			if err != nil || res.StatusCode != 200 || !bytes.Equal(got, body) {
				t.Fatalf("%s /echo: status %d, %d bytes back of %d, %v", method, res.StatusCode, len(got), len(body), err)
			}
		}
		// Many requests: pooled connections through the agent.
		for i := range 50 {
			res, err := hc.Post(base+"echo", "text/plain", strings.NewReader("n"+strconv.Itoa(i)))
			if err != nil {
				t.Fatal(err)
			}
			got, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if string(got) != "n"+strconv.Itoa(i) {
				t.Fatalf("request %d: %q", i, got)
			}
		}
	})

	t.Run("websocket", func(t *testing.T) {
		conn, br := wsDial(t, base+"ws")
		defer conn.Close()
		for _, msg := range []string{"hi", strings.Repeat("big", 30000)} {
			if err := wsWrite(conn, 1, []byte(msg)); err != nil {
				t.Fatal(err)
			}
			op, got, err := wsRead(br)
			if err != nil || op != 1 || string(got) != "echo: "+msg {
				t.Fatalf("websocket echo of %d bytes: op %d, %d bytes, %v", len(msg), op, len(got), err)
			}
		}
		wsWrite(conn, 8, nil)
		if op, _, err := wsRead(br); err != nil || op != 8 {
			t.Fatalf("close: op %d %v", op, err)
		}
	})

	t.Run("errors", func(t *testing.T) {
		for _, tc := range []struct {
			url  string
			code int
		}{
			{c.PortURL(id, 9999) + "info", http.StatusBadGateway},
			{apiURL + "/v1/sandboxes/" + id + "/ports/0/", http.StatusBadRequest},
			{apiURL + "/v1/sandboxes/" + id + "/ports/65536/", http.StatusBadRequest},
			{apiURL + "/v1/sandboxes/" + id + "/ports/http/", http.StatusBadRequest},
			{c.PortURL("aaaaaaaaaaaaaaaaaaaa", 9090) + "info", http.StatusNotFound},
		} {
			code, body, _ := get(t, hc, tc.url)
			if code != tc.code {
				t.Errorf("GET %s: %d %s, want %d", tc.url, code, body, tc.code)
				continue
			}
			errorBody(t, body)
		}
	})
}

// wsDial does a WebSocket handshake through the proxy.
func wsDial(t *testing.T, rawURL string) (net.Conn, *bufio.Reader) {
	t.Helper()
	u, _ := url.Parse(rawURL)
	conn, err := net.Dial("tcp", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	key := base64.StdEncoding.EncodeToString([]byte("0123456789abcdef"))
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"+
		"Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer %s\r\n\r\n", u.RequestURI(), u.Host, key, apiKey)
	br := bufio.NewReader(conn)
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := sha1.Sum([]byte(key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"))
	if res.StatusCode != http.StatusSwitchingProtocols || res.Header.Get("Sec-WebSocket-Accept") != base64.StdEncoding.EncodeToString(h[:]) {
		b, _ := io.ReadAll(res.Body)
		t.Fatalf("websocket handshake: %s %v %s", res.Status, res.Header, b)
	}
	return conn, br
}

// wsWrite writes one masked frame (as a client must).
func wsWrite(w io.Writer, op byte, payload []byte) error {
	b := []byte{0x80 | op}
	switch n := len(payload); {
	case n < 126:
		b = append(b, 0x80|byte(n))
	case n < 1<<16:
		b = append(b, 0x80|126, byte(n>>8), byte(n))
	default:
		b = append(b, 0x80|127)
		b = binary.BigEndian.AppendUint64(b, uint64(n))
	}
	key := [4]byte{1, 2, 3, 4}
	b = append(b, key[:]...)
	for i, c := range payload {
		b = append(b, c^key[i%4])
	}
	_, err := w.Write(b)
	return err
}

// wsRead reads one unmasked frame (as a server sends).
func wsRead(r *bufio.Reader) (byte, []byte, error) {
	var hdr [2]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := uint64(hdr[1] & 0x7f)
	switch n {
	case 126:
		var b [2]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return 0, nil, err
		}
		n = uint64(binary.BigEndian.Uint16(b[:]))
	case 127:
		var b [8]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return 0, nil, err
		}
		n = binary.BigEndian.Uint64(b[:])
	}
	p := make([]byte, n)
	_, err := io.ReadFull(r, p)
	return hdr[0] & 0x0f, p, err
}

// halfCloseRoundTrip writes msg, half-closes, and reads the answer of
// `portsrv tcp` ("N:" + msg reversed).
func halfCloseRoundTrip(t *testing.T, conn net.Conn, msg string) {
	t.Helper()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, msg); err != nil {
		t.Fatal(err)
	}
	if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	rev := []byte(msg)
	for i, j := 0, len(rev)-1; i < j; i, j = i+1, j-1 {
		rev[i], rev[j] = rev[j], rev[i]
	}
	if want := strconv.Itoa(len(msg)) + ":" + string(rev); string(got) != want {
		t.Fatalf("got %d bytes %.40q…, want %d bytes", len(got), got, len(want))
	}
}

// The raw TCP tunnel through the SDK, and `shoal port-forward` end to end.
func TestPortForward(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	startInSandbox(t, id, "portsrv", "tcp", "127.0.0.1:7070")
	startInSandbox(t, id, "portsrv", "http", "[::1]:9091") // IPv6 loopback only
	waitHTTP(t, c.HTTPClient(), c.PortURL(id, 9091)+"info")

	// SDK: a tunnel with half-close.
	var conn net.Conn
	var err error
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if conn, err = c.DialPort(ctx, id, 7070); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	halfCloseRoundTrip(t, conn, "hello through the tunnel")
	conn.Close()
	// Nothing listening: a clear error, before any byte.
	if _, err := c.DialPort(ctx, id, 7071); connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "port 7071") {
		t.Fatalf("DialPort to a closed port: %v", err)
	}
	if _, err := c.DialPort(ctx, "aaaaaaaaaaaaaaaaaaaa", 7070); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("DialPort to an unknown sandbox: %v", err)
	}
	bad, _ := shoal.New(shoal.Options{URL: apiURL, APIKey: "sk_wrong_key_0123456789"})
	if _, err := bad.DialPort(ctx, id, 7070); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("DialPort with a wrong key: %v", err)
	}

	// CLI: two mappings on free local ports.
	cmd := exec.Command(filepath.Join(binDir, "shoal"), "port-forward", id, ":7070", ":9091")
	cmd.Env = append(cmd.Environ(), "SHOAL_URL="+apiURL, "SHOAL_API_KEY="+apiKey)
	stdout, _ := cmd.StdoutPipe()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	sc := bufio.NewScanner(stdout)
	local := map[string]string{} // remote port → local address
	for len(local) < 2 && sc.Scan() {
		// Forwarding 127.0.0.1:NNNN -> ID:7070
		f := strings.Fields(sc.Text())
		if len(f) == 4 && f[0] == "Forwarding" {
			local[f[3][strings.LastIndex(f[3], ":")+1:]] = f[1]
		}
	}
	if len(local) < 2 {
		t.Fatalf("port-forward printed no addresses; stderr: %s", stderr.String())
	}
	// Several connections at once, each half-closed.
	errc := make(chan error, 8)
	for i := range 8 {
		go func() {
			conn, err := net.Dial("tcp", local["7070"])
			if err != nil {
				errc <- err
				return
			}
			defer conn.Close()
			msg := strings.Repeat(strconv.Itoa(i), 100000)
			conn.SetDeadline(time.Now().Add(20 * time.Second))
			io.WriteString(conn, msg)
			conn.(*net.TCPConn).CloseWrite()
			got, err := io.ReadAll(conn)
			if err != nil {
				errc <- err
				return
			}
			if !strings.HasPrefix(string(got), strconv.Itoa(len(msg))+":") || len(got) != len(msg)+len(strconv.Itoa(len(msg)))+1 {
				errc <- fmt.Errorf("connection %d: got %d bytes", i, len(got))
				return
			}
			errc <- nil
		}()
	}
	for range 8 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	// HTTP over the second mapping, to a server on [::1] only.
	code, body, _ := get(t, http.DefaultClient, "http://"+local["9091"]+"/info")
	if code != 200 || !strings.Contains(body, `"path":"/info"`) {
		t.Fatalf("HTTP through port-forward: %d %s", code, body)
	}
	// A connection to a port nothing listens on is closed, with a message.
	cmd2 := exec.Command(filepath.Join(binDir, "shoal"), "port-forward", id, ":7072")
	cmd2.Env = cmd.Env
	stdout2, _ := cmd2.StdoutPipe()
	var stderr2 bytes.Buffer
	cmd2.Stderr = &stderr2
	if err := cmd2.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd2.Process.Kill()
	sc2 := bufio.NewScanner(stdout2)
	if !sc2.Scan() {
		t.Fatal("no Forwarding line")
	}
	addr2 := strings.Fields(sc2.Text())[1]
	conn2, err := net.Dial("tcp", addr2)
	if err != nil {
		t.Fatal(err)
	}
	conn2.SetDeadline(time.Now().Add(10 * time.Second))
	if b, err := io.ReadAll(conn2); len(b) != 0 || err != nil {
		t.Fatalf("connection to a closed remote port: %q %v", b, err)
	}
	conn2.Close()
	cmd2.Process.Signal(syscall.SIGINT)
	cmd2.Wait()
	if !strings.Contains(stderr2.String(), "nothing is listening on port 7072") {
		t.Fatalf("port-forward stderr: %q", stderr2.String())
	}
	// Ctrl-C ends it cleanly.
	cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("port-forward after SIGINT: %v; stderr %s", err, stderr.String())
	}
	// A bad mapping is refused with the expected forms.
	if out, code := run(nil, "port-forward", id, "70000"); code == 0 || !strings.Contains(out, "LOCAL:REMOTE") {
		t.Fatalf("bad mapping: %d %s", code, out)
	}
}
