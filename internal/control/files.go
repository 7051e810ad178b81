package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"path"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// checkPath refuses paths the agent would refuse anyway, with a message for
// the API user. The agent runs inside the sandbox's own root, so a symlink
// can never resolve to a host file; refusing ".." keeps paths unambiguous.
func checkPath(p string) error {
	if p == "" {
		return fmt.Errorf("a path is required")
	}
	if !path.IsAbs(p) {
		return fmt.Errorf("path %q must be absolute (start with /)", p)
	}
	for _, el := range strings.Split(p, "/") {
		if el == ".." {
			return fmt.Errorf("path %q must not contain '..'", p)
		}
	}
	if strings.IndexByte(p, 0) >= 0 {
		return fmt.Errorf("path must not contain NUL bytes")
	}
	if len(p) > limits.PathBytes {
		return fmt.Errorf("path is %d bytes, more than the maximum of %d", len(p), limits.PathBytes)
	}
	return nil
}

// agentFor returns the agent of sandbox id, acting as user ("" = root).
func (s *Server) agentFor(id, p, user string) (*agent.Client, error) {
	if err := checkPath(p); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	if err := limits.User("user", user); err != nil {
		return nil, toConnect(err)
	}
	a, err := s.node.Agent(id)
	if err != nil {
		return nil, toConnect(err)
	}
	return a.AsUser(user), nil
}

func fileInfoPB(dir string, fi agent.FileInfo) *pb.FileInfo {
	return &pb.FileInfo{
		Name: fi.Name, Path: path.Join(dir, fi.Name), Size: fi.Size, Mode: uint32(fi.Mode.Perm()),
		IsDir: fi.IsDir, Symlink: fi.Symlink, ModifiedAt: timestamppb.New(fi.ModTime),
		Owner: fi.Owner, Group: fi.Group, Uid: fi.UID, Gid: fi.GID,
	}
}

func (s *Server) StatFile(ctx context.Context, req *connect.Request[pb.StatFileRequest]) (*connect.Response[pb.FileInfo], error) {
	a, err := s.agentFor(req.Msg.SandboxId, req.Msg.Path, req.Msg.User)
	if err != nil {
		return nil, err
	}
	fi, err := a.Stat(ctx, req.Msg.Path)
	if err != nil {
		return nil, toConnect(err)
	}
	out := fileInfoPB(path.Dir(req.Msg.Path), fi)
	out.Path = path.Clean(req.Msg.Path)
	return connect.NewResponse(out), nil
}

func (s *Server) ListDir(ctx context.Context, req *connect.Request[pb.ListDirRequest]) (*connect.Response[pb.ListDirResponse], error) {
	if req.Msg.Depth < 0 {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("depth %d must not be negative", req.Msg.Depth))
	}
	a, err := s.agentFor(req.Msg.SandboxId, req.Msg.Path, req.Msg.User)
	if err != nil {
		return nil, err
	}
	out := &pb.ListDirResponse{}
	if req.Msg.Depth > 1 {
		entries, err := a.ListTree(ctx, req.Msg.Path, int(req.Msg.Depth))
		if err != nil {
			return nil, agentLimitErr(err)
		}
		out.Entries = make([]*pb.FileInfo, 0, len(entries))
		for _, e := range entries {
			fi := fileInfoPB(path.Dir(e.Path), e.FileInfo)
			fi.Path = e.Path
			out.Entries = append(out.Entries, fi)
		}
		return connect.NewResponse(out), nil
	}
	entries, err := a.ListDir(ctx, req.Msg.Path)
	if err != nil {
		return nil, agentLimitErr(err)
	}
	for _, fi := range entries {
		out.Entries = append(out.Entries, fileInfoPB(path.Clean(req.Msg.Path), fi))
	}
	return connect.NewResponse(out), nil
}

// agentLimitErr maps the agent's bound on a recursive list or watch to
// RESOURCE_EXHAUSTED; other errors as toConnect does.
func agentLimitErr(err error) error {
	var ae *agent.Error
	if errors.As(err, &ae) && ae.Code == agent.CodeTooMany {
		return connect.NewError(connect.CodeResourceExhausted, err)
	}
	return toConnect(err)
}

func (s *Server) MakeDir(ctx context.Context, req *connect.Request[pb.MakeDirRequest]) (*connect.Response[pb.MakeDirResponse], error) {
	a, err := s.agentFor(req.Msg.SandboxId, req.Msg.Path, req.Msg.User)
	if err != nil {
		return nil, err
	}
	if err := a.MakeDir(ctx, req.Msg.Path, 0o755); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.MakeDirResponse{}), nil
}

func (s *Server) RemoveFile(ctx context.Context, req *connect.Request[pb.RemoveFileRequest]) (*connect.Response[pb.RemoveFileResponse], error) {
	if path.Clean(req.Msg.Path) == "/" {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("refusing to remove /"))
	}
	a, err := s.agentFor(req.Msg.SandboxId, req.Msg.Path, req.Msg.User)
	if err != nil {
		return nil, err
	}
	if err := a.Remove(ctx, req.Msg.Path, req.Msg.Recursive); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.RemoveFileResponse{}), nil
}

// readFile streams a file out of a sandbox: GET /v1/sandboxes/{id}/files?path=.
func (s *Server) readFile(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Query().Get("path")
	a, err := s.agentFor(r.PathValue("id"), p, r.URL.Query().Get("user"))
	if err != nil {
		writeConnectError(w, err)
		return
	}
	rc, fi, err := a.ReadFile(r.Context(), p)
	if err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("X-Shoal-File-Size", strconv.FormatInt(fi.Size, 10))
	w.Header().Set("X-Shoal-File-Mode", fmt.Sprintf("%04o", fi.Mode.Perm()))
	buf := make([]byte, 256<<10)
	for {
		n, err := rc.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			// A failure after the first byte can only be signalled by cutting
			// the chunked response short, which clients see as an error.
			if !errors.Is(err, io.EOF) {
				s.log.Warn("read file", "sandbox_id", r.PathValue("id"), "path", p, "err", err)
				panic(http.ErrAbortHandler)
			}
			return
		}
	}
}

// writeFile streams a request body into a sandbox file, atomically:
// PUT /v1/sandboxes/{id}/files?path=&mode=0644.
func (s *Server) writeFile(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Query().Get("path")
	mode := fs.FileMode(0o644)
	if m := r.URL.Query().Get("mode"); m != "" {
		v, err := strconv.ParseUint(m, 8, 32)
		if err != nil || v > 0o7777 {
			writeHTTPError(w, http.StatusBadRequest, "invalid_argument", fmt.Sprintf("mode %q must be octal permission bits such as 0644", m))
			return
		}
		mode = fs.FileMode(v)
	}
	a, err := s.agentFor(r.PathValue("id"), p, r.URL.Query().Get("user"))
	if err != nil {
		writeConnectError(w, err)
		return
	}
	n, err := a.WriteFile(r.Context(), p, mode, limits.Reader(r.Body, limits.FileBytes, "file"))
	if err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"path": p, "bytes": n})
}
