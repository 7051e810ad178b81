package node

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// fakeBackend recovers every sandbox as running and creates none.
type fakeBackend struct{}

func (fakeBackend) Name() string                       { return "fake" }
func (fakeBackend) Capabilities() sandbox.Capabilities { return sandbox.Capabilities{} }
func (fakeBackend) Create(context.Context, sandbox.Spec) (sandbox.Handle, error) {
	return sandbox.Handle{}, sandbox.ErrUnsupported
}
func (fakeBackend) Recover(context.Context, sandbox.Handle) (sandbox.Status, error) {
	return sandbox.StatusRunning, nil
}
func (fakeBackend) Delete(context.Context, sandbox.Handle) error { return nil }

// newTestManager opens a manager over a fresh store with the fake backend,
// and persists a running sandbox record for each socket.
func newTestManager(t *testing.T, sockets ...string) (*Manager, *bbolt.DB, []string) {
	t.Helper()
	return newTestManagerWith(t, fakeBackend{}, Config{}, sockets...)
}

// newTestManagerWith is newTestManager with backend be (named "fake") and
// cfg (DataDir, AgentBinary and DefaultBackend are filled in).
func newTestManagerWith(t *testing.T, be sandbox.Backend, cfg Config, sockets ...string) (*Manager, *bbolt.DB, []string) {
	t.Helper()
	dir := t.TempDir()
	db, err := bbolt.Open(filepath.Join(dir, "shoal.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	layers, err := layer.Open(filepath.Join(dir, "layers"), db, log)
	if err != nil {
		t.Fatal(err)
	}
	agentBin := filepath.Join(dir, "shoal-agent")
	os.WriteFile(agentBin, nil, 0o755)
	cfg.DataDir, cfg.AgentBinary, cfg.DefaultBackend = dir, agentBin, "fake"
	m, err := New(cfg, db, layers, []sandbox.Backend{be}, log)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	now := time.Now().UTC()
	for _, sock := range sockets {
		id := newID()
		rec := Record{
			ID: id, Backend: "fake", State: StateRunning, Timeout: time.Hour, Created: now, Expires: now.Add(time.Hour),
			Handle: sandbox.Handle{ID: id, Backend: "fake", AgentSocket: sock},
		}
		if err := db.Update(func(tx *bbolt.Tx) error { return putRecord(tx, &rec) }); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	return m, db, ids
}

// listen binds a unix socket in a short directory.
func listen(t *testing.T) (*net.UnixListener, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "nd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, sock
}

func waitState(t *testing.T, m *Manager, id string, want State, within time.Duration) Record {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		rec, err := m.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		if rec.State == want {
			return rec
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s is %s (%s) after %s, want %s", id, rec.State, rec.Error, within, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRecoverDoesNotWaitForAgents: after a restart, a sandbox whose agent
// does not answer (its socket accepts nothing, as a stopped or traced
// agent's) neither delays Recover nor the others; Run shows it in error
// while it does not answer, keeps it running in the store, and returns it
// to running when it answers again.
func TestRecoverDoesNotWaitForAgents(t *testing.T) {
	wedged, wedgedSock := listen(t) // never accepts, for now
	healthy, healthySock := listen(t)
	srv := agent.NewServer(agent.Config{})
	go srv.Serve(healthy)
	m, db, ids := newTestManager(t, wedgedSock, healthySock)
	wedgedID, healthyID := ids[0], ids[1]

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Recover used to wait on the wedged agent for ever: a deadline far
	// above a loaded host's time tells the two apart.
	done := make(chan error, 1)
	go func() { done <- m.Recover(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Recover waits for an agent that does not answer")
	}
	for _, id := range ids {
		if rec, _ := m.Get(id); rec.State != StateRunning {
			t.Errorf("sandbox %s recovered as %s, want running", id, rec.State)
		}
	}
	go m.Run(ctx)

	rec := waitState(t, m, wedgedID, StateError, agentCheckTimeout+5*time.Second)
	if !strings.Contains(rec.Error, "has not answered since the node restarted") {
		t.Errorf("error %q", rec.Error)
	}
	if _, err := m.Agent(wedgedID); !errors.Is(err, ErrNotRunning) || !strings.Contains(err.Error(), "has not answered") {
		t.Errorf("Agent of the wedged sandbox: %v", err)
	}
	ag, err := m.Agent(healthyID)
	if err != nil {
		t.Fatal(err)
	}
	pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
	_, err = ag.Ping(pctx)
	pcancel()
	if err != nil {
		t.Errorf("the healthy sandbox: %v", err)
	}
	if rec, _ := m.Get(healthyID); rec.State != StateRunning {
		t.Errorf("healthy sandbox %s", rec.State)
	}

	// Still running in the store, whatever writes it meanwhile: the next
	// start checks it afresh.
	if _, err := m.SetTimeout(wedgedID, 2*time.Hour); err != nil {
		t.Fatal(err)
	}
	m.flush()
	recs, err := loadRecords(db)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r.State != StateRunning || r.Error != "" {
			t.Errorf("stored sandbox %s: %s %q, want running", r.ID, r.State, r.Error)
		}
	}

	// It answers again.
	go agent.NewServer(agent.Config{}).Serve(wedged)
	waitState(t, m, wedgedID, StateRunning, agentCheckTimeout+agentRecheckMax/4)
	if _, err := m.Agent(wedgedID); err != nil {
		t.Errorf("Agent after it answered: %v", err)
	}
}

// TestUnresponsiveSandboxDeleted: a sandbox whose agent does not answer can
// be deleted, and its check ends.
func TestUnresponsiveSandboxDeleted(t *testing.T) {
	_, sock := listen(t)
	m, _, ids := newTestManager(t, sock)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := m.Recover(ctx); err != nil {
		t.Fatal(err)
	}
	go m.Run(ctx)
	waitState(t, m, ids[0], StateError, agentCheckTimeout+5*time.Second)
	if err := m.Delete(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Get(ids[0]); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get after Delete: %v", err)
	}
}
