package session

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/agent"
)

// stuckSandboxes has one sandbox, whose agent listens at sock.
type stuckSandboxes struct {
	id, dir, sock string
}

func (f *stuckSandboxes) Agent(id string) (*agent.Client, error)  { return agent.NewClient(f.sock), nil }
func (f *stuckSandboxes) SandboxDir(id string) (string, error)    { return f.dir, nil }
func (f *stuckSandboxes) Hold(id string) (func(), error)          { return func() {}, nil }
func (f *stuckSandboxes) Deleting(id string) bool                 { return false }
func (f *stuckSandboxes) Client(id string) (*agent.Client, error) { return f.Agent(id) }
func (f *stuckSandboxes) Paused(id string) bool                   { return false }

// TestRecoverDoesNotWaitForAgents: a sandbox whose agent does not answer
// (its socket accepts nothing, as a stopped or traced agent's) does not
// delay Recover: re-attaching its running command and looking for orphan
// commands happen in the background.
func TestRecoverDoesNotWaitForAgents(t *testing.T) {
	dir, err := os.MkdirTemp("", "ss")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close() // never accepts
	os.MkdirAll(filepath.Join(dir, "logs"), 0o700)
	db, err := bbolt.Open(filepath.Join(dir, "shoal.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	sb := &stuckSandboxes{id: "sandbox", dir: dir, sock: sock}
	m, err := New(Config{}, db, sb, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	rec := record{ID: "cmd1", SandboxID: sb.id, AgentID: "a-1", Args: []string{"sleep", "1000"}, State: StateRunning, Started: time.Now().UTC()}
	if err := db.Update(func(tx *bbolt.Tx) error { return putRecord(tx, &rec) }); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "logs", rec.ID+".log"), nil, 0o600)

	done := make(chan error, 1)
	go func() { done <- m.Recover(context.Background()) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Recover waits for an agent that does not answer")
	}
	c, err := m.Get(sb.id, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if st := c.Info().State; st != StateRunning {
		t.Errorf("command %s after Recover, want running (its pump waits for the agent)", st)
	}
}

// TestOrphanSearchSparesNewCommands: after a restart, the search for
// commands the node never recorded must not take a command started since
// for one. The sandbox is paused at the restart (its agent does not
// answer), a request resumes it and starts a command, and the search that
// follows must leave that command running (it killed it: "command lost",
// seen in TestPauseResume under load).
func TestOrphanSearchSparesNewCommands(t *testing.T) {
	e := newEnv(t)
	p := e.sb.add("sb1")
	m := e.manager(Config{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	old, _, err := m.Start(ctx, "sb1", StartRequest{Args: []string{"cat"}, StdinOpen: true})
	if err != nil {
		t.Fatal(err)
	}
	m.Close()

	// The restart, with the sandbox paused: its agent does not answer.
	e.sb.setPaused("sb1", true)
	p.setRefuse(true)
	m2 := e.manager(Config{})
	if err := m2.Recover(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // the search's first try, refused
	// A request resumes it and starts a command.
	e.sb.setPaused("sb1", false)
	p.setRefuse(false)
	fresh, _, err := m2.Start(ctx, "sb1", StartRequest{Args: []string{"cat"}, StdinOpen: true})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the orphan search to end", func() bool { return !m2.orphanSearchPending("sb1") })
	for _, c := range []*Command{fresh, old} {
		c, err := m2.Get("sb1", c.rec.ID)
		if err != nil {
			t.Fatal(err)
		}
		if err := m2.SendStdin(ctx, c, []byte("still here\n"), true); err != nil {
			t.Fatalf("stdin of %s: %v", c.rec.ID, err)
		}
		in, err := m2.Wait(ctx, c)
		if err != nil || in.State != StateExited || in.Exit == nil || in.Exit.Code != 0 {
			t.Fatalf("command %s after the orphan search: %+v %v, want exited 0 (it was taken for an orphan)", c.rec.ID, in, err)
		}
		waitSettled(t, p, c) // its end recorded: nothing of it runs on
	}
}
