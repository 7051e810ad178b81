// Package browser drives the dashboard in headless Chromium for the
// end-to-end tests (test/e2e against one serve, test/cluster against a
// control replica): the browser's start, steps with deadlines, and the
// dashboard's login.
package browser

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/input"
	"github.com/chromedp/chromedp"
)

// Page is a headless Chromium tab.
type Page struct {
	t   *testing.T
	ctx context.Context
}

// Start starts Chromium (Debian: apt-get install chromium), or skips the
// test saying it is missing. The browser ends with the test.
func Start(t *testing.T) *Page {
	t.Helper()
	var path string
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			path = p
			break
		}
	}
	if path == "" {
		t.Skip("needs Chromium (Debian: apt-get install chromium; scripts/deps.sh installs it)")
	}
	// D-Bus is off (its connection attempts cost Chromium seconds at
	// start); a loaded host may take a while to start the browser.
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path), chromedp.NoSandbox,
		chromedp.Flag("disable-dev-shm-usage", true), chromedp.Flag("disable-gpu", true), chromedp.WindowSize(1400, 1300),
		chromedp.WSURLReadTimeout(3*time.Minute), chromedp.Env("DBUS_SESSION_BUS_ADDRESS=disabled:", "DBUS_SYSTEM_BUS_ADDRESS=disabled:"))
	actx, cancelA := chromedp.NewExecAllocator(context.Background(), opts...)
	// cdproto may not know every event field of a newer Chromium: those
	// decoding errors are noise.
	ctx, cancelC := chromedp.NewContext(actx, chromedp.WithErrorf(func(f string, a ...any) {
		if msg := fmt.Sprintf(f, a...); !strings.Contains(msg, "could not unmarshal event") {
			t.Logf("chromedp: %s", msg)
		}
	}))
	t.Cleanup(func() { cancelC(); cancelA() })
	start := time.Now()
	if err := chromedp.Run(ctx); err != nil { // starts the browser (with ctx: the steps' contexts end)
		t.Fatalf("start %s: %v", path, err)
	}
	t.Logf("browser started in %s", time.Since(start).Round(time.Millisecond))
	return &Page{t: t, ctx: ctx}
}

// Step runs actions with a deadline of their own (a hang detector); on an
// error the test fails with the page's HTML.
func (p *Page) Step(what string, actions ...chromedp.Action) {
	p.t.Helper()
	sctx, cancel := context.WithTimeout(p.ctx, 90*time.Second)
	defer cancel()
	if err := chromedp.Run(sctx, actions...); err != nil {
		var html string
		hctx, cancel := context.WithTimeout(p.ctx, 10*time.Second)
		defer cancel()
		chromedp.Run(hctx, chromedp.OuterHTML("body", &html, chromedp.ByQuery))
		p.t.Fatalf("%s: %v\npage: %.3000s", what, err, html)
	}
}

// WaitJS polls a JavaScript condition until it holds.
func (p *Page) WaitJS(what, cond string) {
	p.t.Helper()
	var ok bool
	p.Step(what, chromedp.Poll(cond, &ok, chromedp.WithPollingInterval(100*time.Millisecond)))
}

// Login opens the dashboard at url (http://host:port) and logs in with key.
func (p *Page) Login(url, key string) {
	p.t.Helper()
	p.Step("open the login page", chromedp.Navigate(url+"/"), chromedp.WaitVisible("#login-key", chromedp.ByQuery))
	p.Step("log in", chromedp.Evaluate(`document.querySelector("#login-key").value = ""`, nil), chromedp.SendKeys("#login-key", key, chromedp.ByQuery),
		chromedp.Click("#login-submit", chromedp.ByQuery), chromedp.WaitVisible("#main-view", chromedp.ByQuery))
}

// Terminal opens the terminal of the sandbox shown, types line into it and
// waits for want on its screen, which it returns.
func (p *Page) Terminal(line, want string) string {
	p.t.Helper()
	p.Step("open the terminal", chromedp.Click("#d-terminal", chromedp.ByQuery))
	p.WaitJS("the terminal's connection", `document.querySelector("#terminal-status").textContent.startsWith("connected")`)
	// Text goes in as typed text does (an input event: SendKeys' key
	// events reach xterm.js twice, as keydown and keypress), then Enter.
	p.Step("type into the terminal", chromedp.Focus(".xterm-helper-textarea", chromedp.ByQuery),
		input.InsertText(line), chromedp.KeyEvent("\r"))
	const screen = `(() => { const b = window.shoalTerminal.buffer.active; let s = "";
		for (let i = 0; i < b.length; i++) { const l = b.getLine(i); if (l) s += l.translateToString(true) + "\n"; } return s; })()`
	p.WaitJS("the command's output in the terminal", screen+`.includes(`+jsString(want)+`)`)
	var text string
	p.Step("read the terminal", chromedp.Evaluate(screen, &text))
	return text
}

// Screenshot saves the whole page as a PNG at path and fails the test if
// it looks blank.
func (p *Page) Screenshot(path string) {
	p.t.Helper()
	var png []byte
	p.Step("take a screenshot", chromedp.FullScreenshot(&png, 100))
	if err := os.WriteFile(path, png, 0o644); err != nil {
		p.t.Fatal(err)
	}
	p.t.Logf("screenshot: %s (%d bytes)", path, len(png))
	if len(png) < 10000 {
		p.t.Fatalf("screenshot of %d bytes: blank?", len(png))
	}
}

func jsString(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`, "\n", `\n`).Replace(s) + "'"
}
