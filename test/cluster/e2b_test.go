package cluster_test

// E2B's API through a control replica (serve --role control
// --e2b-listen): creates placed on both nodes, envd's process service
// (a streamed Start), /files, a port by host name, a list merged across
// the nodes (and paged), get, kill; and, where test/e2b has the stock npm
// SDK installed, the SDK itself pointed at the replica.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/api/e2b/process"
	"github.com/shoal-sandbox/shoal/api/e2b/process/processconnect"
	"github.com/shoal-sandbox/shoal/internal/cluster"
)

// e2bClient speaks E2B's REST API and envd's services to one endpoint.
type e2bClient struct {
	t    *testing.T
	base string // http://host:port
	key  string
	http *http.Client
}

func newE2BClient(t *testing.T, addr, key string) *e2bClient {
	return &e2bClient{t: t, base: "http://" + addr, key: key, http: &http.Client{Timeout: 2 * time.Minute}}
}

// e2bSandbox is what create, get and connect answer.
type e2bSandbox struct {
	SandboxID       string  `json:"sandboxID"`
	EnvdAccessToken string  `json:"envdAccessToken"`
	Domain          *string `json:"domain"`
	State           string  `json:"state"`
}

// do sends an API request (key in E2B's X-API-Key) and returns the status
// and body.
func (c *e2bClient) do(ctx context.Context, method, path string, body any, h http.Header) (int, http.Header, []byte) {
	c.t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		c.t.Fatal(err)
	}
	req.Header.Set("X-API-Key", c.key)
	req.Header.Set("Content-Type", "application/json")
	for k, v := range h {
		req.Header[k] = v
	}
	res, err := c.http.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, res.Header, b
}

// envd returns headers that address envd of sandbox sb through E2B's
// E2B_SANDBOX_URL scheme.
func envdHeaders(sb e2bSandbox) http.Header {
	return http.Header{"E2b-Sandbox-Id": {sb.SandboxID}, "X-Access-Token": {sb.EnvdAccessToken}}
}

// run starts cmd in sb through envd's process.Start (a server stream) and
// returns its stdout and exit code.
func (c *e2bClient) run(ctx context.Context, sb e2bSandbox, cmd string) (string, int32) {
	c.t.Helper()
	pc := processconnect.NewProcessClient(c.http, c.base, connect.WithProtoJSON())
	req := connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", cmd}}})
	for k, v := range envdHeaders(sb) {
		req.Header()[k] = v
	}
	st, err := pc.Start(ctx, req)
	if err != nil {
		c.t.Fatalf("process.Start in %s: %v", sb.SandboxID, err)
	}
	defer st.Close()
	var out bytes.Buffer
	started := false
	for st.Receive() {
		switch e := st.Msg().GetEvent().GetEvent().(type) {
		case *process.ProcessEvent_Start:
			started = e.Start.GetPid() > 0
		case *process.ProcessEvent_Data:
			out.Write(e.Data.GetStdout())
		case *process.ProcessEvent_End:
			if !started {
				c.t.Fatalf("process.Start in %s: an end before a start event", sb.SandboxID)
			}
			return out.String(), e.End.GetExitCode()
		}
	}
	c.t.Fatalf("process.Start in %s: the stream ended without an end event: %v", sb.SandboxID, st.Err())
	return "", 0
}

func checkE2B(t *testing.T, ctx context.Context, controls, nodes []*proc, key string, tags map[string]string) {
	c1, c2 := newE2BClient(t, controls[0].e2b, key), newE2BClient(t, controls[1].e2b, key)
	domain := func(c *proc) string { return "shoal.localhost:" + c.e2b[strings.LastIndexByte(c.e2b, ':')+1:] }

	// Creates through one replica land on both nodes (placement spreads
	// them; the nodes may hold unequal numbers of sandboxes from the
	// earlier steps, so a node may take two in a row: one per node is
	// kept, a few creates at most), each answered with the replica's
	// domain, not the node's.
	var sbs []e2bSandbox
	onNode := map[string]string{}
	for i := 0; i < 6 && (onNode["n1"] == "" || onNode["n2"] == ""); i++ {
		st, _, b := c1.do(ctx, "POST", "/sandboxes", map[string]any{"templateID": baseRef, "timeout": 600, "metadata": map[string]string{"via": "control"}}, nil)
		var sb e2bSandbox
		if st != http.StatusCreated || json.Unmarshal(b, &sb) != nil || sb.SandboxID == "" {
			t.Fatalf("e2b create %d through control: %d %s", i, st, b)
		}
		if sb.Domain == nil || *sb.Domain != domain(controls[0]) {
			t.Fatalf("e2b create: domain %v, want the replica's %s", sb.Domain, domain(controls[0]))
		}
		if n := tags[cluster.TagOf(sb.SandboxID)]; onNode[n] != "" {
			if st, _, b := c1.do(ctx, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); st != http.StatusNoContent {
				t.Fatalf("e2b kill of a second sandbox on %s: %d %s", n, st, b)
			}
			continue
		}
		onNode[tags[cluster.TagOf(sb.SandboxID)]] = sb.SandboxID
		sbs = append(sbs, sb)
	}
	if onNode["n1"] == "" || onNode["n2"] == "" {
		t.Fatalf("6 E2B creates did not spread over 2 nodes: %v", onNode)
	}
	// A template no node has: the node's answer, not a retry elsewhere.
	if st, _, b := c1.do(ctx, "POST", "/sandboxes", map[string]any{"templateID": "nope:1"}, nil); st != http.StatusNotFound {
		t.Fatalf("e2b create of an unknown template: %d %s, want 404", st, b)
	}
	// Without the key: refused by the replica.
	if st, _, _ := c1.do(ctx, "GET", "/v2/sandboxes", nil, http.Header{"X-Api-Key": {"e2b_0000"}}); st != http.StatusUnauthorized {
		t.Fatalf("e2b list with a bad key: %d, want 401", st)
	}

	for i, sb := range sbs {
		c := []*e2bClient{c2, c1}[i%2] // either replica routes any sandbox
		// A command, streamed from the node through the replica.
		if out, code := c.run(ctx, sb, "echo hi from $(hostname)"); code != 0 || !strings.HasPrefix(out, "hi from ") {
			t.Fatalf("e2b command in %s: %q exit %d", sb.SandboxID, out, code)
		}
		// A file written and read back through envd's /files. As E2B's user
		// (its default), in its home.
		content := "e2b " + sb.SandboxID
		h := envdHeaders(sb)
		h.Set("Content-Type", "application/octet-stream")
		req, _ := http.NewRequestWithContext(ctx, "POST", c.base+"/files?path=/home/user/e.txt", strings.NewReader(content))
		req.Header = h
		res, err := c.http.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			t.Fatalf("e2b upload to %s: %d %s", sb.SandboxID, res.StatusCode, b)
		}
		req, _ = http.NewRequestWithContext(ctx, "GET", c.base+"/files?path=/home/user/e.txt", nil)
		req.Header = envdHeaders(sb)
		res, err = c.http.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ = io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusOK || string(b) != content {
			t.Fatalf("e2b download from %s: %d %q, want %q", sb.SandboxID, res.StatusCode, b, content)
		}
		// A port by host name (getHost: PORT-ID.DOMAIN, to the replica):
		// busybox's httpd serves the user's home inside the sandbox.
		if out, code := c.run(ctx, sb, "httpd -p 8000 -h /home/user && echo up"); code != 0 || out != "up\n" {
			t.Fatalf("start httpd in %s: %q exit %d", sb.SandboxID, out, code)
		}
		waitFor(t, "the sandbox's port 8000 through the replica", func() error {
			req, _ := http.NewRequestWithContext(ctx, "GET", c.base+"/e.txt", nil)
			req.Host = "8000-" + sb.SandboxID + "." + domain(controls[0])
			res, err := c.http.Do(req)
			if err != nil {
				return err
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != http.StatusOK || string(b) != content {
				return fmt.Errorf("%d %q", res.StatusCode, b)
			}
			return nil
		})
	}

	// The list is every node's, merged; paged one by one it is the same.
	st, hdr, b := c2.do(ctx, "GET", "/v2/sandboxes?metadata=via%3Dcontrol", nil, nil)
	var list []e2bSandbox
	if st != http.StatusOK || json.Unmarshal(b, &list) != nil {
		t.Fatalf("e2b list through control: %d %s", st, b)
	}
	var ids []string
	for _, s := range list {
		ids = append(ids, s.SandboxID)
	}
	for _, sb := range sbs {
		if !slices.Contains(ids, sb.SandboxID) {
			t.Fatalf("e2b list through control: %v, want %s (on both nodes) among them", ids, sb.SandboxID)
		}
	}
	if len(ids) != len(sbs) || hdr.Get("X-Total-Running") == "" {
		t.Fatalf("e2b list by metadata: %v (X-Total-Running %q), want the %d made through E2B", ids, hdr.Get("X-Total-Running"), len(sbs))
	}
	var paged []string
	for tok := ""; ; {
		st, hdr, b := c1.do(ctx, "GET", "/v2/sandboxes?limit=1&nextToken="+tok, nil, nil)
		var page []e2bSandbox
		if st != http.StatusOK || json.Unmarshal(b, &page) != nil || len(page) > 1 {
			t.Fatalf("e2b list page: %d %s", st, b)
		}
		for _, s := range page {
			paged = append(paged, s.SandboxID)
		}
		if tok = hdr.Get("X-Next-Token"); tok == "" || len(paged) > 10 {
			break
		}
	}
	st, _, b = c1.do(ctx, "GET", "/v2/sandboxes", nil, nil)
	var whole []e2bSandbox
	json.Unmarshal(b, &whole)
	var wholeIDs []string
	for _, s := range whole {
		wholeIDs = append(wholeIDs, s.SandboxID)
	}
	if st != http.StatusOK || len(wholeIDs) < 4 || !slices.Equal(paged, wholeIDs) {
		t.Fatalf("e2b list paged one by one: %v; whole: %v (%d); want the same, ≥ 4 (the E2B and Shoal sandboxes of both nodes)", paged, wholeIDs, st)
	}

	// Get through the other replica, then kill; a killed sandbox is gone.
	for _, sb := range sbs {
		st, _, b := c2.do(ctx, "GET", "/sandboxes/"+sb.SandboxID, nil, nil)
		var got e2bSandbox
		if st != http.StatusOK || json.Unmarshal(b, &got) != nil || got.SandboxID != sb.SandboxID || got.State != "running" ||
			got.Domain == nil || *got.Domain != domain(controls[1]) {
			t.Fatalf("e2b get %s through control: %d %s", sb.SandboxID, st, b)
		}
	}
	if n, _ := strconv.Atoi(os.Getenv("SHOAL_CLUSTER_E2B_MEASURE")); n > 0 {
		measureE2B(t, ctx, n, sbs[0], c1, newE2BClient(t, nodeE2B(sbs[0].SandboxID, tags, nodes), key))
	}
	if os.Getenv("SHOAL_CLUSTER_NO_NPM") == "" {
		npmSDK(t, controls[1], key, domain(controls[1]))
	}
	for _, sb := range sbs {
		if st, _, b := c1.do(ctx, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); st != http.StatusNoContent {
			t.Fatalf("e2b kill %s through control: %d %s", sb.SandboxID, st, b)
		}
		if st, _, _ := c2.do(ctx, "GET", "/sandboxes/"+sb.SandboxID, nil, nil); st != http.StatusNotFound {
			t.Fatalf("e2b get of a killed sandbox: %d, want 404", st)
		}
	}
}

// checkE2BLost checks what E2B clients get for a sandbox whose node is
// down: 404 on the API and 502 on its traffic, as for a sandbox E2B no
// longer has, saying that its node is down.
func checkE2BLost(t *testing.T, ctx context.Context, control *proc, key, id string) {
	c := newE2BClient(t, control.e2b, key)
	st, _, b := c.do(ctx, "GET", "/sandboxes/"+id, nil, nil)
	if st != http.StatusNotFound || !strings.Contains(string(b), "down") {
		t.Fatalf("e2b get of a lost sandbox: %d %s, want 404 saying its node is down", st, b)
	}
	st, _, b = c.do(ctx, "GET", "/files?path=/work/a.txt", nil, http.Header{"E2b-Sandbox-Id": {id}})
	if st != http.StatusBadGateway || !strings.Contains(string(b), "down") {
		t.Fatalf("e2b traffic of a lost sandbox: %d %s, want 502 saying its node is down", st, b)
	}
}

// npmSDK runs the stock e2b SDK (test/e2b's, when `npm ci` installed it
// there) against a control replica: create, a command, a file, list,
// kill; then a create and a command by host name over TLS (no
// E2B_SANDBOX_URL). Skipped, saying so, where Node or the SDK is missing.
func npmSDK(t *testing.T, control *proc, key, domain string) {
	if _, err := os.Stat("../e2b/node_modules/e2b/package.json"); err != nil {
		t.Log("npm e2b SDK step skipped: run `npm ci` in test/e2b")
		return
	}
	if _, err := exec.LookPath("node"); err != nil {
		t.Log("npm e2b SDK step skipped: no node")
		return
	}
	script := `
const { Sandbox } = require("e2b")
;(async () => {
  const sbx = await Sandbox.create("busybox:1", { metadata: { via: "sdk" } })
  const r = await sbx.commands.run("echo $((6*7))")
  if (r.stdout !== "42\n") throw new Error("stdout " + JSON.stringify(r.stdout))
  await sbx.files.write("/home/user/sdk.txt", "from the sdk")
  if (await sbx.files.read("/home/user/sdk.txt") !== "from the sdk") throw new Error("read back")
  const listed = await Sandbox.list({ query: { metadata: { via: "sdk" } } }).nextItems()
  if (listed.length !== 1 || listed[0].sandboxId !== sbx.sandboxId) throw new Error("list " + JSON.stringify(listed))
  if (!(await sbx.kill())) throw new Error("kill")
  // As E2B's cloud is reached: no E2B_SANDBOX_URL, envd at
  // https://49983-ID.DOMAIN (the replica's, serving TLS with its CA).
  delete process.env.E2B_SANDBOX_URL
  const dns = require("node:dns"), lookup = dns.lookup
  dns.lookup = (host, opts, cb) => {
    if (typeof opts === "function") { cb = opts; opts = {} }
    if (typeof host === "string" && host.endsWith(".shoal.localhost")) {
      return opts && opts.all ? process.nextTick(cb, null, [{ address: "127.0.0.1", family: 4 }]) : process.nextTick(cb, null, "127.0.0.1", 4)
    }
    return lookup.call(dns, host, opts, cb)
  }
  const tls = await Sandbox.create("busybox:1")
  const t = await tls.commands.run("echo over-tls")
  if (t.stdout !== "over-tls\n") throw new Error("tls stdout " + JSON.stringify(t.stdout))
  await tls.kill()
  console.log("ok " + sbx.sandboxId + " " + tls.sandboxId)
})().catch((e) => { console.error(e); process.exit(1) })
`
	cmd := exec.Command("node", "-e", script)
	cmd.Dir = "../e2b"
	cmd.Env = append(os.Environ(), "E2B_API_URL=http://"+control.e2b, "E2B_SANDBOX_URL=http://"+control.e2b,
		"E2B_API_KEY="+key, "E2B_DOMAIN="+domain, "NODE_EXTRA_CA_CERTS="+filepath.Join(control.data, "e2b", "tls", "ca.pem"))
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "ok ") {
		t.Fatalf("npm e2b SDK through control: %v\n%s", err, out)
	}
	t.Logf("npm e2b SDK through control: %s", bytes.TrimSpace(out))
}

// nodeE2B is the E2B address of the node of sandbox id.
func nodeE2B(id string, tags map[string]string, nodes []*proc) string {
	for _, n := range nodes {
		if n.name == tags[cluster.TagOf(id)] {
			return n.e2b
		}
	}
	return ""
}

// measureE2B logs (asserts nothing) the latency of n envd commands and
// n file reads in sb through the replica and straight to its node's E2B
// endpoint, alternating: SHOAL_CLUSTER_E2B_MEASURE=n go test
// ./test/cluster -run TestCluster -v.
func measureE2B(t *testing.T, ctx context.Context, n int, sb e2bSandbox, viaControl, direct *e2bClient) {
	for _, op := range []struct {
		name string
		do   func(c *e2bClient)
	}{
		{"process.Start true", func(c *e2bClient) {
			if _, code := c.run(ctx, sb, "true"); code != 0 {
				t.Fatalf("true: exit %d", code)
			}
		}},
		{"GET /files", func(c *e2bClient) {
			req, _ := http.NewRequestWithContext(ctx, "GET", c.base+"/files?path=/home/user/e.txt", nil)
			req.Header = envdHeaders(sb)
			res, err := c.http.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, res.Body)
			res.Body.Close()
		}},
	} {
		var ctl, dir []time.Duration
		for i := 0; i < n; i++ {
			for j, c := range []*e2bClient{viaControl, direct} {
				t0 := time.Now()
				op.do(c)
				if j == 0 {
					ctl = append(ctl, time.Since(t0))
				} else {
					dir = append(dir, time.Since(t0))
				}
			}
		}
		q := func(d []time.Duration, p float64) time.Duration {
			slices.Sort(d)
			return d[int(p*float64(len(d)-1))]
		}
		t.Logf("e2b %s x%d: via control p50 %v p90 %v; direct to node p50 %v p90 %v", op.name, n,
			q(ctl, 0.5).Round(10*time.Microsecond), q(ctl, 0.9).Round(10*time.Microsecond), q(dir, 0.5).Round(10*time.Microsecond), q(dir, 0.9).Round(10*time.Microsecond))
	}
}
