package e2e

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/shoal-sandbox/shoal/test/internal/browser"
)

// TestDashboard drives the dashboard in headless Chromium against the real
// serve: a wrong key is refused, the admin key logs in, the node and the
// sandbox show, a command's output shows, and the terminal runs what is
// typed into it over the WebSocket. It leaves a screenshot
// (SHOAL_DASH_SCREENSHOT names where; else the test's temp dir).
func TestDashboard(t *testing.T) {
	need(t)
	id, code := run(nil, "create", "--base", baseRef, "--metadata", "purpose=dash")
	if code != 0 {
		t.Fatalf("create: %s", id)
	}
	id = strings.TrimSpace(id)
	defer run(nil, "rm", id)
	if out, code := run(nil, "exec", id, "--", "sh", "-c", "echo dash-output-$((40+2))"); code != 0 || !strings.Contains(out, "dash-output-42") {
		t.Fatalf("exec: %d %s", code, out)
	}

	p := browser.Start(t)
	p.Step("open the login page", chromedp.Navigate(apiURL+"/"), chromedp.WaitVisible("#login-key", chromedp.ByQuery))
	p.Step("log in with a wrong key", chromedp.SendKeys("#login-key", "sk_shoal_not_a_key_at_all", chromedp.ByQuery),
		chromedp.Click("#login-submit", chromedp.ByQuery))
	p.WaitJS("the refusal", `document.querySelector("#login-error").textContent.includes("invalid API key")`)
	p.Login(apiURL, apiKey)
	p.WaitJS("the sandbox in the table", `!!document.querySelector('#sandboxes tbody tr[data-id="`+id+`"]')`)
	p.WaitJS("the node's load", `document.querySelector("#nodes").textContent.includes("CPUs")`)
	p.WaitJS("the layer", `document.querySelector("#layers").textContent.includes("`+baseRef+`")`)
	// The page holds a session token, never the key.
	var stored string
	p.Step("read the session storage", chromedp.Evaluate(`JSON.stringify(sessionStorage)`, &stored))
	if strings.Contains(stored, apiKey) || !strings.Contains(stored, "sk_dash_") {
		t.Fatalf("session storage holds %s", stored)
	}
	// Filter: paused shows none of the running sandboxes.
	setState := func(v string) chromedp.Action {
		return chromedp.Evaluate(`(() => { const s = document.querySelector("#f-state"); s.value = "`+v+`"; s.dispatchEvent(new Event("change")); })()`, nil)
	}
	p.Step("filter by state", setState("paused"))
	p.WaitJS("the filter", `!document.querySelector('#sandboxes tbody tr[data-id="`+id+`"]')`)
	p.Step("clear the filter", setState(""))
	p.WaitJS("the sandbox again", `!!document.querySelector('#sandboxes tbody tr[data-id="`+id+`"]')`)

	p.Step("open the sandbox", chromedp.Click(`#sandboxes tbody tr[data-id="`+id+`"]`, chromedp.ByQuery))
	p.WaitJS("its command", `document.querySelector("#commands tbody").textContent.includes("echo dash-output")`)
	p.Step("show the command's output", chromedp.Click(`#commands tbody tr`, chromedp.ByQuery))
	p.WaitJS("the output", `document.querySelector("#output").textContent.includes("dash-output-42")`)

	text := p.Terminal("echo term-$((6*7))-ok", "term-42-ok")
	t.Logf("terminal:\n%s", strings.TrimSpace(text))

	shot := os.Getenv("SHOAL_DASH_SCREENSHOT")
	if shot == "" {
		shot = filepath.Join(t.TempDir(), "dashboard.png")
	}
	p.Screenshot(shot)
}

// TestDashboardAuth checks the dashboard's edges without a browser: its
// page is public but nothing else is, a session token works as a bearer
// token until logout, and the terminal's WebSocket needs a fresh ticket
// and the dashboard's own origin.
func TestDashboardAuth(t *testing.T) {
	need(t)
	do := func(method, path, auth, origin, body string) (int, map[string]any) {
		t.Helper()
		req, _ := http.NewRequest(method, apiURL+path, strings.NewReader(body))
		if auth != "" {
			req.Header.Set("Authorization", "Bearer "+auth)
		}
		if origin != "" {
			req.Header.Set("Origin", origin)
		}
		if method == "POST" {
			req.Header.Set("Content-Type", "application/json")
		}
		if strings.HasPrefix(path, "/dash/terminal") {
			req.Header.Set("Connection", "Upgrade")
			req.Header.Set("Upgrade", "websocket")
			req.Header.Set("Sec-WebSocket-Version", "13")
			req.Header.Set("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		var out map[string]any
		json.NewDecoder(res.Body).Decode(&out)
		return res.StatusCode, out
	}
	if code, _ := do("GET", "/dash/", "", "", ""); code != 200 {
		t.Fatalf("GET /dash/: %d", code)
	}
	if code, _ := do("POST", "/shoal.v1.MonitorService/GetStatus", "", "", "{}"); code != 401 {
		t.Fatalf("status without a key: %d", code)
	}
	if code, _ := do("POST", "/dash/login", "", "", `{"key":"sk_shoal_wrong_wrong_wrong"}`); code != 401 {
		t.Fatalf("login with a wrong key: %d", code)
	}
	code, login := do("POST", "/dash/login", "", "", `{"key":"`+apiKey+`"}`)
	tok, _ := login["token"].(string)
	if code != 200 || !strings.HasPrefix(tok, "sk_dash_") {
		t.Fatalf("login: %d %v", code, login)
	}
	if code, _ := do("POST", "/dash/login", "", "", `{"key":"`+tok+`"}`); code != 401 {
		t.Fatalf("login with a session token: %d", code)
	}
	if code, st := do("POST", "/shoal.v1.MonitorService/GetStatus", tok, "", "{}"); code != 200 || st["nodes"] == nil {
		t.Fatalf("status with the session token: %d %v", code, st)
	}
	id, rc := run(nil, "create", "--base", baseRef)
	if rc != 0 {
		t.Fatalf("create: %s", id)
	}
	id = strings.TrimSpace(id)
	defer run(nil, "rm", id)
	ticket := func() string {
		code, r := do("POST", "/dash/ticket", tok, "", "")
		tk, _ := r["ticket"].(string)
		if code != 200 || tk == "" {
			t.Fatalf("ticket: %d %v", code, r)
		}
		return tk
	}
	self := apiURL
	tk := ticket()
	if code, _ := do("GET", "/dash/terminal?sandbox="+id+"&ticket="+tk, "", "http://evil.example", ""); code != 403 {
		t.Fatalf("terminal from another origin: %d", code)
	}
	if code, _ := do("GET", "/dash/terminal?sandbox="+id+"&ticket="+tk, "", "", ""); code != 403 {
		t.Fatalf("terminal without an origin: %d", code)
	}
	if code, _ := do("GET", "/dash/terminal?sandbox="+id+"&ticket=tk_forged", "", self, ""); code != 401 {
		t.Fatalf("terminal with a forged ticket: %d", code)
	}
	tk = ticket()
	if code, _ := do("GET", "/dash/terminal?sandbox=nosuchsandbox00000000&ticket="+tk, "", self, ""); code != 404 {
		t.Fatalf("terminal into no sandbox: %d", code)
	}
	if code, _ := do("GET", "/dash/terminal?sandbox="+id+"&ticket="+tk, "", self, ""); code != 401 {
		t.Fatalf("terminal with a used ticket: %d", code)
	}
	do("POST", "/dash/logout", tok, "", "")
	if code, _ := do("POST", "/shoal.v1.MonitorService/GetStatus", tok, "", "{}"); code != 401 {
		t.Fatalf("status after logout: %d", code)
	}
	if code, _ := do("POST", "/dash/ticket", tok, "", ""); code != 401 {
		t.Fatalf("ticket after logout: %d", code)
	}
}

// TestTop checks `shoal top --json` and `--once` against the real serve:
// the node's figures, and a busy sandbox's memory and CPU read from its
// cgroups.
func TestTop(t *testing.T) {
	need(t)
	id, code := run(nil, "create", "--base", baseRef)
	if code != 0 {
		t.Fatalf("create: %s", id)
	}
	id = strings.TrimSpace(id)
	defer run(nil, "rm", id)
	// Human output, as docker's reads: inspect says running and gives
	// numbers as numbers; ls's EXPIRES is a time.
	out, code := run(nil, "inspect", id)
	var in map[string]any
	if err := json.Unmarshal([]byte(out), &in); code != 0 || err != nil {
		t.Fatalf("inspect: %d %v\n%s", code, err, out)
	}
	if _, isNum := in["memory_bytes"].(float64); in["state"] != "running" || !isNum {
		t.Fatalf("inspect: state %v, memory_bytes %#v; want running and a number", in["state"], in["memory_bytes"])
	}
	out, code = run(nil, "ls")
	var line string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, id) {
			line = l
		}
	}
	if f := strings.Fields(line); code != 0 || len(f) != 8 || f[2] != "running" {
		t.Fatalf("ls: want ID BACKEND running BASE CREATED(date time) EXPIRES(date time):\n%s", out)
	} else if exp, err := time.ParseInLocation(time.DateTime, f[6]+" "+f[7], time.Local); err != nil || !exp.After(time.Now()) {
		t.Fatalf("ls EXPIRES %q: not a time to come (%v)", f[6]+" "+f[7], err)
	}
	// A command that burns CPU until killed (the sandbox's rm ends it).
	if out, code := run(nil, "exec", "-d", id, "--", "sh", "-c", "while :; do :; done"); code != 0 {
		t.Fatalf("exec -d: %s", out)
	}
	var v struct {
		Nodes []struct {
			Name             string    `json:"name"`
			CPUs             int       `json:"cpus"`
			MemoryTotalBytes int64     `json:"memory_total_bytes"`
			Load             []float64 `json:"load"`
		} `json:"nodes"`
		Sandboxes []struct {
			ID              string   `json:"id"`
			State           string   `json:"state"`
			CPUPercent      *float64 `json:"cpu_percent"`
			MemoryBytes     int64    `json:"memory_bytes"`
			CommandsRunning int      `json:"commands_running"`
		} `json:"sandboxes"`
	}
	// CPU time shows up once the loop has been scheduled: on a loaded
	// host that can take a few samples.
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, code := run(nil, "top", "--json", "--interval", "500ms")
		if code != 0 {
			t.Fatalf("top --json: %s", out)
		}
		if err := json.Unmarshal([]byte(out), &v); err != nil {
			t.Fatalf("top --json: %v\n%s", err, out)
		}
		if len(v.Nodes) != 1 || v.Nodes[0].CPUs < 1 || v.Nodes[0].MemoryTotalBytes <= 0 || len(v.Nodes[0].Load) != 3 {
			t.Fatalf("top --json nodes: %s", out)
		}
		found := false
		for _, s := range v.Sandboxes {
			if s.ID != id {
				continue
			}
			found = true
			if s.State != "running" || s.MemoryBytes <= 0 || s.CommandsRunning != 1 {
				t.Fatalf("top --json sandbox: %s", out)
			}
			if s.CPUPercent != nil && *s.CPUPercent > 1 {
				goto once
			}
		}
		if !found {
			t.Fatalf("top --json lacks %s: %s", id, out)
		}
		if time.Now().After(deadline) {
			t.Fatalf("top --json shows no CPU use by a busy loop: %s", out)
		}
	}
once:
	out, code = run(nil, "top", "--once", "--interval", "200ms", "--state", "running")
	if code != 0 || !strings.Contains(out, "node ") || !strings.Contains(out, id) || !strings.Contains(out, "IDLE") {
		t.Fatalf("top --once: %d\n%s", code, out)
	}
	if out, code := run(nil, "top", "--once", "--interval", "1ns"); code == 0 || !strings.Contains(out, "--interval") {
		t.Fatalf("top --interval 1ns: %d %s", code, out)
	}
}
