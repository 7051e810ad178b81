package cluster_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/coder/websocket"

	"github.com/shoal-sandbox/shoal/test/internal/browser"
)

// dashClient is the dashboard's view of a control replica: logged in
// with the key, it calls the API with its session token, as the page does.
type dashClient struct {
	t     *testing.T
	base  string // http://addr
	token string
}

func dashLogin(t *testing.T, addr, key string) *dashClient {
	t.Helper()
	d := &dashClient{t: t, base: "http://" + addr}
	var r struct {
		Token string `json:"token"`
	}
	if code := d.post("/dash/login", "", `{"key":"`+key+`"}`, &r); code != 200 || !strings.HasPrefix(r.Token, "sk_dash_") {
		t.Fatalf("dashboard login on the control replica: %d %+v", code, r)
	}
	d.token = r.Token
	return d
}

func (d *dashClient) post(path, token, body string, out any) int {
	d.t.Helper()
	req, _ := http.NewRequest("POST", d.base+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Origin", d.base) // a page of this server
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		d.t.Fatal(err)
	}
	defer res.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(res.Body)
	if out != nil && json.Unmarshal(b.Bytes(), out) != nil && res.StatusCode == 200 {
		d.t.Fatalf("POST %s: not JSON: %s", path, b.String())
	}
	if res.StatusCode != 200 {
		d.t.Logf("POST %s: %d %s", path, res.StatusCode, b.String())
	}
	return res.StatusCode
}

// dashStatus is MonitorService.GetStatus as the page reads it (protojson).
type dashStatus struct {
	Nodes []struct {
		Name        string `json:"name"`
		State       string `json:"state"`
		HeartbeatAt string `json:"heartbeatAt"`
		URL         string `json:"url"`
		Cpus        int    `json:"cpus"`
		Sandboxes   string `json:"sandboxes"` // int64: a JSON string
	} `json:"nodes"`
	Sandboxes []struct {
		ID    string `json:"id"`
		Node  string `json:"node"`
		State string `json:"state"`
	} `json:"sandboxes"`
}

func (d *dashClient) status() dashStatus {
	d.t.Helper()
	var st dashStatus
	if code := d.post("/shoal.v1.MonitorService/GetStatus", d.token, "{}", &st); code != 200 {
		d.t.Fatalf("GetStatus through the control replica with a dashboard session: %d", code)
	}
	return st
}

// checkDashboard checks what the dashboard of a control replica shows of
// a cluster whose nodes are all up: every node with its load and last
// heartbeat, every sandbox with its node (want: node → sandbox IDs); the
// commands of a sandbox on each node; and a terminal into each, through
// the replica. `shoal top --json` (bin) shows the same nodes and sandboxes.
func checkDashboard(t *testing.T, ctx context.Context, bin, addr, key string, want map[string][]string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "shoal"), "top", "--json", "--interval", "100ms")
	cmd.Env = append(os.Environ(), "SHOAL_URL=http://"+addr, "SHOAL_API_KEY="+key)
	out, err := cmd.Output()
	var top struct {
		Nodes []struct {
			Name  string `json:"name"`
			State string `json:"state"`
		} `json:"nodes"`
		Sandboxes []struct {
			ID   string `json:"id"`
			Node string `json:"node"`
		} `json:"sandboxes"`
	}
	if err != nil || json.Unmarshal(out, &top) != nil || len(top.Nodes) != len(want) {
		t.Fatalf("shoal top --json through the control replica: %v\n%s", err, out)
	}
	for _, s := range top.Sandboxes {
		if !slices.Contains(want[s.Node], s.ID) {
			t.Fatalf("shoal top --json: sandbox %s on %q, want %v\n%s", s.ID, s.Node, want, out)
		}
	}
	d := dashLogin(t, addr, key)
	st := d.status()
	up := map[string]bool{}
	for _, n := range st.Nodes {
		hb, err := time.Parse(time.RFC3339Nano, n.HeartbeatAt)
		if n.State != "up" || err != nil || time.Since(hb) > time.Minute || n.URL == "" || n.Cpus < 1 {
			t.Fatalf("dashboard node %+v: want up, a recent heartbeat, its URL and CPUs", n)
		}
		up[n.Name] = true
	}
	on := map[string]string{}
	for _, s := range st.Sandboxes {
		on[s.ID] = s.Node
	}
	for node, ids := range want {
		if !up[node] {
			t.Fatalf("dashboard status lacks node %s: %+v", node, st.Nodes)
		}
		for _, id := range ids {
			if on[id] != node {
				t.Fatalf("dashboard status: sandbox %s on %q, want %s: %+v", id, on[id], node, st.Sandboxes)
			}
		}
	}
	if len(st.Nodes) != len(want) {
		t.Fatalf("dashboard status: %d nodes, want %d: %+v", len(st.Nodes), len(want), st.Nodes)
	}
	for node, ids := range want {
		id := ids[0]
		// The commands view: a routed call with the session token.
		var cmds struct {
			Commands []struct {
				Args []string `json:"args"`
			} `json:"commands"`
		}
		if code := d.post("/shoal.v1.CommandService/ListCommands", d.token, `{"sandboxId":"`+id+`"}`, &cmds); code != 200 || len(cmds.Commands) == 0 {
			t.Fatalf("commands of %s (node %s) through the dashboard: %d %+v", id, node, code, cmds)
		}
		// The terminal: a ticket of the replica, the WebSocket to it.
		var tk struct {
			Ticket string `json:"ticket"`
		}
		if code := d.post("/dash/ticket", d.token, "", &tk); code != 200 || tk.Ticket == "" {
			t.Fatalf("terminal ticket: %d", code)
		}
		q := url.Values{"sandbox": {id}, "ticket": {tk.Ticket}, "rows": {"24"}, "cols": {"80"}}
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second) // a hang detector
		conn, res, err := websocket.Dial(wctx, "ws://"+addr+"/dash/terminal?"+q.Encode(), &websocket.DialOptions{HTTPHeader: http.Header{"Origin": {d.base}}})
		if err != nil {
			cancel()
			t.Fatalf("terminal into %s (node %s) through the control replica: %v %v", id, node, res, err)
		}
		if err := conn.Write(wctx, websocket.MessageBinary, []byte("echo term-$((6*7))-$(hostname)\n")); err != nil {
			t.Fatal(err)
		}
		var screen strings.Builder
		for !strings.Contains(screen.String(), "term-42-") {
			typ, b, err := conn.Read(wctx)
			if err != nil {
				t.Fatalf("terminal into %s: %v; read so far %q", id, err, screen.String())
			}
			if typ == websocket.MessageBinary {
				screen.Write(b)
			}
		}
		conn.Close(websocket.StatusNormalClosure, "")
		cancel()
	}
}

// checkDashboardLost checks that the dashboard shows node as not up and
// its sandbox id as lost, on that node.
func checkDashboardLost(t *testing.T, addr, key, node, id string) {
	t.Helper()
	d := dashLogin(t, addr, key)
	waitFor(t, "the dashboard to show "+node+" down", func() error {
		st := d.status()
		state := ""
		for _, n := range st.Nodes {
			if n.Name == node {
				state = n.State
			}
		}
		if state != "down" && state != "unreachable" {
			return fmt.Errorf("node %s is %q: %+v", node, state, st.Nodes)
		}
		for _, s := range st.Sandboxes {
			if s.ID == id {
				if s.State != "lost" || s.Node != node {
					return fmt.Errorf("sandbox %+v: want lost on %s", s, node)
				}
				return nil
			}
		}
		return fmt.Errorf("sandbox %s not listed: %+v", id, st.Sandboxes)
	})
}

// checkDashboardPage opens the dashboard of a control replica in headless
// Chromium: both nodes' cards, each sandbox's row naming its node, and,
// for a sandbox of the last node, its commands and a terminal. It leaves
// a screenshot (SHOAL_DASH_CLUSTER_SCREENSHOT names where; else the
// test's temp dir).
func checkDashboardPage(t *testing.T, addr, key string, want map[string][]string) {
	t.Helper()
	p := browser.Start(t)
	p.Login("http://"+addr, key)
	var last string
	for node, ids := range want {
		p.WaitJS("node "+node+"'s card", `(document.querySelector('#nodes .card[data-node="`+node+`"]')||{}).textContent?.includes("CPUs")`)
		for _, id := range ids {
			p.WaitJS("sandbox "+id+" on "+node, `(document.querySelector('#sandboxes tbody tr[data-id="`+id+`"] td:nth-child(2)')||{}).textContent === "`+node+`"`)
		}
		if node > last {
			last = node
		}
	}
	p.WaitJS("the node count", `document.querySelector("#node-count").textContent === "`+fmt.Sprint(len(want))+` up"`)
	id := want[last][0]
	p.Step("open a sandbox of "+last, chromedp.Click(`#sandboxes tbody tr[data-id="`+id+`"]`, chromedp.ByQuery))
	p.WaitJS("its commands", `document.querySelector("#commands tbody").textContent.includes("cat /work/a.txt")`)
	text := p.Terminal("echo page-$((6*7))-on-$(cat /work/a.txt | wc -c)", "page-42-on-")
	t.Logf("terminal through the control replica:\n%s", strings.TrimSpace(text))
	shot := os.Getenv("SHOAL_DASH_CLUSTER_SCREENSHOT")
	if shot == "" {
		shot = filepath.Join(t.TempDir(), "dashboard-cluster.png")
	}
	p.Screenshot(shot)
}
