package shoal

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// ExecOptions describe one command.
type ExecOptions struct {
	Args    []string
	Env     map[string]string
	Cwd     string
	Stdin   io.Reader // nil: no stdin
	Stdout  io.Writer // nil: discarded
	Stderr  io.Writer // nil: discarded
	Timeout time.Duration
	// PTY runs the command under a terminal of that size (stdout and
	// stderr merge into Stdout).
	PTY *pb.Pty
	// StdinOpen keeps stdin open after Stdin is exhausted (or when Stdin is
	// nil), for SendStdin.
	StdinOpen bool
	// Trajectory step: a recorded step is replayed, not run again.
	Trajectory string
	Step       int64
	// OnStart, if set, is called with the command ID once it runs.
	OnStart func(commandID string)
	// User runs the command as this sandbox user (a name in its
	// /etc/passwd, or a uid): its ids, groups, HOME, USER, LOGNAME, and
	// its home as the cwd when Cwd is empty. Empty: root.
	User string
}

// ExitStatus is how a command ended.
type ExitStatus struct {
	Code      int    // exit code, or 128+signal number
	Signal    string // e.g. "SIGKILL" if killed by a signal
	TimedOut  bool
	Dropped   int64  // output bytes dropped past the server's log cap
	CommandID string // the command's ID in its sandbox
	Replayed  bool   // a recorded trajectory step: not run again
	Offset    int64  // log offset at the end of the command's output
}

// inlineStdin is the largest stdin sent inside the exec request itself.
const inlineStdin = 1 << 20

// Exec runs a command in a sandbox, streaming its output to o.Stdout and
// o.Stderr, and returns its exit status. The command is a server-side
// object: if the stream breaks, Exec re-connects from the last byte offset
// it received, so no output is lost or repeated; if ctx ends, the command
// goes on running in the sandbox (signal it to stop it).
func (c *Client) Exec(ctx context.Context, sandboxID string, o ExecOptions) (ExitStatus, error) {
	req := &pb.ExecRequest{
		SandboxId: sandboxID, Args: o.Args, Env: o.Env, Cwd: o.Cwd, TimeoutMs: o.Timeout.Milliseconds(),
		Pty: o.PTY, StdinOpen: o.StdinOpen, TrajectoryId: o.Trajectory, Step: o.Step, User: o.User,
	}
	stdin := o.Stdin
	if stdin != nil {
		// Small inputs travel inside the request; larger ones are pumped.
		head, err := io.ReadAll(io.LimitReader(stdin, inlineStdin+1))
		if err != nil {
			return ExitStatus{}, fmt.Errorf("read stdin: %w", err)
		}
		if len(head) <= inlineStdin && !o.StdinOpen {
			req.Stdin, stdin = head, nil
		} else {
			req.StdinOpen = true
			stdin = io.MultiReader(bytes.NewReader(head), stdin)
		}
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.Commands.Exec(sctx, connect.NewRequest(req))
	if err != nil {
		return ExitStatus{}, err
	}
	var st ExitStatus
	onStart := func(ev *pb.CommandEvent_Started) {
		st.CommandID, st.Replayed = ev.CommandId, ev.Replayed
		if o.OnStart != nil {
			o.OnStart(ev.CommandId)
		}
		if stdin != nil && !ev.Replayed {
			go c.pumpStdin(sctx, sandboxID, ev.CommandId, stdin)
		}
	}
	done, err := c.consume(stream, &st, onStart, o.Stdout, o.Stderr)
	stream.Close()
	if done || st.CommandID == "" || !streamBroke(err) {
		return st, err
	}
	// The stream broke after the command started: re-connect from where we
	// were, a few times, unless the caller gave up.
	for attempt := 1; ctx.Err() == nil && attempt <= 5; attempt++ {
		var rst ExitStatus
		rst, err = c.Attach(ctx, sandboxID, st.CommandID, st.Offset, o.Stdout, o.Stderr)
		if err == nil {
			rst.CommandID, rst.Replayed = st.CommandID, st.Replayed
			return rst, nil
		}
		if !streamBroke(err) {
			return st, err
		}
		time.Sleep(time.Duration(attempt) * 200 * time.Millisecond)
	}
	if ctx.Err() != nil {
		return st, ctx.Err()
	}
	return st, err
}

// streamBroke tells a stream that broke (the connection, the server going
// away: attach again) from one the server ended with an answer (the
// command's sandbox was killed, the command is unknown, ...), which
// attaching again would only replace with a worse one: once its sandbox
// is deleted, a command can no longer be attached to at all.
func streamBroke(err error) bool {
	ce := new(connect.Error)
	if !errors.As(err, &ce) {
		return true // no status: the stream just ended
	}
	switch ce.Code() {
	case connect.CodeUnavailable, connect.CodeUnknown, connect.CodeInternal:
		return true
	}
	return false
}

// consume reads a command event stream into the writers and st; it reports
// whether the exit event was seen.
func (c *Client) consume(stream *connect.ServerStreamForClient[pb.CommandEvent], st *ExitStatus, onStart func(*pb.CommandEvent_Started), stdout, stderr io.Writer) (bool, error) {
	for stream.Receive() {
		msg := stream.Msg()
		switch ev := msg.Event.(type) {
		case *pb.CommandEvent_Started_:
			if onStart != nil {
				onStart(ev.Started)
			}
		case *pb.CommandEvent_Stdout:
			if stdout != nil {
				stdout.Write(ev.Stdout)
			}
		case *pb.CommandEvent_Stderr:
			if stderr != nil {
				stderr.Write(ev.Stderr)
			}
		case *pb.CommandEvent_Exit_:
			st.Code, st.Signal, st.TimedOut, st.Dropped = int(ev.Exit.Code), ev.Exit.Signal, ev.Exit.TimedOut, ev.Exit.DroppedBytes
			st.Offset = msg.Offset
			drain(stream)
			return true, nil
		}
		if msg.Offset > st.Offset {
			st.Offset = msg.Offset
		}
	}
	if err := stream.Err(); err != nil {
		return false, startErr(err)
	}
	return false, errors.New("command stream ended without an exit status")
}

// drain reads a stream past its last event (a command's exit, a layer
// call's result) to its end, where the server ends it, so that the
// HTTP/1.1 connection goes back to the pool: closing a response body not
// read to its end closes the connection, and every command then cost a new
// one (a TCP handshake, and a TLS one over https). Measured: 100 commands
// took 154 connections and ~4 ms of CPU each between client and server;
// drained, one connection and ~2.8 ms. A server that goes on sending is
// left after a few messages.
func drain[T any](stream *connect.ServerStreamForClient[T]) {
	for i := 0; i < 4 && stream.Receive(); i++ {
	}
}

// Attach streams a running or finished command's output from a byte offset
// of its log (0: from the start) to the writers and returns its exit status.
func (c *Client) Attach(ctx context.Context, sandboxID, commandID string, offset int64, stdout, stderr io.Writer) (ExitStatus, error) {
	stream, err := c.Commands.ConnectCommand(ctx, connect.NewRequest(&pb.ConnectCommandRequest{
		SandboxId: sandboxID, CommandId: commandID, Offset: offset,
	}))
	if err != nil {
		return ExitStatus{}, err
	}
	defer stream.Close()
	st := ExitStatus{CommandID: commandID, Offset: offset}
	_, err = c.consume(stream, &st, nil, stdout, stderr)
	return st, err
}

// Start starts a command and returns at once; follow it with Attach.
func (c *Client) Start(ctx context.Context, req *pb.ExecRequest) (*pb.Command, error) {
	res, err := c.Commands.StartCommand(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, startErr(err)
	}
	return res.Msg, nil
}

// pumpStdin copies r to a command's stdin in chunks, then closes it.
func (c *Client) pumpStdin(ctx context.Context, sandboxID, commandID string, r io.Reader) error {
	buf := make([]byte, 256<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 || err != nil {
			closeIt := err != nil
			if _, serr := c.Commands.SendStdin(ctx, connect.NewRequest(&pb.SendStdinRequest{
				SandboxId: sandboxID, CommandId: commandID, Data: buf[:n], Close: closeIt,
			})); serr != nil {
				return serr
			}
			if closeIt {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return err
			}
		}
	}
}
