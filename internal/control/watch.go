package control

import (
	"context"
	"errors"
	"io"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/agent"
)

var watchOps = map[string]pb.WatchDirEvent_Op{
	agent.WatchCreate:   pb.WatchDirEvent_OP_CREATE,
	agent.WatchWrite:    pb.WatchDirEvent_OP_WRITE,
	agent.WatchRemove:   pb.WatchDirEvent_OP_REMOVE,
	agent.WatchRename:   pb.WatchDirEvent_OP_RENAME,
	agent.WatchChmod:    pb.WatchDirEvent_OP_CHMOD,
	agent.WatchOverflow: pb.WatchDirEvent_OP_OVERFLOW,
}

// WatchDir streams the changes under a path (inotify in the sandbox). The
// response headers go out once the watch is armed, with the header
// Shoal-Watch-Armed: 1, so a client that has them knows later changes are
// reported. Nothing is queued here: when the
// client reads slowly, the agent stops reading the kernel's queue, which
// overflows into an OP_OVERFLOW event.
func (s *Server) WatchDir(ctx context.Context, req *connect.Request[pb.WatchDirRequest], stream *connect.ServerStream[pb.WatchDirEvent]) error {
	a, err := s.agentFor(req.Msg.SandboxId, req.Msg.Path, req.Msg.User)
	if err != nil {
		return err
	}
	held, err := s.holdStream(ctx, req.Msg.SandboxId, "a watch")
	if err != nil {
		return err
	}
	defer held()
	// Not idle (auto-pause) while the watch lasts.
	if release, err := s.node.Hold(req.Msg.SandboxId); err == nil {
		defer release()
	}
	w, err := a.Watch(ctx, req.Msg.Path, req.Msg.Recursive)
	if err != nil {
		return agentLimitErr(err)
	}
	defer w.Close()
	// Headers now: the watch is armed (sdk/go's Watch waits for this mark).
	stream.ResponseHeader().Set("Shoal-Watch-Armed", "1")
	if err := stream.Send(nil); err != nil {
		return err
	}
	for {
		ev, err := w.Next()
		if errors.Is(err, io.EOF) {
			return nil // the watched path is gone
		}
		if err != nil {
			if ctx.Err() != nil {
				return connect.NewError(connect.CodeCanceled, ctx.Err())
			}
			return toConnect(err)
		}
		op, ok := watchOps[ev.Op]
		if !ok {
			continue // an op this server does not know
		}
		if err := stream.Send(&pb.WatchDirEvent{Op: op, Path: ev.Path, IsDir: ev.IsDir, OldPath: ev.OldPath}); err != nil {
			return err
		}
	}
}
