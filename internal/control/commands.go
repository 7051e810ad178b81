package control

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/session"
)

// keepAlive is how often a command stream with no output sends a
// keep-alive event (proxies and clients drop silent streams).
const keepAlive = 15 * time.Second

func startRequest(r *pb.ExecRequest) (session.StartRequest, error) {
	// Sizes, counts and the timeout's range are checked by session.Start
	// (limits), the same for every face.
	env, err := limits.EnvList("env", r.Env)
	if err != nil {
		return session.StartRequest{}, toConnect(err)
	}
	sr := session.StartRequest{
		Args: r.Args, Env: env, Cwd: r.Cwd, Stdin: r.Stdin, StdinOpen: r.StdinOpen,
		Timeout: limits.Millis(r.TimeoutMs), Trajectory: r.TrajectoryId, Step: r.Step, User: r.User,
	}
	if r.Pty != nil {
		if err := limits.Pty(r.Pty.Rows, r.Pty.Cols); err != nil {
			return sr, toConnect(err)
		}
		sr.PTY = &agent.Winsize{Rows: uint16(r.Pty.Rows), Cols: uint16(r.Pty.Cols)}
	}
	return sr, nil
}

func commandPB(in session.Info, replayed bool) *pb.Command {
	out := &pb.Command{
		Id: in.ID, SandboxId: in.SandboxID, Args: in.Args, Cwd: in.Cwd, Pid: int64(in.Pid),
		StartedAt: timestamppb.New(in.Started), LogBytes: in.LogBytes, Pty: in.PTY,
		TrajectoryId: in.Trajectory, Step: in.Step, Replayed: replayed, User: in.User,
		EndReason: endReason(in),
	}
	switch in.State {
	case session.StateRunning:
		out.State = pb.CommandState_COMMAND_STATE_RUNNING
	case session.StateExited:
		out.State = pb.CommandState_COMMAND_STATE_EXITED
	case session.StateLost:
		out.State = pb.CommandState_COMMAND_STATE_LOST
	}
	if in.Exit != nil {
		out.Exit = &pb.ExitStatus{Code: int32(in.Exit.Code), Signal: in.Exit.Signal, TimedOut: in.Exit.TimedOut}
		out.DroppedBytes = in.Exit.Dropped
	}
	if !in.Ended.IsZero() {
		out.EndedAt = timestamppb.New(in.Ended)
	}
	return out
}

// streamEvents sends a command's events from offset to stream.
func (s *Server) streamEvents(ctx context.Context, c *session.Command, offset int64, stream *connect.ServerStream[pb.CommandEvent]) error {
	err := s.sessions.Events(ctx, c, offset, keepAlive, func(ev session.Event) error {
		msg := &pb.CommandEvent{Offset: ev.Offset}
		switch ev.Kind {
		case session.EventStdout:
			msg.Event = &pb.CommandEvent_Stdout{Stdout: ev.Data}
		case session.EventStderr:
			msg.Event = &pb.CommandEvent_Stderr{Stderr: ev.Data}
		case session.EventDropped:
			msg.Event = &pb.CommandEvent_Dropped_{Dropped: &pb.CommandEvent_Dropped{Bytes: ev.Dropped}}
		case session.EventKeepAlive:
			msg.Event = &pb.CommandEvent_Keepalive{Keepalive: &pb.CommandEvent_KeepAlive{}}
		case session.EventExit:
			msg.Event = &pb.CommandEvent_Exit_{Exit: &pb.CommandEvent_Exit{
				Code: int32(ev.Exit.Code), Signal: ev.Exit.Signal, TimedOut: ev.Exit.TimedOut, DroppedBytes: ev.Exit.Dropped,
			}}
		case session.EventLost:
			return connect.NewError(connect.CodeAborted, fmt.Errorf("command %s was lost: its sandbox's agent no longer knows it", c.Info().ID))
		}
		return stream.Send(msg)
	})
	if err != nil {
		return toConnect(err)
	}
	return nil
}

func (s *Server) Exec(ctx context.Context, req *connect.Request[pb.ExecRequest], stream *connect.ServerStream[pb.CommandEvent]) error {
	sr, err := startRequest(req.Msg)
	if err != nil {
		return err
	}
	// Counted before the start: a refused stream runs nothing.
	release, err := s.holdStream(ctx, req.Msg.SandboxId, "a command stream")
	if err != nil {
		return err
	}
	defer release()
	c, replayed, err := s.sessions.Start(ctx, req.Msg.SandboxId, sr)
	if err != nil {
		return toConnect(err)
	}
	in := c.Info()
	if err := stream.Send(&pb.CommandEvent{Event: &pb.CommandEvent_Started_{Started: &pb.CommandEvent_Started{
		CommandId: in.ID, Pid: int64(in.Pid), Replayed: replayed,
	}}}); err != nil {
		return err
	}
	return s.streamEvents(ctx, c, 0, stream)
}

func (s *Server) StartCommand(ctx context.Context, req *connect.Request[pb.ExecRequest]) (*connect.Response[pb.Command], error) {
	sr, err := startRequest(req.Msg)
	if err != nil {
		return nil, err
	}
	c, replayed, err := s.sessions.Start(ctx, req.Msg.SandboxId, sr)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(commandPB(c.Info(), replayed)), nil
}

func (s *Server) command(sandboxID, id string) (*session.Command, error) {
	if _, err := s.node.Get(sandboxID); err != nil {
		return nil, toConnect(err)
	}
	c, err := s.sessions.Get(sandboxID, id)
	if err != nil {
		return nil, toConnect(err)
	}
	return c, nil
}

func (s *Server) ConnectCommand(ctx context.Context, req *connect.Request[pb.ConnectCommandRequest], stream *connect.ServerStream[pb.CommandEvent]) error {
	c, err := s.command(req.Msg.SandboxId, req.Msg.CommandId)
	if err != nil {
		return err
	}
	release, err := s.holdStream(ctx, req.Msg.SandboxId, "a command stream")
	if err != nil {
		return err
	}
	defer release()
	return s.streamEvents(ctx, c, req.Msg.Offset, stream)
}

func (s *Server) WaitCommand(ctx context.Context, req *connect.Request[pb.WaitCommandRequest]) (*connect.Response[pb.Command], error) {
	c, err := s.command(req.Msg.SandboxId, req.Msg.CommandId)
	if err != nil {
		return nil, err
	}
	if req.Msg.TimeoutMs < 0 {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("timeout_ms must not be negative"))
	}
	wctx := ctx
	if req.Msg.TimeoutMs > 0 {
		var cancel context.CancelFunc
		wctx, cancel = context.WithTimeout(ctx, limits.Millis(req.Msg.TimeoutMs))
		defer cancel()
	}
	in, err := s.sessions.Wait(wctx, c)
	if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
		err = nil // the wait's own timeout: report the command as it is
	}
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(commandPB(in, false)), nil
}

func (s *Server) GetCommand(ctx context.Context, req *connect.Request[pb.GetCommandRequest]) (*connect.Response[pb.Command], error) {
	c, err := s.command(req.Msg.SandboxId, req.Msg.CommandId)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(commandPB(c.Info(), false)), nil
}

func (s *Server) ListCommands(ctx context.Context, req *connect.Request[pb.ListCommandsRequest]) (*connect.Response[pb.ListCommandsResponse], error) {
	if _, err := s.node.Get(req.Msg.SandboxId); err != nil {
		return nil, toConnect(err)
	}
	out := &pb.ListCommandsResponse{}
	for _, in := range s.sessions.List(req.Msg.SandboxId) {
		out.Commands = append(out.Commands, commandPB(in, false))
	}
	return connect.NewResponse(out), nil
}

func (s *Server) SendStdin(ctx context.Context, req *connect.Request[pb.SendStdinRequest]) (*connect.Response[pb.SendStdinResponse], error) {
	c, err := s.command(req.Msg.SandboxId, req.Msg.CommandId)
	if err != nil {
		return nil, err
	}
	if err := s.sessions.SendStdin(ctx, c, req.Msg.Data, req.Msg.Close); err != nil {
		return nil, toConnect(fmt.Errorf("write stdin of command %s: %w", req.Msg.CommandId, err))
	}
	return connect.NewResponse(&pb.SendStdinResponse{}), nil
}

var signals = map[string]syscall.Signal{
	"SIGHUP": syscall.SIGHUP, "SIGINT": syscall.SIGINT, "SIGQUIT": syscall.SIGQUIT,
	"SIGKILL": syscall.SIGKILL, "SIGTERM": syscall.SIGTERM, "SIGUSR1": syscall.SIGUSR1,
	"SIGUSR2": syscall.SIGUSR2, "SIGSTOP": syscall.SIGSTOP, "SIGCONT": syscall.SIGCONT,
	"SIGWINCH": syscall.SIGWINCH,
}

func (s *Server) SignalCommand(ctx context.Context, req *connect.Request[pb.SignalCommandRequest]) (*connect.Response[pb.SignalCommandResponse], error) {
	name := strings.ToUpper(req.Msg.Signal)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	sig, ok := signals[name]
	if !ok {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unknown signal %q (use SIGTERM, SIGKILL, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGSTOP, SIGCONT or SIGWINCH)", req.Msg.Signal))
	}
	c, err := s.command(req.Msg.SandboxId, req.Msg.CommandId)
	if err != nil {
		return nil, err
	}
	if err := s.sessions.Signal(ctx, c, sig); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.SignalCommandResponse{}), nil
}

func (s *Server) ResizePty(ctx context.Context, req *connect.Request[pb.ResizePtyRequest]) (*connect.Response[pb.ResizePtyResponse], error) {
	sz := req.Msg.Size
	if sz == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("size is required"))
	}
	if err := limits.Pty(sz.Rows, sz.Cols); err != nil {
		return nil, toConnect(err)
	}
	c, err := s.command(req.Msg.SandboxId, req.Msg.CommandId)
	if err != nil {
		return nil, err
	}
	if err := s.sessions.Resize(ctx, c, agent.Winsize{Rows: uint16(sz.Rows), Cols: uint16(sz.Cols)}); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.ResizePtyResponse{}), nil
}

func (s *Server) ListTrajectories(ctx context.Context, req *connect.Request[pb.ListTrajectoriesRequest]) (*connect.Response[pb.ListTrajectoriesResponse], error) {
	if _, err := s.node.Get(req.Msg.SandboxId); err != nil {
		return nil, toConnect(err)
	}
	ts, err := s.sessions.Trajectories(req.Msg.SandboxId)
	if err != nil {
		return nil, toConnect(err)
	}
	out := &pb.ListTrajectoriesResponse{}
	for _, t := range ts {
		out.Trajectories = append(out.Trajectories, &pb.Trajectory{Id: t.ID, SandboxId: req.Msg.SandboxId})
	}
	return connect.NewResponse(out), nil
}

func (s *Server) GetTrajectory(ctx context.Context, req *connect.Request[pb.GetTrajectoryRequest]) (*connect.Response[pb.Trajectory], error) {
	if _, err := s.node.Get(req.Msg.SandboxId); err != nil {
		return nil, toConnect(err)
	}
	ts, err := s.sessions.Trajectories(req.Msg.SandboxId)
	if err != nil {
		return nil, toConnect(err)
	}
	for _, t := range ts {
		if t.ID != req.Msg.TrajectoryId {
			continue
		}
		out := &pb.Trajectory{Id: t.ID, SandboxId: req.Msg.SandboxId}
		for _, st := range t.Steps {
			step := &pb.TrajectoryStep{Step: st.Step, CommandId: st.Command, Args: st.Args, RequestDigest: st.Digest}
			if c, err := s.sessions.Get(req.Msg.SandboxId, st.Command); err == nil {
				step.Command = commandPB(c.Info(), false)
			}
			out.Steps = append(out.Steps, step)
		}
		return connect.NewResponse(out), nil
	}
	return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("no trajectory %q in sandbox %s", req.Msg.TrajectoryId, req.Msg.SandboxId))
}

// endReason says why a command that did not exit ended.
func endReason(in session.Info) string {
	if in.Reset {
		return "reset"
	}
	return ""
}
