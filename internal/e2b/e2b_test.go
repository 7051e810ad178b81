package e2b

// Unit tests of the parts that need no sandbox. The E2B SDK itself drives
// the whole face against a real `shoal serve` in test/e2b.

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	fsp "github.com/shoal-sandbox/shoal/api/e2b/filesystem"
	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/node"
)

func TestParseSandboxHost(t *testing.T) {
	for _, tc := range []struct {
		host string
		port int
		id   string
		ok   bool
	}{
		{"49983-abcdefghijklmnopqrst.shoal.localhost:7481", 49983, "abcdefghijklmnopqrst", true},
		{"3000-abcdefghijklmnopqrst.e2b.example.com", 3000, "abcdefghijklmnopqrst", true},
		{"3000-ABCDEFGHIJKLMNOPQRST.example.com", 3000, "abcdefghijklmnopqrst", true},
		{"127.0.0.1:7481", 0, "", false},
		{"localhost:7481", 0, "", false},
		{"api.e2b.dev", 0, "", false},
		{"x-abc.example.com", 0, "", false},
		{"70000-abc.example.com", 0, "", false},
		{"3000-.example.com", 0, "", false},
		{"[::1]:7481", 0, "", false},
	} {
		port, id, ok := parseSandboxHost(tc.host)
		if port != tc.port || id != tc.id || ok != tc.ok {
			t.Errorf("parseSandboxHost(%q) = %d, %q, %v; want %d, %q, %v", tc.host, port, id, ok, tc.port, tc.id, tc.ok)
		}
	}
}

func TestResolvePath(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"/a/b", "/a/b"},
		{"/a/../b/", "/b"},
		{"a.txt", "/root/a.txt"},
		{"./x/../y", "/root/y"},
		{"~", "/root"},
		{"~/f", "/root/f"},
		{"../../etc", "/etc"},
	} {
		got, err := resolvePath(tc.in, "/root")
		if err != nil || got != tc.want {
			t.Errorf("resolvePath(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "a\x00b"} {
		if _, err := resolvePath(bad, "/root"); err == nil {
			t.Errorf("resolvePath(%q): no error", bad)
		}
	}
}

func TestListFilter(t *testing.T) {
	// What the SDK sends for {query: {metadata: {"user id": "a&b", app: "x=y"}, state: ['paused']}}:
	// each key and value encoded, then the pairs as a query string, then
	// that string as one parameter.
	inner := url.Values{}
	inner.Set(url.QueryEscape("user id"), url.QueryEscape("a&b"))
	inner.Set("app", url.QueryEscape("x=y"))
	q := url.Values{"metadata": {inner.Encode()}, "state": {"paused,running"}, "startedAfter": {"2026-01-02T03:04:05Z"}}
	f, err := parseListFilter(q)
	if err != nil {
		t.Fatal(err)
	}
	if f.metadata["user id"] != "a&b" || f.metadata["app"] != "x=y" || len(f.metadata) != 2 {
		t.Errorf("metadata = %v", f.metadata)
	}
	if !f.states["paused"] || !f.states["running"] {
		t.Errorf("states = %v", f.states)
	}
	l := listedSandbox{State: "running", Metadata: map[string]string{"user id": "a&b", "app": "x=y", "more": "1"}}
	if !f.match(l, time.Date(2026, 2, 1, 0, 0, 0, 0, time.UTC)) {
		t.Error("no match")
	}
	if f.match(l, time.Date(2025, 2, 1, 0, 0, 0, 0, time.UTC)) {
		t.Error("matched a sandbox started before startedAfter")
	}
	l.Metadata["app"] = "other"
	if f.match(l, time.Date(2026, 2, 1, 0, 0, 0, 0, time.UTC)) {
		t.Error("matched other metadata")
	}
	if _, err := parseListFilter(url.Values{"state": {"frozen"}}); err == nil {
		t.Error("state frozen accepted")
	}
	if f, _ := parseListFilter(url.Values{}); !f.states["running"] || !f.states["paused"] {
		t.Errorf("default states = %v", f.states)
	}
}

func TestPageToken(t *testing.T) {
	rec := node.Record{ID: "abcdefghijklmnopqrst", Created: time.Unix(1700000000, 123456789)}
	ns, id, err := parsePageToken(pageToken(rec))
	if err != nil || ns != rec.Created.UnixNano() || id != rec.ID {
		t.Errorf("round trip = %d, %q, %v", ns, id, err)
	}
	if _, _, err := parsePageToken("!!"); err == nil {
		t.Error("garbage accepted")
	}
}

func TestEndEvent(t *testing.T) {
	for _, tc := range []struct {
		ex     *agent.ExitStatus
		code   int32
		exited bool
		status string
		err    string
	}{
		{&agent.ExitStatus{Code: 0}, 0, true, "exit status 0", ""},
		{&agent.ExitStatus{Code: 3}, 3, true, "exit status 3", "exit status 3"},
		{&agent.ExitStatus{Code: 137, Signal: "SIGKILL"}, -1, false, "signal: killed", "signal: killed"},
		{&agent.ExitStatus{Code: 143, Signal: "SIGTERM"}, -1, false, "signal: terminated", "signal: terminated"},
		{&agent.ExitStatus{Code: 137, Signal: "SIGKILL", TimedOut: true}, -1, false, "signal: killed", "signal: killed (its timeout expired)"},
	} {
		e := endEvent(tc.ex)
		if e.ExitCode != tc.code || e.Exited != tc.exited || e.Status != tc.status || e.GetError() != tc.err {
			t.Errorf("endEvent(%+v) = %d %v %q %q", *tc.ex, e.ExitCode, e.Exited, e.Status, e.GetError())
		}
	}
}

func TestSignedURL(t *testing.T) {
	s := &Server{secret: []byte("0123456789abcdef0123456789abcdef")}
	id := "abcdefghijklmnopqrst"
	sign := func(path, op, user string, exp int64) string {
		raw := path + ":" + op + ":" + user + ":" + s.envdToken(id)
		if exp != 0 {
			raw += fmt.Sprintf(":%d", exp)
		}
		sum := sha256.Sum256([]byte(raw))
		return "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
	}
	req := func(method, query string) *http.Request {
		return httptest.NewRequest(method, "/files?"+query, nil)
	}
	ok := req("GET", "path=/a.txt&signature="+url.QueryEscape(sign("/a.txt", "read", "", 0)))
	if err := s.validSignature(ok, id); err != nil {
		t.Errorf("valid read signature refused: %v", err)
	}
	if err := s.validSignature(req("POST", ok.URL.RawQuery), id); err == nil {
		t.Error("a read signature allowed a write")
	}
	if err := s.validSignature(ok, "bcdefghijklmnopqrsta"); err == nil {
		t.Error("a signature for another sandbox accepted")
	}
	future := time.Now().Add(time.Hour).Unix()
	w := req("POST", fmt.Sprintf("path=/b&username=root&signature_expiration=%d&signature=%s", future, url.QueryEscape(sign("/b", "write", "root", future))))
	if err := s.validSignature(w, id); err != nil {
		t.Errorf("valid write signature refused: %v", err)
	}
	past := time.Now().Add(-time.Hour).Unix()
	old := req("GET", fmt.Sprintf("path=/a.txt&signature_expiration=%d&signature=%s", past, url.QueryEscape(sign("/a.txt", "read", "", past))))
	if err := s.validSignature(old, id); err == nil {
		t.Error("an expired signature accepted")
	}
}

func TestTokens(t *testing.T) {
	s := &Server{secret: []byte("0123456789abcdef0123456789abcdef")}
	a, b := s.envdToken("aaaaaaaaaaaaaaaaaaaa"), s.envdToken("bbbbbbbbbbbbbbbbbbbb")
	if a == b || a == s.trafficToken("aaaaaaaaaaaaaaaaaaaa") || len(a) != 40 {
		t.Errorf("tokens %q %q", a, b)
	}
	if a != s.envdToken("aaaaaaaaaaaaaaaaaaaa") {
		t.Error("token not stable")
	}
}

func TestWantsGzip(t *testing.T) {
	for h, want := range map[string]bool{
		"gzip": true, "GZIP": true, "gzip;q=0.5": true, "gzip;q=0": false,
		"gzip, deflate": false, "br, gzip, deflate": false, "identity": false, "": false,
	} {
		if got := wantsGzip(h); got != want {
			t.Errorf("wantsGzip(%q) = %v", h, got)
		}
	}
}

// TestServeTLSAndPlain serves HTTP and HTTPS on one listener, with a
// certificate for the domain's wildcard signed by the generated CA.
func TestServeTLSAndPlain(t *testing.T) {
	dir := t.TempDir()
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln, err := Serve(raw, dir, "shoal.localhost:7481")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s tls=%v", r.Host, r.TLS != nil)
	})}
	go srv.Serve(ln)
	defer srv.Close()
	addr := raw.Addr().String()

	res, err := http.Get("http://" + addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if string(b) != addr+" tls=false" {
		t.Errorf("plain: %q", b)
	}

	pool := x509.NewCertPool()
	ca, err := os.ReadFile(filepath.Join(dir, CAFile))
	if err != nil {
		t.Fatal(err)
	}
	pool.AppendCertsFromPEM(ca)
	for _, name := range []string{"49983-abcdefghijklmnopqrst.shoal.localhost", "localhost"} {
		client := &http.Client{Transport: &http.Transport{
			TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: name},
			DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, network, addr)
			},
		}}
		res, err := client.Get("https://" + name + ":7481/")
		if err != nil {
			t.Fatalf("https %s: %v", name, err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if string(b) != name+":7481 tls=true" {
			t.Errorf("https %s: %q", name, b)
		}
	}

	// A second start reuses the CA and the certificate.
	before, _ := os.ReadFile(filepath.Join(dir, "e2b/tls/server.pem"))
	raw2, _ := net.Listen("tcp", "127.0.0.1:0")
	ln2, err := Serve(raw2, dir, "shoal.localhost:7481")
	if err != nil {
		t.Fatal(err)
	}
	ln2.Close()
	after, _ := os.ReadFile(filepath.Join(dir, "e2b/tls/server.pem"))
	if string(before) != string(after) {
		t.Error("the certificate was regenerated for the same hosts")
	}
	// Another domain gets a new certificate from the same CA.
	raw3, _ := net.Listen("tcp", "127.0.0.1:0")
	ln3, err := Serve(raw3, dir, "e2b.example.com")
	if err != nil {
		t.Fatal(err)
	}
	ln3.Close()
	ca2, _ := os.ReadFile(filepath.Join(dir, CAFile))
	if string(ca) != string(ca2) {
		t.Error("the CA changed")
	}
	c, err := tls.LoadX509KeyPair(filepath.Join(dir, "e2b/tls/server.pem"), filepath.Join(dir, "e2b/tls/server.key"))
	if err != nil || c.Leaf.VerifyHostname("3000-abcdefghijklmnopqrst.e2b.example.com") != nil {
		t.Errorf("new certificate: %v", err)
	}
}

// A sandbox killed under a process stream is what E2B's edge answers for a
// sandbox that is gone: unavailable.
func TestCodeOfSandboxKilled(t *testing.T) {
	if c := codeOf(errdefs.New(errdefs.ErrSandboxKilled, "sandbox x was killed")); c != connect.CodeUnavailable {
		t.Fatalf("codeOf(killed) = %v, want unavailable", c)
	}
}

// Ports are public only for a sandbox made through E2B without
// allowPublicTraffic = false; entries written before the Public field keep
// what they meant, and an entry an E2B call wrote later for a sandbox made
// through Shoal's API (no template) stays private.
func TestPortsPublic(t *testing.T) {
	yes, no := true, false
	for _, c := range []struct {
		m    sandboxMeta
		want bool
	}{
		{sandboxMeta{Template: "base", Public: &yes}, true},
		{sandboxMeta{Template: "base", Public: &no}, false},
		{sandboxMeta{Template: "base"}, true},                 // legacy E2B entry, public
		{sandboxMeta{Template: "base", Private: true}, false}, // legacy, allowPublicTraffic false
		{sandboxMeta{Deadline: time.Now()}, false},            // Shoal-made, touched by E2B's setTimeout
		{sandboxMeta{Paused: true}, false},
	} {
		if got := c.m.public(); got != c.want {
			t.Errorf("%+v: public() = %v, want %v", c.m, got, c.want)
		}
	}
	// No entry at all: a sandbox made through Shoal's API.
	st := &store{sandboxes: map[string]sandboxMeta{}}
	s := &Server{store: st}
	if s.portsPublic("aaaaaaaaaaaaaaaaaaaa") {
		t.Error("a sandbox with no E2B entry has public ports")
	}
	st.sandboxes["aaaaaaaaaaaaaaaaaaaa"] = sandboxMeta{Template: "t", Public: &yes}
	if !s.portsPublic("aaaaaaaaaaaaaaaaaaaa") {
		t.Error("a public E2B sandbox's ports are private")
	}
}

// FuzzResolvePath: a path envd's API accepts resolves to a clean absolute
// path within the length bound, whatever "~", ".." or relative parts it has.
func FuzzResolvePath(f *testing.F) {
	for _, s := range []string{"~", "~/a", "a/../../..", "/a/b/../c", "", "\x00", "~/../../etc"} {
		f.Add(s, "/root")
	}
	f.Fuzz(func(t *testing.T, p, home string) {
		if !strings.HasPrefix(home, "/") {
			home = "/" + home
		}
		got, err := resolvePath(p, home)
		if err != nil {
			return
		}
		if !strings.HasPrefix(got, "/") || path.Clean(got) != got || strings.IndexByte(got, 0) >= 0 || len(got) > limits.PathBytes {
			t.Fatalf("resolvePath(%q, %q) = %q", p, home, got)
		}
	})
}

// TestGunzipBound: a gzip bomb is refused once it expands past the floor
// at more than gzipRatio:1, with ErrTooLarge (413); ordinary compressed
// data, and highly compressible data below the floor, pass.
func TestGunzipBound(t *testing.T) {
	defer func(f int64) { gzipFloor = f }(gzipFloor)
	gzipFloor = 1 << 20 // small, for the race detector's sake
	compress := func(b []byte) []byte {
		var out bytes.Buffer
		gz, _ := gzip.NewWriterLevel(&out, gzip.BestSpeed)
		gz.Write(b)
		gz.Close()
		return out.Bytes()
	}
	read := func(body []byte) (int64, error) {
		g, err := newGunzip(bytes.NewReader(body))
		if err != nil {
			return 0, err
		}
		defer g.Close()
		return io.Copy(io.Discard, g)
	}
	// 1 GiB of zeros: 1024 gzip members of 1 MiB each (~1 KiB apiece).
	bomb := bytes.Repeat(compress(make([]byte, 1<<20)), 1024)
	n, err := read(bomb)
	if !errors.Is(err, limits.ErrTooLarge) || !strings.Contains(err.Error(), "gzip bomb") {
		t.Fatalf("1 GiB of zeros from %d bytes: read %d, err %v", len(bomb), n, err)
	}
	if n > 4*gzipFloor {
		t.Fatalf("the bomb was read to %d bytes before it was refused", n)
	}
	if n, err := read(compress(make([]byte, gzipFloor))); err != nil || n != gzipFloor {
		t.Fatalf("zeros up to the floor: %d %v", n, err)
	}
	// Past the floor, data that does not compress that much passes.
	big := make([]byte, 3*gzipFloor)
	rand.Read(big)
	if n, err := read(compress(big)); err != nil || n != int64(len(big)) {
		t.Fatalf("random data past the floor: %d %v", n, err)
	}
}

// A symlink's entry is envd's: its target's type and permission bits, its
// resolved target; from an agent that does not resolve links, the link.
func TestEntryInfoSymlink(t *testing.T) {
	link := fs.ModeSymlink | 0o777
	for _, c := range []struct {
		name string
		fi   agent.FileInfo
		typ  fsp.FileType
		mode uint32
		tgt  string
	}{
		{"to a file", agent.FileInfo{Mode: link, Symlink: "f", Target: "/d/f", TargetMode: 0o640, TargetOK: true}, fsp.FileType_FILE_TYPE_FILE, 0o640, "/d/f"},
		{"to a dir", agent.FileInfo{Mode: link, Symlink: "x", Target: "/d/x", TargetMode: fs.ModeDir | 0o755, TargetOK: true}, fsp.FileType_FILE_TYPE_DIRECTORY, 0o755, "/d/x"},
		{"nowhere", agent.FileInfo{Mode: link, Symlink: "n", Target: "/d/l"}, fsp.FileType_FILE_TYPE_UNSPECIFIED, 0, "/d/l"},
		{"older agent", agent.FileInfo{Mode: link, Symlink: "f"}, fsp.FileType_FILE_TYPE_SYMLINK, 0o777, "/d/f"},
	} {
		e := entryInfo("/d/l", c.fi)
		if e.Type != c.typ || e.Mode != c.mode || e.GetSymlinkTarget() != c.tgt || e.Permissions != "Lrwxrwxrwx" {
			t.Errorf("%s: type %v mode %o target %q permissions %s", c.name, e.Type, e.Mode, e.GetSymlinkTarget(), e.Permissions)
		}
	}
}

// An upload through the face lands as envd's does: create, chmod, write.
func TestFsEventsUpload(t *testing.T) {
	evs := fsEvents(context.Background(), nil, "/w", agent.WatchEvent{Op: agent.WatchRename, Path: "/w/a.txt", OldPath: "/w/.a.txt.shoal-tmp-123"}, false)
	var got []string
	for _, e := range evs {
		got = append(got, e.Type.String()+" "+e.Name)
	}
	if want := "EVENT_TYPE_CREATE a.txt,EVENT_TYPE_CHMOD a.txt,EVENT_TYPE_WRITE a.txt"; strings.Join(got, ",") != want {
		t.Fatalf("upload events %q, want %s", got, want)
	}
	if evs := fsEvents(context.Background(), nil, "/w", agent.WatchEvent{Op: agent.WatchSynced, Sync: 3}, false); len(evs) != 0 {
		t.Fatalf("a sync is no event: %v", evs)
	}
}

// Output pruned by a log budget is out of range: 416 on the REST faces.
func TestLogPrunedStatus(t *testing.T) {
	err := errdefs.New(errdefs.ErrLogPruned, "x: re-attach from offset 7")
	if c, st := codeOf(err), httpStatusOf(err); c != connect.CodeOutOfRange || st != http.StatusRequestedRangeNotSatisfiable {
		t.Fatalf("log pruned: %v %d, want out_of_range, 416", c, st)
	}
}

// A public port's proxied connections count against the sandbox's stream
// cap without a key: past it, 429 with the cap named, before anything
// reaches the sandbox.
func TestPortProxyStreamCap(t *testing.T) {
	const id = "aaaaaaaaaaaaaaaaaaaa"
	yes := true
	s := &Server{store: &store{sandboxes: map[string]sandboxMeta{id: {Template: "t", Public: &yes}}}, log: slog.New(slog.DiscardHandler)}
	streams, err := limits.NewStreams(1, 10, 0)
	if err != nil {
		t.Fatal(err)
	}
	s.SetStreams(streams)
	release, err := streams.Acquire(id, "", "a held connection")
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	w := httptest.NewRecorder()
	newPortProxy(s).serve(w, httptest.NewRequest(http.MethodGet, "http://8080-"+id+".e2b.local/", nil), node.Record{ID: id}, 8080)
	if w.Code != http.StatusTooManyRequests || !strings.Contains(w.Body.String(), "--max-streams-per-sandbox") {
		t.Fatalf("past the cap: %d %s, want 429 naming the cap", w.Code, w.Body.String())
	}
}
