package agent

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"
)

// ExecRequest describes a command to start in the sandbox.
type ExecRequest struct {
	Args    []string      // argv; Args[0] is looked up in PATH of the merged env if it has no slash
	Env     []string      // KEY=VALUE, appended to (overriding) the agent's own environment
	Cwd     string        // default "/"
	Stdin   bool          // true: stdin is a pipe fed by WriteStdin/CloseStdin; false: /dev/null
	Timeout time.Duration // 0 = none; on expiry the process group gets SIGKILL and Exit.TimedOut is set
	// User: run as this user of the sandbox (see Client.AsUser); "" = the
	// client's user.
	User string
}

func (c *Client) userOf(req *ExecRequest) string {
	if req.User != "" {
		return req.User
	}
	return c.user
}

// EventKind says what an Event carries.
type EventKind uint8

const (
	EventStdout EventKind = 1
	EventStderr EventKind = 2
	EventExit   EventKind = 3
)

func (k EventKind) String() string {
	switch k {
	case EventStdout:
		return "stdout"
	case EventStderr:
		return "stderr"
	case EventExit:
		return "exit"
	}
	return fmt.Sprintf("event%d", uint8(k))
}

// ExitStatus is how a command ended.
type ExitStatus struct {
	Code     int    // exit code, or 128+signo when killed by a signal
	Signal   string // name of the killing signal ("SIGKILL"), or ""
	TimedOut bool   // killed because ExecRequest.Timeout expired
	Dropped  int64  // durable commands: output bytes dropped past the log cap
}

// Event is one item of a command's output stream.
type Event struct {
	Kind EventKind
	Data []byte     // EventStdout, EventStderr; owned by the caller
	Exit ExitStatus // EventExit
}

// Process is a running command. Recv must be called from one goroutine at a
// time; WriteStdin and CloseStdin may be called concurrently with Recv;
// Close may be called at any time, also to abort a blocked Recv.
type Process struct {
	client *Client
	cc     *clientConn
	id     string
	pid    int

	wmu sync.Mutex // serializes WriteStdin and CloseStdin

	exited bool // owned by the Recv caller
}

// Exec starts a command and returns once it is running. A command that
// cannot start (no such executable, bad cwd) is an *Error wrapping
// fs.ErrNotExist, fs.ErrPermission or fs.ErrInvalid. ctx bounds the life of
// the returned Process: when it is done the connection is closed and the
// agent kills the command's process group.
func (c *Client) Exec(ctx context.Context, req ExecRequest) (*Process, error) {
	name := ""
	if len(req.Args) > 0 {
		name = req.Args[0]
	}
	cc, err := c.open(ctx, OpExec, name, wireExecRequest{
		Args: req.Args, Env: req.Env, Cwd: req.Cwd, Stdin: req.Stdin, TimeoutNs: int64(req.Timeout),
		User: c.userOf(&req),
	})
	if err != nil {
		return nil, err
	}
	var rep wireExecReply
	if err := cc.readReply(&rep); err != nil {
		cc.close()
		return nil, err
	}
	return &Process{client: c, cc: cc, id: rep.ID, pid: rep.Pid}, nil
}

// Pid is the command's pid inside the sandbox (also its process group ID).
func (p *Process) Pid() int { return p.pid }

// ID is the agent's command ID: the handle of the command as a server-side
// object (used by Signal now, and by re-attach later).
func (p *Process) ID() string { return p.id }

// Recv returns the next event: stdout and stderr chunks in the order each
// stream produced them, then exactly one EventExit, then io.EOF. If the
// connection breaks first, the error wraps io.ErrUnexpectedEOF (or ctx's
// error, if ctx ended it).
func (p *Process) Recv() (Event, error) {
	if p.exited {
		return Event{}, io.EOF
	}
	typ, payload, err := readFrame(p.cc)
	if err != nil {
		return Event{}, p.cc.wrapErr(fmt.Errorf("connection lost before the exit status: %w", unexpectedEOF(err)))
	}
	switch typ {
	case FrameStdout:
		return Event{Kind: EventStdout, Data: payload}, nil
	case FrameStderr:
		return Event{Kind: EventStderr, Data: payload}, nil
	case FrameExit:
		var w wireExit
		if err := json.Unmarshal(payload, &w); err != nil {
			return Event{}, p.cc.protoErr("bad exit status: " + err.Error())
		}
		p.exited = true
		p.cc.close()
		return Event{Kind: EventExit, Exit: ExitStatus(w)}, nil
	case FrameError:
		return Event{}, p.cc.agentErr(payload)
	}
	return Event{}, p.cc.protoErr(fmt.Sprintf("unexpected frame %q", typ))
}

// WriteStdin sends b to the command's stdin (ExecRequest.Stdin must be set;
// otherwise the agent drops it). It blocks while the command does not read.
func (p *Process) WriteStdin(b []byte) error {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	var hdr [headerSize]byte
	hdr[0] = FrameData
	for len(b) > 0 {
		n := min(len(b), MaxDataChunk)
		binary.BigEndian.PutUint32(hdr[1:], uint32(n))
		bufs := net.Buffers{hdr[:], b[:n]} // one writev, no copy
		if _, err := bufs.WriteTo(p.cc.Conn); err != nil {
			return p.cc.wrapErr(fmt.Errorf("write stdin: %w", err))
		}
		b = b[n:]
	}
	return nil
}

// CloseStdin closes the command's stdin after what was written so far.
func (p *Process) CloseStdin() error {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	if err := writeFrame(p.cc, FrameEOF, nil); err != nil {
		return p.cc.wrapErr(fmt.Errorf("close stdin: %w", err))
	}
	return nil
}

// Signal sends sig to the command's whole process group. It goes over a
// connection of its own, so it is delivered even while stdin is blocked.
// Signalling a command that has exited is an error wrapping fs.ErrNotExist.
func (p *Process) Signal(sig syscall.Signal) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return p.client.unary(ctx, OpSignal, p.id, wireSignalRequest{ID: p.id, Signal: int(sig)}, nil)
}

// Close closes the connection. If the command is still running, the agent
// kills its process group (SIGKILL). Close is idempotent.
func (p *Process) Close() error {
	p.cc.close()
	return nil
}
