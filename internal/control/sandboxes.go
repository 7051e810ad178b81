// Package control is Shoal's API edge: it serves the wire API defined in
// api/shoal/v1 (connect-go: gRPC, gRPC-Web and Connect JSON over HTTP) plus
// the streamed file endpoints, authenticates every call but /healthz, and
// maps internal errors to status codes with messages that say what to fix.
package control

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
	"github.com/shoal-sandbox/shoal/internal/audit"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/metrics"
	"github.com/shoal-sandbox/shoal/internal/netpolicy"
	"github.com/shoal-sandbox/shoal/internal/node"
	"github.com/shoal-sandbox/shoal/internal/session"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// Server implements the API on top of one node's manager.
type Server struct {
	shoalv1connect.UnimplementedCommandServiceHandler
	shoalv1connect.UnimplementedSandboxServiceHandler

	node     *node.Manager
	sessions *session.Manager
	auth     *Auth
	log      *slog.Logger
	metrics  *metrics.Metrics // nil: not counted, no /metrics
	builds   BuildPolicy      // set before serving (SetBuildPolicy)
	keys     KeyStore         // nil: only the admin key (AdminService refuses)
	audit    *audit.Log       // nil: nothing audited
	// sandboxRoutes are the patterns registered through sandboxRoute
	// (authz.go). Written by Handler only.
	sandboxRoutes map[string]bool
	started       time.Time       // when New made it (MonitorService)
	dash          *dashboard      // the web dashboard's sessions (dash.go)
	name          string          // the node's name in its status (SetNodeName; "": the host name)
	envs          *ClusterEnvs    // nil: environments in the node's own store (SetClusterEnvs: in etcd)
	fncall        *fncallService  // the FnCall engine Handler started (Close stops it)
	streams       *limits.Streams // caps on concurrent streams (SetStreams; nil: none)
}

var (
	_ shoalv1connect.SandboxServiceHandler = (*Server)(nil)
	_ shoalv1connect.CommandServiceHandler = (*Server)(nil)
	_ shoalv1connect.LayerServiceHandler   = (*Server)(nil)
	_ shoalv1connect.AdminServiceHandler   = (*Server)(nil)
)

// New returns the API server.
func New(m *node.Manager, sessions *session.Manager, auth *Auth, log *slog.Logger) *Server {
	s := &Server{node: m, sessions: sessions, auth: auth, log: log, builds: BuildPolicy{UploadMax: layer.DefaultUploadMax}, started: time.Now()}
	s.dash = newDashboard(auth, log, func() *audit.Log { return s.audit }, s.openTerminal)
	return s
}

// Handler returns the HTTP handler for the whole API.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	if s.metrics != nil {
		mux.Handle("GET /metrics", s.metrics.Handler()) // authenticated like the rest
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintln(w, `{"status":"ok"}`)
	})
	mux.Handle(shoalv1connect.NewSandboxServiceHandler(s, s.handlerOptions()...)) // strict JSON (codec.go)
	mux.Handle(shoalv1connect.NewLayerServiceHandler(s, s.handlerOptions()...))
	mux.Handle(shoalv1connect.NewCommandServiceHandler(s, s.handlerOptions()...))
	mux.Handle(shoalv1connect.NewAdminServiceHandler(s, s.handlerOptions()...))   // admin.go
	mux.Handle(shoalv1connect.NewMonitorServiceHandler(s, s.handlerOptions()...)) // monitor.go
	s.sandboxRoute(mux, "GET /v1/sandboxes/{id}/files", s.readFile)               // authz.go: {id} resolved for the key
	s.sandboxRoute(mux, "PUT /v1/sandboxes/{id}/files", s.writeFile)
	s.portRoutes(mux) // /v1/sandboxes/{id}/ports/{port}/... (ports.go)
	s.layerRoutes(mux)
	s.fncallRoutes(mux) // FnCallService, CreateSandbox of backend "fncall" (fncall.go)
	// A /shoal.v1.* procedure not served here: unimplemented (codec.go).
	// Every request: authenticated (the key's principal in its context),
	// then authorized: RPCs by authzInterceptor, routes by routeGate.
	api := s.auth.Middleware(s.countRoutes(s.routeGate(mux, unknownProcedures(mux))), "/healthz")
	return s.dash.handler(api) // /dash/...: the web dashboard, its own login (dash.go)
}

// --- sandboxes ---

func (s *Server) CreateSandbox(ctx context.Context, req *connect.Request[pb.CreateSandboxRequest]) (*connect.Response[pb.Sandbox], error) {
	r := req.Msg
	var autoPause *time.Duration
	if r.AutoPauseSeconds != nil {
		d := limits.Seconds(*r.AutoPauseSeconds) // the node checks the range
		autoPause = &d
	}
	s.catchUpTags(ctx, req.Header()) // envs_cluster.go
	// Every value is checked by the node (node.Manager.validate), the same
	// for every API face.
	rec, err := s.node.Create(ctx, node.CreateRequest{
		Backend: r.Backend, Template: r.Template, Base: r.Base, Workspaces: r.Workspaces, Toolkits: r.Toolkits,
		Memory: r.MemoryBytes, MilliCPU: r.Millicpu, Disk: r.DiskBytes, LogBudget: r.LogBudgetBytes, QoS: r.Qos, Timeout: limits.Seconds(r.TimeoutSeconds),
		Metadata: r.Metadata, Env: r.Env, ClientKey: r.ClientKey, AutoPause: autoPause,
		Network: networkReq(r.Network),
		Tenant:  tenant.FromContext(ctx).Tenant,
		Owner:   layerOwner(ctx),
	})
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(s.sandboxOut(ctx, rec)), nil
}

func (s *Server) GetSandbox(ctx context.Context, req *connect.Request[pb.GetSandboxRequest]) (*connect.Response[pb.Sandbox], error) {
	rec, err := s.node.Get(req.Msg.Id)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(s.sandboxOut(ctx, rec)), nil
}

func (s *Server) ListSandboxes(ctx context.Context, req *connect.Request[pb.ListSandboxesRequest]) (*connect.Response[pb.ListSandboxesResponse], error) {
	out := &pb.ListSandboxesResponse{}
	p := tenant.FromContext(ctx)
	for _, rec := range s.node.List() {
		if !p.Sees(rec.Tenant) {
			continue
		}
		out.Sandboxes = append(out.Sandboxes, s.sandboxOut(ctx, rec))
	}
	return connect.NewResponse(out), nil
}

func (s *Server) DeleteSandbox(ctx context.Context, req *connect.Request[pb.DeleteSandboxRequest]) (*connect.Response[pb.DeleteSandboxResponse], error) {
	if err := s.node.Delete(ctx, req.Msg.Id); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.DeleteSandboxResponse{}), nil
}

func (s *Server) SetTimeout(ctx context.Context, req *connect.Request[pb.SetTimeoutRequest]) (*connect.Response[pb.Sandbox], error) {
	rec, err := s.node.SetTimeout(req.Msg.Id, limits.Seconds(req.Msg.TimeoutSeconds))
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(s.sandboxOut(ctx, rec)), nil
}

// networkReq is a create's network policy; nil: none.
func networkReq(n *pb.NetworkPolicy) *netpolicy.Request {
	if n == nil {
		return nil
	}
	return &netpolicy.Request{Internet: n.Internet, AllowOut: n.AllowOut, DenyOut: n.DenyOut}
}

func (s *Server) PauseSandbox(ctx context.Context, req *connect.Request[pb.PauseSandboxRequest]) (*connect.Response[pb.PauseSandboxResponse], error) {
	pause := s.node.Pause
	if req.Msg.FsOnly {
		pause = s.node.PauseFSOnly
	}
	rec, paused, err := pause(ctx, req.Msg.Id)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.PauseSandboxResponse{Sandbox: sandboxPB(rec), Paused: paused}), nil
}

func (s *Server) ResumeSandbox(ctx context.Context, req *connect.Request[pb.ResumeSandboxRequest]) (*connect.Response[pb.ResumeSandboxResponse], error) {
	rec, resumed, err := s.node.Resume(ctx, req.Msg.Id)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.ResumeSandboxResponse{Sandbox: sandboxPB(rec), Resumed: resumed}), nil
}

func (s *Server) ResetSandbox(ctx context.Context, req *connect.Request[pb.ResetSandboxRequest]) (*connect.Response[pb.ResetSandboxResponse], error) {
	rec, took, err := s.node.Reset(ctx, req.Msg.Id)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.ResetSandboxResponse{Sandbox: sandboxPB(rec), ResetSeconds: took.Seconds()}), nil
}

func pausePB(p *node.PauseInfo) *pb.PauseInfo {
	if p == nil {
		return nil
	}
	out := &pb.PauseInfo{
		PausedAt: timestamppb.New(p.At), Auto: p.Auto,
		MemoryBeforeBytes: p.Stats.MemoryBefore, MemoryAfterBytes: p.Stats.MemoryAfter, SwappedOutBytes: p.Stats.SwappedOut,
		Method: p.Stats.Method, FreezeSeconds: p.Stats.FreezeTook.Seconds(), ReclaimSeconds: p.Stats.ReclaimTook.Seconds(),
		ResumeSeconds: p.ResumeTook.Seconds(), Evicted: p.Evicted, FilePagesOnly: p.Stats.FilePagesOnly,
		FsOnly: p.FSOnly,
	}
	if p.Evict != nil {
		out.EvictSeconds, out.EvictedToBytes = p.Evict.ReclaimTook.Seconds(), p.Evict.SwappedOut
	}
	if !p.ResumedAt.IsZero() {
		out.ResumedAt = timestamppb.New(p.ResumedAt)
	}
	return out
}

func sandboxPB(r node.Record) *pb.Sandbox {
	out := &pb.Sandbox{
		Id: r.ID, Backend: r.Backend, MemoryBytes: r.Resources.MemoryBytes, Millicpu: r.Resources.MilliCPU, DiskBytes: r.Resources.DiskBytes,
		LogBudgetBytes: r.Resources.LogBytes,
		PidsLimit:      r.Resources.Pids, TimeoutSeconds: int64(r.Timeout / time.Second),
		CreatedAt: timestamppb.New(r.Created), ExpiresAt: timestamppb.New(r.Expires),
		Metadata: r.Metadata, Error: r.Error, Tenant: r.Tenant, Qos: node.QoSLatencySensitive,
		AutoPauseSeconds: int64(r.AutoPause / time.Second), Pause: pausePB(r.Pause),
		Image: imageConfigPB(r.Image), // images.go
	}
	if r.Resources.BestEffort {
		out.Qos = node.QoSBestEffort
	}
	switch r.State {
	case node.StateCreating:
		out.State = pb.SandboxState_SANDBOX_STATE_CREATING
	case node.StateRunning:
		out.State = pb.SandboxState_SANDBOX_STATE_RUNNING
	case node.StateDeleting:
		out.State = pb.SandboxState_SANDBOX_STATE_DELETING
	case node.StateError:
		out.State = pb.SandboxState_SANDBOX_STATE_ERROR
	case node.StatePaused:
		out.State = pb.SandboxState_SANDBOX_STATE_PAUSED
	}
	for _, l := range r.Layers {
		out.Layers = append(out.Layers, &pb.LayerRef{Kind: kindPB(l.Kind), Ref: l.Ref, Digest: l.Digest})
	}
	if n := r.Network; n != nil {
		out.Network = &pb.NetworkPolicy{Internet: n.Internet, AllowOut: n.AllowOut, DenyOut: n.DenyOut}
	}
	out.Runtime = map[string]string{}
	for k, v := range r.Handle.Data {
		if k != "dir" {
			out.Runtime[k] = v
		}
	}
	if r.Handle.AgentSocket != "" {
		out.Runtime["agent_socket"] = r.Handle.AgentSocket
	}
	if out.Runtime["runc_id"] == "" && r.Backend == "container" {
		out.Runtime["runc_id"] = r.ID
	}
	return out
}

// sandboxOut is a sandbox as the principal of ctx sees it: the runtime
// (host paths, runtime IDs) is for admin keys only.
func (s *Server) sandboxOut(ctx context.Context, r node.Record) *pb.Sandbox {
	out := sandboxPB(r)
	if !tenant.FromContext(ctx).IsAdmin() {
		out.Runtime = nil
	}
	return out
}
