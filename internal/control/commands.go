package control

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/agent"
)

// --- commands ---

func (s *Server) Exec(ctx context.Context, req *connect.Request[pb.ExecRequest], stream *connect.ServerStream[pb.CommandEvent]) error {
	r := req.Msg
	if r.TimeoutMs < 0 {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("timeout_ms must not be negative"))
	}
	env := make([]string, 0, len(r.Env))
	for k, v := range r.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("bad environment variable name %q", k))
		}
		env = append(env, k+"="+v)
	}
	sort.Strings(env)
	cmd, err := s.node.Exec(ctx, r.SandboxId, agent.ExecRequest{
		Args: r.Args, Env: env, Cwd: r.Cwd,
		Stdin:   r.StdinOpen || len(r.Stdin) > 0,
		Timeout: time.Duration(r.TimeoutMs) * time.Millisecond,
	})
	if err != nil {
		return toConnect(err)
	}
	defer s.node.FinishCommand(cmd)
	if err := stream.Send(&pb.CommandEvent{Event: &pb.CommandEvent_Started_{Started: &pb.CommandEvent_Started{CommandId: cmd.ID, Pid: int64(cmd.Pid())}}}); err != nil {
		return err
	}
	if len(r.Stdin) > 0 || !r.StdinOpen {
		stdin, closeStdin := r.Stdin, !r.StdinOpen
		go func() {
			if err := cmd.WriteStdin(stdin, closeStdin); err != nil {
				s.log.Debug("write stdin", "sandbox_id", r.SandboxId, "err", err)
			}
		}()
	}
	for {
		ev, err := cmd.Recv()
		if err != nil {
			return toConnect(fmt.Errorf("command %s: %w", cmd.ID, err))
		}
		var msg pb.CommandEvent
		switch ev.Kind {
		case agent.EventStdout:
			msg.Event = &pb.CommandEvent_Stdout{Stdout: ev.Data}
		case agent.EventStderr:
			msg.Event = &pb.CommandEvent_Stderr{Stderr: ev.Data}
		case agent.EventExit:
			msg.Event = &pb.CommandEvent_Exit_{Exit: &pb.CommandEvent_Exit{
				Code: int32(ev.Exit.Code), Signal: ev.Exit.Signal, TimedOut: ev.Exit.TimedOut,
			}}
			return stream.Send(&msg)
		default:
			continue
		}
		if err := stream.Send(&msg); err != nil {
			return err
		}
	}
}

func (s *Server) SendStdin(ctx context.Context, req *connect.Request[pb.SendStdinRequest]) (*connect.Response[pb.SendStdinResponse], error) {
	cmd, err := s.node.Command(req.Msg.SandboxId, req.Msg.CommandId)
	if err != nil {
		return nil, toConnect(err)
	}
	if err := cmd.WriteStdin(req.Msg.Data, req.Msg.Close); err != nil {
		return nil, toConnect(fmt.Errorf("write stdin of command %s: %w", cmd.ID, err))
	}
	return connect.NewResponse(&pb.SendStdinResponse{}), nil
}

var signals = map[string]syscall.Signal{
	"SIGHUP": syscall.SIGHUP, "SIGINT": syscall.SIGINT, "SIGQUIT": syscall.SIGQUIT,
	"SIGKILL": syscall.SIGKILL, "SIGTERM": syscall.SIGTERM, "SIGUSR1": syscall.SIGUSR1,
	"SIGUSR2": syscall.SIGUSR2, "SIGSTOP": syscall.SIGSTOP, "SIGCONT": syscall.SIGCONT,
}

func (s *Server) SignalCommand(ctx context.Context, req *connect.Request[pb.SignalCommandRequest]) (*connect.Response[pb.SignalCommandResponse], error) {
	name := strings.ToUpper(req.Msg.Signal)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	sig, ok := signals[name]
	if !ok {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unknown signal %q (use SIGTERM, SIGKILL, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGSTOP or SIGCONT)", req.Msg.Signal))
	}
	cmd, err := s.node.Command(req.Msg.SandboxId, req.Msg.CommandId)
	if err != nil {
		return nil, toConnect(err)
	}
	if err := cmd.Signal(sig); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.SignalCommandResponse{}), nil
}
