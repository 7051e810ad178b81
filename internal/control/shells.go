package control

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/session"
)

func shellPB(sh *session.Shell) *pb.Shell {
	return &pb.Shell{SandboxId: sh.SandboxID, Name: sh.Name, CommandId: sh.CommandID, CreatedAt: timestamppb.New(sh.Created)}
}

func (s *Server) CreateShell(ctx context.Context, req *connect.Request[pb.CreateShellRequest]) (*connect.Response[pb.Shell], error) {
	r := req.Msg
	env, err := limits.EnvList("env", r.Env)
	if err != nil {
		return nil, toConnect(err)
	}
	sh, err := s.sessions.CreateShell(ctx, r.SandboxId, r.Name, r.Cwd, env, r.Shell, r.User)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(shellPB(sh)), nil
}

func (s *Server) RunInShell(ctx context.Context, req *connect.Request[pb.RunInShellRequest]) (*connect.Response[pb.ShellResult], error) {
	if _, err := s.node.Get(req.Msg.SandboxId); err != nil {
		return nil, toConnect(err)
	}
	res, err := s.sessions.RunInShell(ctx, req.Msg.SandboxId, req.Msg.Name, req.Msg.Command, limits.Millis(req.Msg.TimeoutMs))
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.ShellResult{Output: res.Output, ExitCode: int32(res.ExitCode), TimedOut: res.TimedOut}), nil
}

func (s *Server) ListShells(ctx context.Context, req *connect.Request[pb.ListShellsRequest]) (*connect.Response[pb.ListShellsResponse], error) {
	if _, err := s.node.Get(req.Msg.SandboxId); err != nil {
		return nil, toConnect(err)
	}
	out := &pb.ListShellsResponse{}
	for _, sh := range s.sessions.ListShells(req.Msg.SandboxId) {
		out.Shells = append(out.Shells, shellPB(sh))
	}
	return connect.NewResponse(out), nil
}

func (s *Server) DeleteShell(ctx context.Context, req *connect.Request[pb.DeleteShellRequest]) (*connect.Response[pb.DeleteShellResponse], error) {
	if _, err := s.node.Get(req.Msg.SandboxId); err != nil {
		return nil, toConnect(err)
	}
	if err := s.sessions.DeleteShell(ctx, req.Msg.SandboxId, req.Msg.Name); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.DeleteShellResponse{}), nil
}
