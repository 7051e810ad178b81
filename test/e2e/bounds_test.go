package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// Every request, value and listing is bounded (issue 15, item 6): a body
// over the message bound is refused without being held in memory, values
// that would overflow or exceed the node's bounds are refused with a
// message naming the bound, and a listing too long for one reply is refused
// by the host whatever the sandbox's agent sends.

// serveRSS is shoal serve's resident set size in bytes.
func serveRSS(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", serveCmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

// hugeBody is a JSON CreateSandboxRequest of about n bytes, generated as it
// is sent (the test does not hold it either).
func hugeBody(n int64) io.Reader {
	head := `{"base":"` + baseRef + `","metadata":{"k":"`
	return io.MultiReader(strings.NewReader(head), io.LimitReader(repeatReader('x'), n), strings.NewReader(`"}}`))
}

type repeatReader byte

func (r repeatReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(r)
	}
	return len(p), nil
}

func TestOversizedBodyRefused(t *testing.T) {
	need(t)
	const size = 256 << 20
	// Declared (Content-Length: refused before reading) and chunked
	// (connect stops reading at the bound).
	for _, declared := range []bool{true, false} {
		before := serveRSS(t)
		for i := range 3 {
			req, err := http.NewRequest(http.MethodPost, apiURL+"/shoal.v1.SandboxService/CreateSandbox", hugeBody(size))
			if err != nil {
				t.Fatal(err)
			}
			if declared {
				req.ContentLength = int64(len(`{"base":"`+baseRef+`","metadata":{"k":"`)) + size + 3
			}
			req.Header.Set("Authorization", "Bearer "+apiKey)
			req.Header.Set("Content-Type", "application/json")
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				// The server may close the connection while the client
				// still sends (it stopped reading at the bound).
				t.Logf("declared %v, request %d: %v", declared, i, err)
				continue
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			wantError(t, "CreateSandbox of 256 MiB", res.StatusCode, string(b), http.StatusTooManyRequests, "resource_exhausted", "larger than")
		}
		after := serveRSS(t)
		t.Logf("declared length %v: serve RSS %d MiB -> %d MiB after 3 bodies of 256 MiB", declared, before>>20, after>>20)
		// Connect reads at most the bound (16 MiB, into a buffer of up
		// to 32 MiB that it pools); without a bound each body costs
		// several times its size.
		limit := int64(150 << 20)
		if declared {
			limit = 30 << 20 // nothing read at all
		}
		if grew := after - before; grew > limit {
			t.Errorf("serve RSS grew by %d MiB taking 3 oversized bodies", grew>>20)
		}
	}
	if res, err := http.Get(apiURL + "/healthz"); err != nil {
		t.Fatalf("healthz after oversized bodies: %v", err)
	} else {
		res.Body.Close()
	}
}

func TestRequestValuesBounded(t *testing.T) {
	need(t)
	big := map[string]string{}
	for i := range 2000 {
		big[fmt.Sprint("k", i)] = "v"
	}
	metadata, _ := jsonString(big)
	// Requests that name a sandbox name a real one: the sandbox is
	// resolved for the key before the values are checked (authz.go).
	id := create(t)
	for _, c := range []struct {
		what, procedure, body, code, msg string
	}{
		{"memory of int64 max", "/shoal.v1.SandboxService/CreateSandbox", `{"base":"` + baseRef + `","memoryBytes":"9223372036854775807"}`, "invalid_argument", "memory must be between 32 MiB and"},
		{"negative memory", "/shoal.v1.SandboxService/CreateSandbox", `{"base":"` + baseRef + `","memoryBytes":"-1"}`, "invalid_argument", "memory must be between"},
		{"timeout that overflows a duration", "/shoal.v1.SandboxService/CreateSandbox", `{"base":"` + baseRef + `","timeoutSeconds":"18446744075"}`, "invalid_argument", "overflow"},
		{"timeout over the maximum", "/shoal.v1.SandboxService/CreateSandbox", `{"base":"` + baseRef + `","timeoutSeconds":"90000"}`, "invalid_argument", "timeout must be between 1s and 24h0m0s"},
		{"negative timeout", "/shoal.v1.SandboxService/CreateSandbox", `{"base":"` + baseRef + `","timeoutSeconds":"-5"}`, "invalid_argument", "timeout must be between"},
		{"2000 metadata entries", "/shoal.v1.SandboxService/CreateSandbox", `{"base":"` + baseRef + `","metadata":` + metadata + `}`, "invalid_argument", "more than the maximum of 1024"},
		{"200 toolkits", "/shoal.v1.SandboxService/CreateSandbox", `{"base":"` + baseRef + `","toolkits":[` + strings.Repeat(`"t:1",`, 199) + `"t:1"]}`, "invalid_argument", "more than the maximum of 128"},
		{"a long client key", "/shoal.v1.SandboxService/CreateSandbox", `{"base":"` + baseRef + `","clientKey":"` + strings.Repeat("k", 300) + `"}`, "invalid_argument", "client key is 300 bytes"},
		{"SetTimeout that overflows", "/shoal.v1.SandboxService/SetTimeout", `{"id":"` + id + `","timeoutSeconds":"18446744075"}`, "invalid_argument", "overflow"},
		{"a path of 5000 bytes", "/shoal.v1.SandboxService/StatFile", `{"sandboxId":"` + id + `","path":"/` + strings.Repeat("a", 5000) + `"}`, "invalid_argument", "maximum of 4096"},
	} {
		status, body, _ := postJSON(t, c.procedure, c.body)
		wantError(t, c.what, status, body, http.StatusBadRequest, c.code, c.msg)
	}

	// Command values, checked by the session layer for every face.
	for _, c := range []struct{ what, body, msg string }{
		{"exec timeout that overflows", `{"sandboxId":"` + id + `","args":["true"],"timeoutMs":"9223372036854775807"}`, "overflow"},
		{"exec timeout over the maximum", `{"sandboxId":"` + id + `","args":["true"],"timeoutMs":"1000000000000"}`, "timeout must be between 0s and 168h0m0s"},
		{"pty of 65537 rows (would wrap to 1)", `{"sandboxId":"` + id + `","args":["true"],"pty":{"rows":65537,"cols":80}}`, "rows and cols must be 1-1000"},
		{"20000 arguments", `{"sandboxId":"` + id + `","args":["true"` + strings.Repeat(`,"a"`, 20000) + `]}`, "more than the maximum of 16384"},
		{"a NUL in an argument", `{"sandboxId":"` + id + `","args":["true","a\u0000b"]}`, "NUL"},
	} {
		status, body, _ := postJSON(t, "/shoal.v1.CommandService/StartCommand", c.body)
		wantError(t, c.what, status, body, http.StatusBadRequest, "invalid_argument", c.msg)
	}
	// The sandbox is still fine.
	if out, code := run(nil, "exec", id, "--", "echo", "ok"); code != 0 || strings.TrimSpace(out) != "ok" {
		t.Fatalf("exec after refused requests: %d %q", code, out)
	}
}

func jsonString(m map[string]string) (string, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	first := true
	for k, v := range m {
		if !first {
			b.WriteByte(',')
		}
		first = false
		fmt.Fprintf(&b, "%q:%q", k, v)
	}
	b.WriteByte('}')
	return b.String(), nil
}

// A directory of more entries than a listing may carry is refused by the
// host (the agent streams a depth-1 listing unbounded).
func TestListDirBounded(t *testing.T) {
	need(t)
	id := create(t)
	if out, code := run(nil, "exec", id, "--", "sh", "-c", "mkdir /big && cd /big && i=0; while [ $i -lt 10050 ]; do : > f$i; i=$((i+1)); done"); code != 0 {
		t.Fatalf("make 10050 files: %d %s", code, out)
	}
	c := sdk(t)
	_, err := c.ListDir(context.Background(), id, "/big", 1)
	if err == nil || !strings.Contains(err.Error(), "resource_exhausted") || !strings.Contains(err.Error(), "more than 10000 entries") {
		t.Fatalf("ListDir of 10050 entries: %v, want resource_exhausted", err)
	}
	if out, code := run(nil, "exec", id, "--", "sh", "-c", "rm /big/f100[0-4]?"); code != 0 {
		t.Fatalf("rm: %d %s", code, out)
	}
	ents, err := c.ListDir(context.Background(), id, "/big", 1)
	if err != nil || len(ents) != 10000 {
		t.Fatalf("ListDir of 10000 entries: %d entries, %v", len(ents), err)
	}
}

// TestStreamCaps is issue 45's descriptor exhaustion scaled down: a serve
// whose caps are 64 streams a sandbox and 100 a key. 64 watches on one
// sandbox are served, the 65th is refused (resource_exhausted, naming the
// cap); another sandbox's watch, health and the API are still served; the
// key's cap holds across sandboxes; a stream that ends gives its place back.
func TestStreamCaps(t *testing.T) {
	need(t)
	data, err := os.MkdirTemp("/tmp", "ses")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmountUnder(data); os.RemoveAll(data) }) // after the serve stops (cleanups run last first)
	addr := startExtraServe(t, data, "--e2b-listen=", "--pool-size", "0", "--egress-subnet=",
		"--max-streams-per-sandbox", "64", "--max-streams-per-key", "100")
	url := "http://" + addr
	waitFor(t, 2*time.Minute, "the second serve", func() bool {
		res, err := http.Get(url + "/healthz")
		if err == nil {
			res.Body.Close()
		}
		return err == nil
	})
	key, _ := os.ReadFile(filepath.Join(data, "admin.key"))
	c, err := shoal.New(shoal.Options{URL: url, APIKey: strings.TrimSpace(string(key))})
	if err != nil {
		t.Fatal(err)
	}
	rootfs, err := busyboxRootfs()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(rootfs)
	cmd := exec.Command(filepath.Join(binDir, "shoal"), "layer", "build", "--kind", "base", baseRef, rootfs)
	cmd.Env = append(os.Environ(), "SHOAL_URL="+url, "SHOAL_API_KEY="+strings.TrimSpace(string(key)))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("layer build: %v %s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var ids []string
	for range 2 {
		sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.Id)
		t.Cleanup(func() { c.Delete(context.Background(), sb.Id) })
	}
	watch := func(id string) (*shoal.Watch, error) { return c.Watch(ctx, id, "/tmp", false) }
	var open []*shoal.Watch
	defer func() {
		for _, w := range open {
			w.Close()
		}
	}()
	for i := range 64 {
		w, err := watch(ids[0])
		if err != nil {
			t.Fatalf("watch %d of 64: %v", i+1, err)
		}
		open = append(open, w)
	}
	_, err = watch(ids[0])
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "--max-streams-per-sandbox") {
		t.Fatalf("65th watch on one sandbox: %v, want resource_exhausted naming the cap", err)
	}
	// The node serves the rest: health, the API, another sandbox.
	res, err := http.Get(url + "/healthz")
	if err != nil || res.StatusCode != http.StatusOK {
		t.Fatalf("health with a sandbox at its cap: %v %v", res, err)
	}
	res.Body.Close()
	if _, err := c.Get(ctx, ids[1]); err != nil {
		t.Fatalf("API with a sandbox at its cap: %v", err)
	}
	for i := range 36 {
		w, err := watch(ids[1])
		if err != nil {
			t.Fatalf("watch %d on the other sandbox: %v", i+1, err)
		}
		open = append(open, w)
	}
	// 100 streams: the key's cap.
	if _, err := watch(ids[1]); connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "--max-streams-per-key") {
		t.Fatalf("101st stream of one key: %v, want resource_exhausted naming the key's cap", err)
	}
	// A stream that ends gives its place back (once the server sees it end).
	open[0].Close()
	open = open[1:]
	waitFor(t, time.Minute, "a place freed by a closed watch", func() bool {
		w, err := watch(ids[0])
		if err != nil {
			return false
		}
		open = append(open, w)
		return true
	})
}

// E2B's non-streaming directory watchers (CreateWatcher, what the
// synchronous Python SDK polls) hold an agent watch between requests:
// they count against the sandbox's stream cap, refused past it (429 on
// the E2B face), and RemoveWatcher gives the place back.
func TestE2BWatcherCap(t *testing.T) {
	need(t)
	data, err := os.MkdirTemp("/tmp", "ses")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmountUnder(data); os.RemoveAll(data) })
	e2bAddr := freeLocalAddr(t)
	addr := startExtraServe(t, data, "--e2b-listen="+e2bAddr, "--pool-size", "0", "--egress-subnet=", "--max-streams-per-sandbox", "4")
	url := "http://" + addr
	waitFor(t, 2*time.Minute, "the second serve", func() bool {
		res, err := http.Get(url + "/healthz")
		if err == nil {
			res.Body.Close()
		}
		return err == nil
	})
	keyb, _ := os.ReadFile(filepath.Join(data, "admin.key"))
	key := strings.TrimSpace(string(keyb))
	rootfs, err := busyboxRootfs()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(rootfs)
	cmd := exec.Command(filepath.Join(binDir, "shoal"), "layer", "build", "--kind", "base", baseRef, rootfs)
	cmd.Env = append(os.Environ(), "SHOAL_URL="+url, "SHOAL_API_KEY="+key)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("layer build: %v %s", err, out)
	}
	call := func(method, path string, body any, h http.Header) (int, []byte) {
		b, _ := json.Marshal(body)
		req, _ := http.NewRequest(method, "http://"+e2bAddr+path, bytes.NewReader(b))
		req.Header.Set("Content-Type", "application/json")
		for k, v := range h {
			req.Header[k] = v
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer res.Body.Close()
		out, _ := io.ReadAll(res.Body)
		return res.StatusCode, out
	}
	st, b := call("POST", "/sandboxes", map[string]any{"templateID": baseRef, "timeout": 300}, http.Header{"X-Api-Key": {key}})
	var sb struct {
		SandboxID       string `json:"sandboxID"`
		EnvdAccessToken string `json:"envdAccessToken"`
	}
	if st != http.StatusCreated || json.Unmarshal(b, &sb) != nil || sb.SandboxID == "" {
		t.Fatalf("e2b create: %d %s", st, b)
	}
	t.Cleanup(func() { call("DELETE", "/sandboxes/"+sb.SandboxID, nil, http.Header{"X-Api-Key": {key}}) })
	envd := http.Header{"E2b-Sandbox-Id": {sb.SandboxID}, "X-Access-Token": {sb.EnvdAccessToken}}
	var ids []string
	for i := range 4 {
		st, b := call("POST", "/filesystem.Filesystem/CreateWatcher", map[string]any{"path": "/tmp"}, envd)
		var w struct {
			WatcherID string `json:"watcherId"`
		}
		if st != http.StatusOK || json.Unmarshal(b, &w) != nil || w.WatcherID == "" {
			t.Fatalf("watcher %d of 4: %d %s", i+1, st, b)
		}
		ids = append(ids, w.WatcherID)
	}
	if st, b := call("POST", "/filesystem.Filesystem/CreateWatcher", map[string]any{"path": "/tmp"}, envd); st != http.StatusTooManyRequests || !strings.Contains(string(b), "--max-streams-per-sandbox") {
		t.Fatalf("5th watcher past a cap of 4: %d %s, want 429 naming the cap", st, b)
	}
	if st, b := call("POST", "/filesystem.Filesystem/RemoveWatcher", map[string]any{"watcherId": ids[0]}, envd); st != http.StatusOK {
		t.Fatalf("remove watcher: %d %s", st, b)
	}
	waitFor(t, time.Minute, "a place freed by a removed watcher", func() bool {
		st, _ := call("POST", "/filesystem.Filesystem/CreateWatcher", map[string]any{"path": "/tmp"}, envd)
		return st == http.StatusOK
	})
}

// freeLocalAddr is a loopback address free a moment ago.
func freeLocalAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
