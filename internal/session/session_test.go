package session

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// The tests run the session layer against a real guest agent, in process
// (one per test binary: it owns SIGCHLD), reached through a proxy per
// sandbox that lets a test see connections close and cut them all, as a
// sandbox's death does.

var (
	agentOnce sync.Once
	agentSock string
)

func agentServer(t *testing.T) string {
	t.Helper()
	agentOnce.Do(func() {
		dir, err := os.MkdirTemp("", "sag")
		if err != nil {
			t.Fatal(err)
		}
		agentSock = filepath.Join(dir, "s")
		l, err := net.Listen("unix", agentSock)
		if err != nil {
			t.Fatal(err)
		}
		go agent.NewServer(agent.Config{}).Serve(l)
	})
	return agentSock
}

// proxy forwards a unix socket to the agent's.
type proxy struct {
	sock, target string
	l            net.Listener

	mu     sync.Mutex
	conns  []*proxyConn
	added  chan struct{} // closed and replaced when a connection arrives
	closed bool
}

type proxyConn struct {
	client, server net.Conn
	clientGone     chan struct{} // closed once the client closed its end
}

func startProxy(t *testing.T, target string) *proxy {
	t.Helper()
	dir, err := os.MkdirTemp("", "spx")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p := &proxy{sock: filepath.Join(dir, "s"), target: target, added: make(chan struct{})}
	if p.l, err = net.Listen("unix", p.sock); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	go func() {
		for {
			c, err := p.l.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("unix", target)
			if err != nil {
				c.Close()
				continue
			}
			pc := &proxyConn{client: c, server: s, clientGone: make(chan struct{})}
			p.mu.Lock()
			if p.closed {
				p.mu.Unlock()
				c.Close()
				s.Close()
				return
			}
			p.conns = append(p.conns, pc)
			close(p.added)
			p.added = make(chan struct{})
			p.mu.Unlock()
			go func() {
				io.Copy(s, c)
				close(pc.clientGone)
				s.(*net.UnixConn).CloseWrite()
			}()
			go func() {
				io.Copy(c, s)
				c.(*net.UnixConn).CloseWrite()
			}()
		}
	}()
	return p
}

// conn returns the i-th connection (0-based), waiting for it.
func (p *proxy) conn(t *testing.T, i int) *proxyConn {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		p.mu.Lock()
		if i < len(p.conns) {
			c := p.conns[i]
			p.mu.Unlock()
			return c
		}
		added := p.added
		p.mu.Unlock()
		select {
		case <-added:
		case <-deadline:
			t.Fatalf("no connection %d to the agent", i)
		}
	}
}

// Close cuts every connection and refuses new ones.
func (p *proxy) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	p.l.Close()
	for _, c := range p.conns {
		c.client.Close()
		c.server.Close()
	}
}

// fakeSandboxes is the node as the session layer sees it.
type fakeSandboxes struct {
	t   *testing.T
	dir string

	mu        sync.Mutex
	proxies   map[string]*proxy
	deleting  map[string]bool
	onRelease func(sandboxID string) // called by a Hold's release
}

func (f *fakeSandboxes) add(id string) *proxy {
	p := startProxy(f.t, agentServer(f.t))
	f.mu.Lock()
	f.proxies[id] = p
	f.mu.Unlock()
	if err := os.MkdirAll(filepath.Join(f.dir, id), 0o700); err != nil {
		f.t.Fatal(err)
	}
	return p
}

func (f *fakeSandboxes) Agent(id string) (*agent.Client, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.proxies[id]
	if !ok || f.deleting[id] {
		return nil, errdefs.New(errdefs.ErrNotFound, "no sandbox %s on this node", id)
	}
	return agent.NewClient(p.sock), nil
}

func (f *fakeSandboxes) SandboxDir(id string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.proxies[id]; !ok {
		return "", errdefs.New(errdefs.ErrNotFound, "no sandbox %s on this node", id)
	}
	return filepath.Join(f.dir, id), nil
}

func (f *fakeSandboxes) Hold(id string) (func(), error) {
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			fn := f.onRelease
			f.mu.Unlock()
			if fn != nil {
				fn(id)
			}
		})
	}, nil
}

func (f *fakeSandboxes) Deleting(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.proxies[id]
	return !ok || f.deleting[id]
}

// kill deletes a sandbox as the node does: it is marked deleting, its
// agent dies (every connection cut), then the session layer is told.
func (f *fakeSandboxes) kill(m *Manager, id string) {
	f.mu.Lock()
	f.deleting[id] = true
	p := f.proxies[id]
	f.mu.Unlock()
	p.Close()
	f.mu.Lock()
	delete(f.proxies, id)
	delete(f.deleting, id)
	f.mu.Unlock()
	os.RemoveAll(filepath.Join(f.dir, id))
	m.DropSandbox(id)
}

type env struct {
	t  *testing.T
	db *bbolt.DB
	sb *fakeSandboxes
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	db, err := bbolt.Open(filepath.Join(dir, "shoal.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.MaxBatchDelay = time.Millisecond
	return &env{t: t, db: db, sb: &fakeSandboxes{t: t, dir: dir, proxies: map[string]*proxy{}, deleting: map[string]bool{}}}
}

func (e *env) manager(cfg Config) *Manager {
	e.t.Helper()
	m, err := New(cfg, e.db, e.sb, slog.New(slog.NewTextHandler(testWriter{e.t}, nil)))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(m.Close)
	return m
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Logf("%s", b)
	return len(b), nil
}

// run starts a command and reads it to its end; it returns the command,
// its stdout and the end event.
func run(t *testing.T, m *Manager, sandboxID string, req StartRequest) (*Command, string, Event) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, _, err := m.Start(ctx, sandboxID, req)
	if err != nil {
		t.Fatal(err)
	}
	var out []byte
	var end Event
	if err := m.Events(ctx, c, 0, 0, func(ev Event) error {
		switch ev.Kind {
		case EventStdout:
			out = append(out, ev.Data...)
		case EventExit, EventLost:
			end = ev
		}
		return nil
	}); err != nil {
		t.Fatalf("events of %q: %v", req.Args, err)
	}
	return c, string(out), end
}

// waitFor polls cond until it holds, failing the test after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// agentHolds lists the commands the agent still holds.
func agentHolds(t *testing.T, p *proxy) []agent.CommandInfo {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	infos, err := agent.NewClient(p.target).Commands(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return infos
}

func holds(t *testing.T, p *proxy, agentID string) bool {
	for _, in := range agentHolds(t, p) {
		if in.ID == agentID {
			return true
		}
	}
	return false
}

// A streamed Exec returns as soon as its client has the exit, while the
// pump is still recording the end. The request ending must not close the
// attachment the command was started with before the pump has told the
// agent the end is recorded: the agent would keep the command for ever.
func TestEndReachesAgentAfterTheRequestEnds(t *testing.T) {
	e := newEnv(t)
	m := e.manager(Config{})
	p := e.sb.add("sb1")
	// Hold the pump between recording the end and acknowledging it.
	released := make(chan struct{})
	e.sb.onRelease = func(string) { <-released }

	reqCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c, _, err := m.Start(reqCtx, "sb1", StartRequest{Args: []string{"echo", "hi"}})
	if err != nil {
		t.Fatal(err)
	}
	started := p.conn(t, 0) // the connection the command was started on
	agentID := c.rec.AgentID
	// The handler: stream to the exit, then return (its context ends).
	if err := m.Events(reqCtx, c, 0, 0, func(ev Event) error {
		if ev.Kind == EventExit {
			cancel()
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// Let the pump go on once the request's end has closed that
	// connection (the bug), or once it had ample time to.
	select {
	case <-started.clientGone:
		t.Log("the request's end closed the attachment before the end was acknowledged")
	case <-time.After(300 * time.Millisecond):
	}
	close(released)
	waitFor(t, 10*time.Second, fmt.Sprintf("the agent to forget command %s once its end is recorded", agentID), func() bool {
		return !holds(t, p, agentID)
	})
}
