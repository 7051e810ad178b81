package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/agent"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// agentOf returns a client of a sandbox's guest agent, found by its socket
// under the data directory (a cold create's sandbox directory, or a claimed
// pool member's).
func agentOf(t *testing.T, id string) *agent.Client {
	t.Helper()
	for _, pat := range []string{"sandboxes/%s/agent.sock", "*/*/%s/agent.sock", "*/*/*/%s/agent.sock"} {
		if m, _ := filepath.Glob(filepath.Join(dataDir, fmt.Sprintf(pat, id))); len(m) == 1 {
			return agent.NewClient(m[0])
		}
	}
	t.Fatalf("no agent socket for sandbox %s under %s", id, dataDir)
	return nil
}

// waitFor polls cond until it holds, failing the test after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if !eventually(timeout, cond) {
		t.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
}

// Issue 10: the guest agent kept every command run with a streamed Exec,
// because the stream's end closed the command's attachment before the node
// told the agent it had recorded the end. Once the node has, the agent
// holds nothing of the command.
func TestAgentForgetsCommandsTheNodeRecorded(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	ag := agentOf(t, id)
	const n = 300
	for i := range n {
		var out bytes.Buffer
		st, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"echo", fmt.Sprint(i)}, Stdout: &out})
		if err != nil || st.Code != 0 || out.String() != fmt.Sprintf("%d\n", i) {
			t.Fatalf("exec %d: %v %+v %q", i, err, st, out.String())
		}
	}
	var held []agent.CommandInfo
	waitFor(t, 15*time.Second, "the agent to forget the commands whose end the node recorded", func() bool {
		var err error
		if held, err = ag.Commands(ctx); err != nil {
			t.Fatal(err)
		}
		return len(held) == 0
	})
	info, err := ag.PingAtRest(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after %d streamed commands the agent holds none; RSS at rest %d KiB", n, info.RSSBytes>>10)
}

// A command whose sandbox is deleted under it does not end as an exit: the
// stream ends with ErrSandboxKilled (NotFound, naming the sandbox).
func TestKilledSandboxCommandIsNotAnExit(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	started := make(chan string, 1)
	type result struct {
		st  shoal.ExitStatus
		err error
	}
	done := make(chan result, 1)
	out := &notifyWriter{seen: make(chan struct{})}
	go func() {
		st, err := c.Exec(ctx, id, shoal.ExecOptions{
			Args:    []string{"sh", "-c", "echo started; exec sleep 600"},
			Stdout:  out,
			OnStart: func(cid string) { started <- cid },
		})
		done <- result{st, err}
	}()
	var cmdID string
	select {
	case cmdID = <-started:
	case <-ctx.Done():
		t.Fatal("the command did not start")
	}
	select {
	case <-out.seen:
	case <-ctx.Done():
		t.Fatal("no output")
	}
	if _, code := run(nil, "rm", id); code != 0 {
		t.Fatal("rm failed")
	}
	var r result
	select {
	case r = <-done:
	case <-ctx.Done():
		t.Fatal("Exec did not return after its sandbox was deleted")
	}
	if !errors.Is(r.err, shoal.ErrSandboxKilled) || connect.CodeOf(r.err) != connect.CodeNotFound || !strings.Contains(r.err.Error(), id) {
		t.Fatalf("Exec of a command whose sandbox was deleted: %+v, %v; want ErrSandboxKilled (not_found) naming %s", r.st, r.err, id)
	}
	var ke *shoal.SandboxKilledError
	if !errors.As(r.err, &ke) {
		t.Fatalf("%T is not a *SandboxKilledError", r.err)
	}
	if r.st.CommandID != cmdID || r.st.Code != 0 || r.st.Signal != "" {
		t.Errorf("status %+v: want the command's ID and no exit", r.st)
	}
}

// notifyWriter closes seen on the first write.
type notifyWriter struct {
	seen chan struct{}
	once bool
}

func (w *notifyWriter) Write(b []byte) (int, error) {
	if !w.once {
		w.once = true
		close(w.seen)
	}
	return len(b), nil
}
