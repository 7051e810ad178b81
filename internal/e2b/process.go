package e2b

// envd's process service (api/e2b/process/process.proto) on the session
// layer: every process is an ordinary durable Shoal command (shoal ps and
// the other SDKs see it, it survives the client going away and `shoal
// serve` restarting). E2B names a process by its pid in the sandbox, which
// is the command's pid; E2B's tag and the configuration the client gave are
// kept beside the command (store.go).

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"path"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	pp "github.com/shoal-sandbox/shoal/api/e2b/process"
	"github.com/shoal-sandbox/shoal/api/e2b/process/processconnect"
	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/session"
)

// defaultKeepAlive is envd's keep-alive interval when the client does not
// ask for one (its Keepalive-Ping-Interval header, in seconds).
const defaultKeepAlive = 90 * time.Second

type processService struct {
	processconnect.UnimplementedProcessHandler
	s *Server
}

var _ processconnect.ProcessHandler = (*processService)(nil)

// sbInfo is what the E2B face learns once about a sandbox's root file
// system.
type sbInfo struct {
	mu      sync.Mutex // guards the fields below
	known   bool
	hasBash bool   // /bin/bash exists (else E2B's "/bin/bash -l -c" runs /bin/sh)
	home    string // root's home: Config.HomeDir if it is a directory, else "/"
	// Users (users.go): homes of the users looked up (at most
	// maxCachedUsers), and the default user once known ("" = root).
	users    map[string]agent.UserInfo
	defUser  string
	defKnown bool
}

// sandboxFacts returns (learning them on first use) the facts about a
// sandbox's root that E2B's defaults depend on.
func (s *Server) sandboxFacts(id string, ag *agent.Client) (hasBash bool, home string) {
	in := s.info(id)
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.known {
		return in.hasBash, in.home
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	in.home = "/"
	fi, err := ag.Stat(ctx, s.cfg.HomeDir)
	switch {
	case err == nil && fi.IsDir:
		in.home = s.cfg.HomeDir
	case err != nil && codeOf(err) != connect.CodeNotFound:
		return true, s.cfg.HomeDir // unknown: try again next time
	}
	_, err = ag.Stat(ctx, "/bin/bash")
	switch {
	case err == nil:
		in.hasBash = true
	case codeOf(err) != connect.CodeNotFound:
		return true, in.home
	}
	in.known = true
	return in.hasBash, in.home
}

// resolvePath makes p absolute the way envd does: "~" and relative paths
// are under the user's home.
func resolvePath(p, home string) (string, error) {
	if p == "" {
		return "", connect.NewError(connect.CodeInvalidArgument, errors.New("a path is required"))
	}
	if err := limits.Path("path", p); err != nil {
		return "", toConnect(err)
	}
	switch {
	case p == "~":
		p = home
	case strings.HasPrefix(p, "~/"):
		p = path.Join(home, p[2:])
	case !strings.HasPrefix(p, "/"):
		p = path.Join(home, p)
	}
	p = path.Clean(p)
	if err := limits.Path("path", p); err != nil { // home may be long
		return "", toConnect(err)
	}
	return p, nil
}

// agentFor returns the agent of the request's sandbox and its home.
func (s *Server) agentFor(ctx context.Context) (string, *agent.Client, error) {
	id := sandboxID(ctx)
	ag, err := s.node.Agent(id)
	if err != nil {
		return "", nil, connect.NewError(connect.CodeUnavailable, err)
	}
	return id, ag, nil
}

// keepAliveOf reads the client's Keepalive-Ping-Interval (seconds).
func keepAliveOf(h interface{ Get(string) string }) time.Duration {
	if v, err := strconv.Atoi(h.Get("Keepalive-Ping-Interval")); err == nil && v > 0 {
		return time.Duration(v) * time.Second
	}
	return defaultKeepAlive
}

// timeoutOf reads Connect's Connect-Timeout-Ms header, which envd uses as
// the process's deadline (0: none).
func timeoutOf(h interface{ Get(string) string }) (time.Duration, error) {
	v := h.Get("Connect-Timeout-Ms")
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("Connect-Timeout-Ms %q: want milliseconds", v))
	}
	return limits.Millis(n), nil
}

func (p *processService) Start(ctx context.Context, req *connect.Request[pp.StartRequest], stream *connect.ServerStream[pp.StartResponse]) error {
	s := p.s
	id, ag, err := s.agentFor(ctx)
	if err != nil {
		return err
	}
	// Counted before the start: a refused stream runs nothing.
	release, err := s.holdStream(ctx, id, "a process stream")
	if err != nil {
		return err
	}
	defer release()
	m := req.Msg
	cfg := m.GetProcess()
	if cfg.GetCmd() == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is required"))
	}
	hasBash, _ := s.sandboxFacts(id, ag)
	_, user, home, err := s.actAs(ctx, id, ag)
	if err != nil {
		return err
	}
	args := append([]string{cfg.GetCmd()}, cfg.GetArgs()...)
	if (args[0] == "/bin/bash" || args[0] == "bash") && !hasBash {
		// The SDK runs every command as /bin/bash -l -c CMD; a root without
		// bash (busybox, alpine, distroless+sh) gets the same from sh.
		args[0] = "/bin/sh"
	}
	env, err := limits.EnvList("envs", cfg.GetEnvs())
	if err != nil {
		return toConnect(err)
	}
	cwd := home
	if cfg.Cwd != nil && *cfg.Cwd != "" {
		if cwd, err = resolvePath(*cfg.Cwd, home); err != nil {
			return err
		}
	}
	timeout, err := timeoutOf(req.Header())
	if err != nil {
		return err
	}
	sr := session.StartRequest{Args: args, Env: env, Cwd: cwd, Timeout: timeout, User: user}
	sr.StdinOpen = m.Stdin == nil || *m.Stdin // envd's default for old clients: open
	if m.Pty != nil {
		size := m.Pty.GetSize()
		if err := limits.Pty(size.GetRows(), size.GetCols()); err != nil {
			return toConnect(err)
		}
		sr.PTY = &agent.Winsize{Rows: uint16(size.GetRows()), Cols: uint16(size.GetCols())}
		sr.StdinOpen = true
	}
	// The command belongs to the sandbox, not to this request.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	c, _, err := s.sessions.Start(sctx, id, sr)
	cancel()
	s.record(ctx, "command.start", id, strings.Join(args, " "), err)
	if err != nil {
		return toConnect(err)
	}
	in := c.Info()
	meta := commandMeta{Tag: m.GetTag(), Cmd: cfg.GetCmd(), Args: cfg.GetArgs(), Envs: cfg.GetEnvs()}
	if cfg.Cwd != nil {
		meta.Cwd = *cfg.Cwd
	}
	s.store.putCommand(id, in.ID, meta, func(err error) {
		if err != nil {
			s.log.Warn("e2b: record command", "sandbox_id", id, "command", in.ID, "err", err)
		}
	})
	s.log.Debug("e2b: process started", "sandbox_id", id, "command", in.ID, "pid", in.Pid)
	return p.stream(ctx, c, in, keepAliveOf(req.Header()), func(ev *pp.ProcessEvent) error {
		return stream.Send(&pp.StartResponse{Event: ev})
	})
}

func (p *processService) Connect(ctx context.Context, req *connect.Request[pp.ConnectRequest], stream *connect.ServerStream[pp.ConnectResponse]) error {
	id, _, err := p.s.agentFor(ctx)
	if err != nil {
		return err
	}
	c, in, err := p.s.findProcess(id, req.Msg.GetProcess(), false)
	if err != nil {
		return err
	}
	release, err := p.s.holdStream(ctx, id, "a process stream")
	if err != nil {
		return err
	}
	defer release()
	// Unlike envd, which streams only what comes after the reconnect,
	// Shoal replays the command's output from its start: it kept it.
	return p.stream(ctx, c, in, keepAliveOf(req.Header()), func(ev *pp.ProcessEvent) error {
		return stream.Send(&pp.ConnectResponse{Event: ev})
	})
}

// stream sends the start event, then the command's output from its start,
// then its end.
func (p *processService) stream(ctx context.Context, c *session.Command, in session.Info, keepAlive time.Duration, send func(*pp.ProcessEvent) error) error {
	if err := send(&pp.ProcessEvent{Event: &pp.ProcessEvent_Start{Start: &pp.ProcessEvent_StartEvent{Pid: uint32(in.Pid)}}}); err != nil {
		return err
	}
	// From the first offset its sandbox's log budget kept (0 unless its
	// oldest output was pruned).
	err := p.s.sessions.Events(ctx, c, in.LogPruned, keepAlive, func(ev session.Event) error {
		var out *pp.ProcessEvent
		switch ev.Kind {
		case session.EventStdout:
			d := &pp.ProcessEvent_DataEvent{Output: &pp.ProcessEvent_DataEvent_Stdout{Stdout: ev.Data}}
			if in.PTY {
				d.Output = &pp.ProcessEvent_DataEvent_Pty{Pty: ev.Data}
			}
			out = &pp.ProcessEvent{Event: &pp.ProcessEvent_Data{Data: d}}
		case session.EventStderr:
			out = &pp.ProcessEvent{Event: &pp.ProcessEvent_Data{Data: &pp.ProcessEvent_DataEvent{Output: &pp.ProcessEvent_DataEvent_Stderr{Stderr: ev.Data}}}}
		case session.EventKeepAlive:
			out = &pp.ProcessEvent{Event: &pp.ProcessEvent_Keepalive{Keepalive: &pp.ProcessEvent_KeepAlive{}}}
		case session.EventExit:
			out = &pp.ProcessEvent{Event: &pp.ProcessEvent_End{End: endEvent(ev.Exit)}}
		case session.EventLost:
			msg := "the command was lost: its sandbox's agent no longer knows it"
			out = &pp.ProcessEvent{Event: &pp.ProcessEvent_End{End: &pp.ProcessEvent_EndEvent{ExitCode: -1, Status: "lost", Error: &msg}}}
		default: // EventDropped: output past the log cap is not kept
			return nil
		}
		return send(out)
	})
	if errors.Is(err, errdefs.ErrSandboxKilled) {
		// E2B's envd dies with its sandbox: the connection drops without
		// an end event, and the SDK, seeing it cut, asks envd's /health,
		// which the edge answers 502 for a sandbox that is gone; it then
		// reports the sandbox killed or at its end of life (a
		// TimeoutError), never the command's exit. Drop it the same way:
		// net/http closes the connection without ending the response.
		p.s.log.Debug("e2b: sandbox killed under a process stream: dropping the connection", "sandbox_id", in.SandboxID, "pid", in.Pid)
		panic(http.ErrAbortHandler)
	}
	if err != nil {
		return toConnect(err)
	}
	return nil
}

// endEvent is envd's end event for an exit status, as Go's os/exec reports
// it there: "exit status N", or "signal: killed" with exit code -1.
func endEvent(ex *agent.ExitStatus) *pp.ProcessEvent_EndEvent {
	if ex == nil {
		return &pp.ProcessEvent_EndEvent{ExitCode: -1, Status: "unknown"}
	}
	if ex.Signal != "" {
		status := "signal: " + signalText(ex.Signal)
		msg := status
		if ex.TimedOut {
			msg = status + " (its timeout expired)"
		}
		return &pp.ProcessEvent_EndEvent{ExitCode: -1, Exited: false, Status: status, Error: &msg}
	}
	status := "exit status " + strconv.Itoa(ex.Code)
	out := &pp.ProcessEvent_EndEvent{ExitCode: int32(ex.Code), Exited: true, Status: status}
	if ex.Code != 0 {
		out.Error = &status
	}
	return out
}

// signalText is a signal's description ("killed" for SIGKILL).
func signalText(name string) string {
	if sig := unix.SignalNum(name); sig != 0 {
		return sig.String()
	}
	return strings.ToLower(strings.TrimPrefix(name, "SIG"))
}

// findProcess finds the command a selector names: by pid (a running
// command first, else the latest with that pid), or by tag. With
// runningOnly, an ended command is not found (envd forgets processes that
// ended).
func (s *Server) findProcess(sandboxID string, sel *pp.ProcessSelector, runningOnly bool) (*session.Command, session.Info, error) {
	var best *session.Info
	infos := s.sessions.List(sandboxID)
	switch v := sel.GetSelector().(type) {
	case *pp.ProcessSelector_Pid:
		for i := range infos {
			in := &infos[i]
			if in.Pid != int(v.Pid) {
				continue
			}
			if best == nil || in.State == session.StateRunning || (best.State != session.StateRunning && in.Started.After(best.Started)) {
				best = in
			}
		}
		if best == nil {
			return nil, session.Info{}, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", v.Pid))
		}
	case *pp.ProcessSelector_Tag:
		ids := map[string]bool{}
		for _, cid := range s.store.commandsByTag(sandboxID, v.Tag) {
			ids[cid] = true
		}
		for i := range infos {
			in := &infos[i]
			if ids[in.ID] && (best == nil || in.State == session.StateRunning || (best.State != session.StateRunning && in.Started.After(best.Started))) {
				best = in
			}
		}
		if best == nil {
			return nil, session.Info{}, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag %q not found", v.Tag))
		}
	default:
		return nil, session.Info{}, connect.NewError(connect.CodeInvalidArgument, errors.New("a process selector (pid or tag) is required"))
	}
	if runningOnly && best.State != session.StateRunning {
		return nil, session.Info{}, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found: it has %s", best.Pid, best.State))
	}
	c, err := s.sessions.Get(sandboxID, best.ID)
	if err != nil {
		return nil, session.Info{}, toConnect(err)
	}
	return c, *best, nil
}

// running finds a running process for the calls that act on one.
func (p *processService) running(ctx context.Context, sel *pp.ProcessSelector) (*session.Command, session.Info, error) {
	id, _, err := p.s.agentFor(ctx)
	if err != nil {
		return nil, session.Info{}, err
	}
	return p.s.findProcess(id, sel, true)
}

// notRunning maps "the command has exited" (lost a race with its end) to
// envd's answer for a process it no longer has.
func notRunning(err error, in session.Info) error {
	if codeOf(err) == connect.CodeFailedPrecondition {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found: it has exited", in.Pid))
	}
	return toConnect(err)
}

func (p *processService) List(ctx context.Context, req *connect.Request[pp.ListRequest]) (*connect.Response[pp.ListResponse], error) {
	id, _, err := p.s.agentFor(ctx)
	if err != nil {
		return nil, err
	}
	out := &pp.ListResponse{}
	for _, in := range p.s.sessions.List(id) {
		if in.State != session.StateRunning {
			continue
		}
		info := &pp.ProcessInfo{Pid: uint32(in.Pid), Config: &pp.ProcessConfig{}}
		if m, ok := p.s.store.command(id, in.ID); ok {
			info.Config.Cmd, info.Config.Args, info.Config.Envs = m.Cmd, m.Args, m.Envs
			if m.Cwd != "" {
				cwd := m.Cwd
				info.Config.Cwd = &cwd
			}
			if m.Tag != "" {
				tag := m.Tag
				info.Tag = &tag
			}
		} else if len(in.Args) > 0 { // started by another Shoal client
			info.Config.Cmd, info.Config.Args = in.Args[0], in.Args[1:]
			if in.Cwd != "" {
				cwd := in.Cwd
				info.Config.Cwd = &cwd
			}
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

func (p *processService) SendInput(ctx context.Context, req *connect.Request[pp.SendInputRequest]) (*connect.Response[pp.SendInputResponse], error) {
	c, in, err := p.running(ctx, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.s.sessions.SendStdin(ctx, c, inputBytes(req.Msg.GetInput()), false); err != nil {
		return nil, notRunning(err, in)
	}
	return connect.NewResponse(&pp.SendInputResponse{}), nil
}

func inputBytes(in *pp.ProcessInput) []byte {
	switch v := in.GetInput().(type) {
	case *pp.ProcessInput_Stdin:
		return v.Stdin
	case *pp.ProcessInput_Pty:
		return v.Pty
	}
	return nil
}

func (p *processService) StreamInput(ctx context.Context, stream *connect.ClientStream[pp.StreamInputRequest]) (*connect.Response[pp.StreamInputResponse], error) {
	var c *session.Command
	var in session.Info
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().(type) {
		case *pp.StreamInputRequest_Start:
			var err error
			if c, in, err = p.running(ctx, ev.Start.GetProcess()); err != nil {
				return nil, err
			}
		case *pp.StreamInputRequest_Data:
			if c == nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("the first message of an input stream must be start"))
			}
			if err := p.s.sessions.SendStdin(ctx, c, inputBytes(ev.Data.GetInput()), false); err != nil {
				return nil, notRunning(err, in)
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pp.StreamInputResponse{}), nil
}

func (p *processService) CloseStdin(ctx context.Context, req *connect.Request[pp.CloseStdinRequest]) (*connect.Response[pp.CloseStdinResponse], error) {
	c, in, err := p.running(ctx, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if in.PTY {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("a pty has no stdin to close: send Ctrl+D (0x04) instead"))
	}
	if err := p.s.sessions.SendStdin(ctx, c, nil, true); err != nil {
		return nil, notRunning(err, in)
	}
	return connect.NewResponse(&pp.CloseStdinResponse{}), nil
}

func (p *processService) SendSignal(ctx context.Context, req *connect.Request[pp.SendSignalRequest]) (*connect.Response[pp.SendSignalResponse], error) {
	sig := syscall.Signal(req.Msg.GetSignal())
	if sig <= 0 || sig > 64 {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("signal %d: want SIGKILL (9) or SIGTERM (15)", sig))
	}
	c, in, err := p.running(ctx, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.s.sessions.Signal(ctx, c, sig); err != nil {
		return nil, notRunning(err, in)
	}
	return connect.NewResponse(&pp.SendSignalResponse{}), nil
}

func (p *processService) Update(ctx context.Context, req *connect.Request[pp.UpdateRequest]) (*connect.Response[pp.UpdateResponse], error) {
	c, in, err := p.running(ctx, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if size := req.Msg.GetPty().GetSize(); size != nil {
		if !in.PTY {
			return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has no pty to resize", in.Pid))
		}
		if err := limits.Pty(size.GetRows(), size.GetCols()); err != nil {
			return nil, toConnect(err)
		}
		if err := p.s.sessions.Resize(ctx, c, agent.Winsize{Rows: uint16(size.GetRows()), Cols: uint16(size.GetCols())}); err != nil {
			return nil, notRunning(err, in)
		}
	}
	return connect.NewResponse(&pp.UpdateResponse{}), nil
}
