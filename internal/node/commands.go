package node

import (
	"context"
	"fmt"
	"sync"
	"syscall"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Command is a process running in a sandbox, registered under an ID so that
// other calls (stdin, signals) can reach it while its output streams.
//
// In this version a command lives as long as the call that started it: when
// that call ends, the agent kills the command's process group.
type Command struct {
	ID        string
	SandboxID string
	proc      *agent.Process
}

// Recv returns the command's next output or exit event; see agent.Process.
func (c *Command) Recv() (agent.Event, error) { return c.proc.Recv() }

// Pid is the command's process ID inside the sandbox.
func (c *Command) Pid() int { return c.proc.Pid() }

// WriteStdin writes to the command's stdin; close closes it afterwards.
func (c *Command) WriteStdin(b []byte, close bool) error {
	if len(b) > 0 {
		if err := c.proc.WriteStdin(b); err != nil {
			return err
		}
	}
	if close {
		return c.proc.CloseStdin()
	}
	return nil
}

// Signal sends sig to the command's process group.
func (c *Command) Signal(sig syscall.Signal) error { return c.proc.Signal(sig) }

// commands indexes the live commands of all sandboxes.
type commands struct {
	mu   sync.Mutex          // guards byID
	byID map[string]*Command // key: sandboxID + "/" + commandID
}

func (c *commands) init() { c.byID = map[string]*Command{} }

func (c *commands) add(cmd *Command) {
	c.mu.Lock()
	c.byID[cmd.SandboxID+"/"+cmd.ID] = cmd
	c.mu.Unlock()
}

func (c *commands) remove(cmd *Command) {
	c.mu.Lock()
	delete(c.byID, cmd.SandboxID+"/"+cmd.ID)
	c.mu.Unlock()
}

func (c *commands) dropSandbox(id string) {
	c.mu.Lock()
	for k, cmd := range c.byID {
		if cmd.SandboxID == id {
			delete(c.byID, k)
		}
	}
	c.mu.Unlock()
}

// Exec starts a command in a running sandbox. The caller must call
// FinishCommand when it stops reading the command (that also kills it if it
// is still running). While a command runs, the sandbox is never idle.
func (m *Manager) Exec(ctx context.Context, sandboxID string, req agent.ExecRequest) (*Command, error) {
	if len(req.Args) == 0 {
		return nil, errdefs.New(ErrInvalid, "a command is required")
	}
	a, err := m.Agent(sandboxID)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	if e, ok := m.sandboxes[sandboxID]; ok {
		e.running++
	}
	m.mu.Unlock()
	proc, err := a.Exec(ctx, req)
	if err != nil {
		m.endCommand(sandboxID)
		return nil, fmt.Errorf("exec %q in sandbox %s: %w", req.Args[0], sandboxID, err)
	}
	cmd := &Command{ID: newID()[:12], SandboxID: sandboxID, proc: proc}
	m.cmds.add(cmd)
	return cmd, nil
}

// FinishCommand unregisters a command and closes its connection.
func (m *Manager) FinishCommand(cmd *Command) {
	m.cmds.remove(cmd)
	cmd.proc.Close()
	m.endCommand(cmd.SandboxID)
}

func (m *Manager) endCommand(sandboxID string) {
	m.mu.Lock()
	if e, ok := m.sandboxes[sandboxID]; ok {
		e.running--
		m.touchLocked(e)
	}
	m.mu.Unlock()
}

// Command finds a running command.
func (m *Manager) Command(sandboxID, commandID string) (*Command, error) {
	if _, err := m.Get(sandboxID); err != nil {
		return nil, err
	}
	m.cmds.mu.Lock()
	defer m.cmds.mu.Unlock()
	cmd, ok := m.cmds.byID[sandboxID+"/"+commandID]
	if !ok {
		return nil, errdefs.New(ErrNotFound, "no running command %q in sandbox %s", commandID, sandboxID)
	}
	return cmd, nil
}
