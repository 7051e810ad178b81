package session

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
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
	refuse bool // close new connections at once (an agent that does not answer)
}

// setRefuse makes the proxy close new connections at once, or not.
func (p *proxy) setRefuse(on bool) {
	p.mu.Lock()
	p.refuse = on
	p.mu.Unlock()
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
			p.mu.Lock()
			refuse := p.refuse
			p.mu.Unlock()
			if refuse {
				c.Close()
				continue
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
	paused    map[string]bool
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

func (f *fakeSandboxes) Client(id string) (*agent.Client, error) { return f.Agent(id) }
func (f *fakeSandboxes) Paused(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.paused[id]
}

func (f *fakeSandboxes) setPaused(id string, on bool) {
	f.mu.Lock()
	f.paused[id] = on
	f.mu.Unlock()
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
	return &env{t: t, db: db, sb: &fakeSandboxes{t: t, dir: dir, proxies: map[string]*proxy{}, deleting: map[string]bool{}, paused: map[string]bool{}}}
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

// waitSettled waits until the pump of an ended command has done all it
// does after the end (recorded it, applied the retention policy, told the
// agent): the agent no longer holds it.
func waitSettled(t *testing.T, p *proxy, c *Command) {
	t.Helper()
	waitFor(t, 10*time.Second, "the end of command "+c.rec.ID+" to be acknowledged", func() bool {
		return !holds(t, p, c.rec.AgentID)
	})
}

func ids(infos []Info) map[string]bool {
	out := map[string]bool{}
	for _, in := range infos {
		out[in.ID] = true
	}
	return out
}

func wantPruned(t *testing.T, m *Manager, sandboxID string, c *Command) {
	t.Helper()
	_, err := m.Get(sandboxID, c.rec.ID)
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "command "+c.rec.ID+" was pruned by the retention policy") {
		t.Errorf("Get(pruned %s) = %v, want NotFound: pruned by the retention policy", c.rec.ID, err)
	}
	if _, err := os.Stat(c.logPath); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("log of pruned command %s: %v, want it removed", c.rec.ID, err)
	}
}

// The node keeps the most recent ended commands of a sandbox, and its
// trajectory steps, running commands and shells whatever their number;
// a pruned command's ID says it was pruned, also after a restart.
func TestRetentionKeepsRecentCommandsAndTrajectorySteps(t *testing.T) {
	e := newEnv(t)
	m := e.manager(Config{KeepEnded: 3})
	p := e.sb.add("sb1")
	ctx := context.Background()

	step, _, _ := run(t, m, "sb1", StartRequest{Args: []string{"echo", "step"}, Trajectory: "traj", Step: 1})
	waitSettled(t, p, step)
	running, _, err := m.Start(ctx, "sb1", StartRequest{Args: []string{"cat"}, StdinOpen: true})
	if err != nil {
		t.Fatal(err)
	}
	var plain []*Command
	for i := range 6 {
		c, out, end := run(t, m, "sb1", StartRequest{Args: []string{"echo", fmt.Sprint(i)}})
		if out != fmt.Sprintf("%d\n", i) || end.Kind != EventExit {
			t.Fatalf("command %d: %q %+v", i, out, end)
		}
		waitSettled(t, p, c)
		plain = append(plain, c)
	}
	got := ids(m.List("sb1"))
	want := map[string]bool{step.rec.ID: true, running.rec.ID: true, plain[3].rec.ID: true, plain[4].rec.ID: true, plain[5].rec.ID: true}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("kept %v, want the trajectory step, the running command and the 3 most recent: %v", got, want)
	}
	for _, c := range plain[:3] {
		wantPruned(t, m, "sb1", c)
	}
	// The recorded step still replays.
	c, replayed, err := m.Start(ctx, "sb1", StartRequest{Args: []string{"echo", "step"}, Trajectory: "traj", Step: 1})
	if err != nil || !replayed || c.rec.ID != step.rec.ID {
		t.Fatalf("replay of step 1: %v replayed=%v", err, replayed)
	}

	// A restart with a stricter policy prunes what it no longer keeps; the
	// pruned ones still say so.
	m.Close()
	m2 := e.manager(Config{KeepEnded: 1})
	if err := m2.Recover(ctx); err != nil {
		t.Fatal(err)
	}
	got = ids(m2.List("sb1"))
	want = map[string]bool{step.rec.ID: true, running.rec.ID: true, plain[5].rec.ID: true}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after restart with keep 1: kept %v, want %v", got, want)
	}
	for _, c := range plain[:5] {
		wantPruned(t, m2, "sb1", c)
	}
	// The running command was never pruned; once it ends, it is the one kept.
	rc, err := m2.Get("sb1", running.rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := m2.SendStdin(ctx, rc, nil, true); err != nil {
		t.Fatal(err)
	}
	if in, err := m2.Wait(ctx, rc); err != nil || in.State != StateExited {
		t.Fatalf("wait: %+v %v", in, err)
	}
	waitSettled(t, p, rc)
	wantPruned(t, m2, "sb1", plain[5])

	// Deleting the sandbox forgets everything, tombstones included.
	e.sb.kill(m2, "sb1")
	if _, ok := m2.prunedRecord("sb1", plain[0].rec.ID); ok {
		t.Error("a pruned command's tombstone outlived its sandbox")
	}
}

// KeepFor prunes ended commands by age.
func TestRetentionByAge(t *testing.T) {
	e := newEnv(t)
	m := e.manager(Config{KeepFor: time.Hour})
	p := e.sb.add("sb1")
	var cs []*Command
	for range 2 {
		c, _, _ := run(t, m, "sb1", StartRequest{Args: []string{"true"}})
		waitSettled(t, p, c)
		cs = append(cs, c)
	}
	m.prune("sb1", time.Now().Add(30*time.Minute))
	if n := len(m.List("sb1")); n != 2 {
		t.Fatalf("%d commands kept within the age limit, want 2", n)
	}
	m.prune("sb1", time.Now().Add(61*time.Minute))
	if n := len(m.List("sb1")); n != 0 {
		t.Fatalf("%d commands kept past the age limit, want 0", n)
	}
	for _, c := range cs {
		wantPruned(t, m, "sb1", c)
	}
}

// A command whose sandbox is deleted under it does not end like a command
// that exited: its readers get, after its output, an error of kind
// ErrSandboxKilled naming the sandbox.
func TestSandboxKilledIsNotAnExit(t *testing.T) {
	e := newEnv(t)
	m := e.manager(Config{})
	p := e.sb.add("sbk")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, _, err := m.Start(ctx, "sbk", StartRequest{Args: []string{"sh", "-c", "echo started; exec sleep 600"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // the in-process agent outlives the "sandbox"
		agent.NewClient(p.target).SignalCommand(context.Background(), c.rec.AgentID, 9)
	})
	started := make(chan struct{})
	var once sync.Once
	var ends []Event
	errc := make(chan error, 1)
	go func() {
		errc <- m.Events(ctx, c, 0, 0, func(ev Event) error {
			switch ev.Kind {
			case EventStdout:
				once.Do(func() { close(started) })
			case EventExit, EventLost:
				ends = append(ends, ev)
			}
			return nil
		})
	}()
	waitDone := make(chan error, 1)
	go func() {
		_, err := m.Wait(ctx, c)
		waitDone <- err
	}()
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("no output")
	}
	e.sb.kill(m, "sbk")
	for _, ch := range []chan error{errc, waitDone} {
		select {
		case err := <-ch:
			if !errors.Is(err, errdefs.ErrSandboxKilled) || !strings.Contains(err.Error(), "sandbox sbk was killed") {
				t.Errorf("reader of a command whose sandbox was deleted: %v, want ErrSandboxKilled naming the sandbox", err)
			}
		case <-ctx.Done():
			t.Fatal("the reader did not end after the sandbox was deleted")
		}
	}
	if len(ends) != 0 {
		t.Errorf("end events %+v, want none (the command did not exit)", ends)
	}
	if in := c.Info(); in.State != StateLost || !in.Killed {
		t.Errorf("info %+v, want lost and killed", in)
	}
}

// TestDropSandboxForgetsItsRecords: a deleted sandbox's commands and
// trajectory steps leave the store, every one of them (a cursor that
// deletes as it walks), and another sandbox's stay.
func TestDropSandboxForgetsItsRecords(t *testing.T) {
	e := newEnv(t)
	m := e.manager(Config{})
	for _, id := range []string{"sb1", "sb2"} {
		p := e.sb.add(id)
		for i := range 5 {
			c, _, _ := run(t, m, id, StartRequest{Args: []string{"echo", fmt.Sprint(i)}, Trajectory: "t", Step: int64(i + 1)})
			waitSettled(t, p, c)
		}
	}
	count := func(id string) (n int) {
		e.db.View(func(tx *bbolt.Tx) error {
			for _, b := range [][]byte{bucketCommands, bucketTrajectories, bucketShells, bucketPruned} {
				cur := tx.Bucket(b).Cursor()
				for k, _ := cur.Seek([]byte(id + "/")); k != nil && strings.HasPrefix(string(k), id+"/"); k, _ = cur.Next() {
					n++
				}
			}
			return nil
		})
		return n
	}
	if count("sb1") < 10 || count("sb2") < 10 {
		t.Fatalf("records before: %d and %d, want 5 commands and 5 steps each", count("sb1"), count("sb2"))
	}
	e.sb.kill(m, "sb1")
	if n := count("sb1"); n != 0 {
		t.Errorf("%d records of the deleted sandbox left", n)
	}
	if n := count("sb2"); n < 10 {
		t.Errorf("the other sandbox kept %d records, want 10", n)
	}
	m.DropSandbox("sb1") // nothing left: no write
}
