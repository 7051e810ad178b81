package session

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// Shell sessions.
//
// A shell session is a durable command: an interactive shell (bash, else
// sh) under a pseudo-terminal with echo and prompts off. Running a command
// in it writes the command line, then a line that prints a marker with the
// command's exit status; the output of the run is what the log gained up to
// the marker. The shell's cwd, environment and variables carry over from one
// run to the next, as in SWE-agent or SWE-ReX. A run that times out gets a
// Ctrl-C (SIGINT to the shell's foreground job), which interrupts the
// command and not the shell.

var bucketShells = []byte("session.shells")

// DefaultShellTimeout bounds a run in a shell session when none is given.
const DefaultShellTimeout = 10 * time.Minute

var shellNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// Shell is a named shell session in a sandbox.
type Shell struct {
	SandboxID string    `json:"sandbox"`
	Name      string    `json:"name"`
	CommandID string    `json:"command"`
	Created   time.Time `json:"created"`

	run sync.Mutex // one run at a time
}

// ShellResult is the outcome of one run in a shell session.
type ShellResult struct {
	Output   string // stdout and stderr as a terminal shows them
	ExitCode int
	TimedOut bool
}

func shellKey(sandboxID, name string) []byte { return []byte(sandboxID + "/" + name) }

func (m *Manager) shellsInit() error {
	return m.db.Update(func(tx *bbolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(bucketShells)
		return err
	})
}

// CreateShell starts a named shell session.
// user is the sandbox user the shell runs as ("" = root).
func (m *Manager) CreateShell(ctx context.Context, sandboxID, name, cwd string, env []string, shell, user string) (*Shell, error) {
	if !shellNameRE.MatchString(name) {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "shell name %.80q must be 1-64 letters, digits, '.', '_' or '-'", name)
	}
	if err := limits.Argv([]string{shell}, env); err != nil {
		return nil, err
	}
	if err := limits.Path("cwd", cwd); err != nil {
		return nil, err
	}
	m.mu.Lock()
	_, exists := m.shells[string(shellKey(sandboxID, name))]
	m.mu.Unlock()
	if exists {
		return nil, errdefs.New(errdefs.ErrAlreadyExists, "sandbox %s already has a shell named %q", sandboxID, name)
	}
	ag, err := m.sb.Agent(sandboxID)
	if err != nil {
		return nil, err
	}
	var args []string
	switch shell {
	case "":
		if _, err := ag.Stat(ctx, "/bin/bash"); err == nil {
			args = []string{"/bin/bash", "--noprofile", "--norc", "--noediting", "-i"}
		} else {
			args = []string{"/bin/sh", "-i"}
		}
	case "bash", "/bin/bash":
		args = []string{"/bin/bash", "--noprofile", "--norc", "--noediting", "-i"}
	case "sh", "/bin/sh":
		args = []string{"/bin/sh", "-i"}
	default:
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "shell %q: use bash or sh", shell)
	}
	env = append(append([]string(nil), env...), "PS1=", "PS2=", "PS4=", "TERM=dumb", "HISTFILE=/dev/null", "PAGER=cat", "GIT_PAGER=cat")
	c, _, err := m.Start(ctx, sandboxID, StartRequest{
		Args: args, Env: env, Cwd: cwd, StdinOpen: true, User: user,
		PTY: &agent.Winsize{Rows: 50, Cols: 250},
	})
	if err != nil {
		return nil, err
	}
	sh := &Shell{SandboxID: sandboxID, Name: name, CommandID: c.Info().ID, Created: time.Now().UTC()}
	// Quiet the terminal, then wait for the shell to answer once.
	setup := "stty -echo -onlcr 2>/dev/null; unset PROMPT_COMMAND; PS1=''; PS2=''\n"
	if err := m.SendStdin(ctx, c, []byte(setup), false); err != nil {
		m.Signal(context.Background(), c, syscall.SIGKILL)
		return nil, err
	}
	if _, err := m.runInShell(ctx, sh, c, "true", 30*time.Second); err != nil {
		m.Signal(context.Background(), c, syscall.SIGKILL)
		return nil, fmt.Errorf("start shell %s: %w", name, err)
	}
	b, _ := json.Marshal(sh)
	if err := m.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketShells).Put(shellKey(sandboxID, name), b)
	}); err != nil {
		m.Signal(context.Background(), c, syscall.SIGKILL)
		return nil, err
	}
	m.mu.Lock()
	m.shells[string(shellKey(sandboxID, name))] = sh
	m.mu.Unlock()
	return sh, nil
}

func (m *Manager) shell(sandboxID, name string) (*Shell, *Command, error) {
	m.mu.Lock()
	sh := m.shells[string(shellKey(sandboxID, name))]
	m.mu.Unlock()
	if sh == nil {
		return nil, nil, errdefs.New(errdefs.ErrNotFound, "no shell %q in sandbox %s", name, sandboxID)
	}
	c, err := m.Get(sandboxID, sh.CommandID)
	if err != nil {
		return nil, nil, err
	}
	return sh, c, nil
}

// RunInShell runs a command line in a shell session and returns its output
// and exit code. On timeout the command is interrupted (Ctrl-C); the shell
// stays.
func (m *Manager) RunInShell(ctx context.Context, sandboxID, name, command string, timeout time.Duration) (ShellResult, error) {
	if strings.TrimSpace(command) == "" {
		return ShellResult{}, errdefs.New(errdefs.ErrInvalidArgument, "a command is required")
	}
	if err := limits.String("command", command, limits.CommandBytes); err != nil {
		return ShellResult{}, err
	}
	if err := limits.Duration("timeout", timeout, 0, limits.CommandTimeout); err != nil {
		return ShellResult{}, err
	}
	if timeout <= 0 {
		timeout = DefaultShellTimeout
	}
	sh, c, err := m.shell(sandboxID, name)
	if err != nil {
		return ShellResult{}, err
	}
	sh.run.Lock()
	defer sh.run.Unlock()
	return m.runInShell(ctx, sh, c, command, timeout)
}

func (m *Manager) runInShell(ctx context.Context, sh *Shell, c *Command, command string, timeout time.Duration) (ShellResult, error) {
	if c.Info().State != StateRunning {
		return ShellResult{}, errdefs.New(errdefs.ErrFailedPrecondition, "shell %q has exited; delete it and create a new one", sh.Name)
	}
	c.mu.Lock()
	from := c.size
	c.mu.Unlock()
	marker := "__SHOAL_" + newCommandID() + "_RC="
	line := shellLine(command) + "printf '\\n" + marker + "%d\\n' $?\n"
	if err := m.SendStdin(ctx, c, []byte(line), false); err != nil {
		return ShellResult{}, err
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	out, code, err := m.readUntilMarker(rctx, c, from, marker)
	if err == nil {
		return ShellResult{Output: out, ExitCode: code}, nil
	}
	if ctx.Err() != nil || rctx.Err() == nil {
		return ShellResult{}, err
	}
	// Timed out: interrupt the foreground job, as a user would with Ctrl-C,
	// then resynchronize with a fresh marker (typed-ahead input was
	// flushed by the interrupt).
	m.SendStdin(ctx, c, []byte{3}, false)
	time.Sleep(50 * time.Millisecond)
	marker2 := "__SHOAL_" + newCommandID() + "_RC="
	m.SendStdin(ctx, c, []byte("\nprintf '\\n"+marker2+"%d\\n' $?\n"), false)
	sctx, cancel2 := context.WithTimeout(ctx, 10*time.Second)
	defer cancel2()
	out, code, err = m.readUntilMarker(sctx, c, from, marker2)
	if err != nil {
		return ShellResult{TimedOut: true, ExitCode: 124}, nil
	}
	// Drop the first marker's line if the shell printed it after all.
	if i := strings.Index(out, "\n"+marker); i >= 0 {
		out = out[:i]
	}
	if code == 0 {
		code = 130
	}
	return ShellResult{Output: out, ExitCode: code, TimedOut: true}, nil
}

// shellLine is what a run writes to its shell for command: the command
// in a group whose stdin is /dev/null, so that a command that reads its
// input gets an end of file instead of the lines the run writes after it
// (the marker, which it consumed: only the run's timeout ended it). A
// group, not a subshell: cd, variables and functions carry over. The
// newline before "}" ends a last line that has no ";" (or is a comment).
func shellLine(command string) string {
	if strings.TrimSpace(command) == "" {
		return "\n"
	}
	return "{ " + strings.TrimSuffix(command, "\n") + "\n} </dev/null\n"
}

// readUntilMarker reads the shell's output from offset from until a line
// "<marker><code>" and returns what came before it.
func (m *Manager) readUntilMarker(ctx context.Context, c *Command, from int64, marker string) (string, int, error) {
	var buf bytes.Buffer
	errFound := fmt.Errorf("found")
	var code int
	var out string
	err := m.Events(ctx, c, from, 0, func(ev Event) error {
		switch ev.Kind {
		case EventStdout, EventStderr:
			buf.Write(ev.Data)
		case EventExit, EventLost:
			return errdefs.New(errdefs.ErrFailedPrecondition, "the shell exited")
		default:
			return nil
		}
		s := buf.String()
		i := strings.Index(s, "\n"+marker)
		if i < 0 {
			return nil
		}
		rest := s[i+1+len(marker):]
		j := strings.IndexByte(rest, '\n')
		if j < 0 {
			return nil
		}
		n, perr := strconv.Atoi(strings.TrimSpace(rest[:j]))
		if perr != nil {
			return nil
		}
		out, code = strings.ReplaceAll(s[:i], "\r\n", "\n"), n
		return errFound
	})
	if err == errFound {
		return out, code, nil
	}
	if err == nil {
		err = errdefs.New(errdefs.ErrFailedPrecondition, "the shell exited")
	}
	return "", 0, err
}

// ListShells returns a sandbox's shell sessions.
func (m *Manager) ListShells(sandboxID string) []*Shell {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*Shell
	for _, sh := range m.shells {
		if sh.SandboxID == sandboxID {
			out = append(out, sh)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// DeleteShell kills a shell session's shell and forgets it.
func (m *Manager) DeleteShell(ctx context.Context, sandboxID, name string) error {
	sh, c, err := m.shell(sandboxID, name)
	if err != nil {
		return err
	}
	if c.Info().State == StateRunning {
		m.Signal(ctx, c, syscall.SIGKILL)
	}
	m.mu.Lock()
	delete(m.shells, string(shellKey(sandboxID, sh.Name)))
	m.mu.Unlock()
	return m.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketShells).Delete(shellKey(sandboxID, name))
	})
}

// recoverShells loads the shell sessions after a restart.
func (m *Manager) recoverShells() error {
	return m.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketShells).ForEach(func(k, v []byte) error {
			sh := new(Shell)
			if json.Unmarshal(v, sh) != nil {
				return nil
			}
			m.mu.Lock()
			m.shells[string(k)] = sh
			m.mu.Unlock()
			return nil
		})
	})
}
