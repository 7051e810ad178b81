package control

// The control role: the same API as a node's (the same Connect services,
// the same plain HTTP routes), served in front of many nodes by forwarding
// each call to the node it concerns. Clients (the SDKs, the CLI) cannot
// tell it from a node.
//
//   - CreateSandbox goes through placement (internal/placement): the best
//     node is tried, and a node's refusal (unavailable: "node full") moves
//     the create to the next candidate. The sandbox ID the node makes
//     starts with the node's tag (internal/cluster), so that every later
//     call is routed without asking anyone.
//   - A call that names a sandbox (sandbox_id, or id in SandboxService; the
//     {id} of a plain route) goes to the sandbox's node, read from the
//     Directory that follows etcd: nothing on this path waits on etcd.
//     The sandboxes of a node that is down are lost: unavailable, saying
//     so.
//   - ListSandboxes asks every live node and adds the lost sandboxes of
//     the catalog.
//   - Layer tags and environments are etcd's, mirrored by every node: a
//     layer call goes to one node chosen for the layer (a read to a node
//     that holds it, a build or tag to one with a layer store:
//     forward_layers.go); GC, pulls and removals by digest to every live
//     node in turn. Environments: envs_cluster.go.
//
// Keys: the control role accepts the cluster's admin key (DATA/admin.key
// of the control role, the same file on every node) and the tenants' keys
// of the cluster (in etcd: forward_admin.go), and passes the client's
// credentials on to the node, which checks them again.

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/metrics"
	"github.com/shoal-sandbox/shoal/internal/placement"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// Forwarder serves the API of a control replica.
type Forwarder struct {
	dir    *cluster.Directory
	place  *placement.Engine
	auth   *Auth
	client *http.Client
	log    *slog.Logger
	dash   *dashboard       // the web dashboard's sessions (dash.go); its terminal goes to the sandbox's node
	ten    forwarderTenancy // the cluster's keys, quotas and the replica's audit log (forward_admin.go)
	// claims: where creates with a client key went (idempotent.go);
	// replica names this replica in them.
	claims  *cluster.Claims
	replica string
	metrics *metrics.Metrics // nil: none (forward_metrics.go)
}

// NewForwarder returns the API of a control replica over the nodes of dir,
// placing creates with engine (the one dir feeds).
func NewForwarder(dir *cluster.Directory, engine *placement.Engine, auth *Auth, log *slog.Logger) *Forwarder {
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        1024,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     90 * time.Second,
	}
	claims, _ := cluster.NewClaims(dir.Client(), 0)
	f := &Forwarder{dir: dir, place: engine, auth: auth, client: &http.Client{Transport: tr}, log: log, claims: claims, replica: randomHex(4)}
	f.dash = newDashboard(auth, log, nil, f.proxyTerminal)
	return f
}

// SetNodeTLS sets what the replica trusts and presents when it calls a
// node or another replica at an https:// URL (before it serves).
func (f *Forwarder) SetNodeTLS(cfg *tls.Config) {
	f.client.Transport.(*http.Transport).TLSClientConfig = cfg
}

// route says where a procedure's calls go.
type route int

const (
	toSandbox    route = iota // the node of the sandbox the request names
	toAny                     // any live node
	toAll                     // every live node, in turn
	toLayer                   // a node that holds the layer the request names, else any (forward_layers.go)
	toLayerStore              // a node that holds it and has a layer store, else one with a store, else any
	toTagOrAll                // a tag: one node (toLayer); a digest: every live node
)

// Handler returns the HTTP handler of the whole API, and the dashboard
// (/dash/...: the cluster's nodes and sandboxes, forward_monitor.go).
func (f *Forwarder) Handler() http.Handler {
	return f.dash.handler(f.dash.withSessionKeys(f.auth.Middleware(countRoutes(f.metrics, unknownProcedures(f.routes())), "/healthz")))
}

func (f *Forwarder) routes() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, "{\"status\":\"ok\",\"role\":\"control\",\"nodes\":%d}\n", len(f.dir.Live()))
	})
	opts := baseHandlerOptions()
	// Counted first (refusals too), then the scopes checked.
	if f.metrics != nil {
		opts = append(opts, connect.WithInterceptors(metricsInterceptor{f.metrics}, scopeInterceptor{f}))
		mux.HandleFunc("GET /metrics", f.serveMetrics)
	} else {
		opts = append(opts, connect.WithInterceptors(scopeInterceptor{f}))
	}
	s, c, l, fn := "/shoal.v1.SandboxService/", "/shoal.v1.CommandService/", "/shoal.v1.LayerService/", "/shoal.v1.FnCallService/"

	mux.Handle(s+"CreateSandbox", connect.NewUnaryHandler(s+"CreateSandbox", f.createSandbox, opts...))
	mux.Handle(s+"ListSandboxes", connect.NewUnaryHandler(s+"ListSandboxes", f.listSandboxes, opts...))
	unary[pb.GetSandboxRequest, pb.Sandbox](f, mux, s+"GetSandbox", toSandbox, opts)
	mux.Handle(s+"DeleteSandbox", connect.NewUnaryHandler(s+"DeleteSandbox", f.deleteSandbox, opts...))
	unary[pb.SetTimeoutRequest, pb.Sandbox](f, mux, s+"SetTimeout", toSandbox, opts)
	unary[pb.PauseSandboxRequest, pb.PauseSandboxResponse](f, mux, s+"PauseSandbox", toSandbox, opts)
	unary[pb.ResumeSandboxRequest, pb.ResumeSandboxResponse](f, mux, s+"ResumeSandbox", toSandbox, opts)
	unary[pb.ResetSandboxRequest, pb.ResetSandboxResponse](f, mux, s+"ResetSandbox", toSandbox, opts)
	unary[pb.StatFileRequest, pb.FileInfo](f, mux, s+"StatFile", toSandbox, opts)
	unary[pb.ListDirRequest, pb.ListDirResponse](f, mux, s+"ListDir", toSandbox, opts)
	unary[pb.MakeDirRequest, pb.MakeDirResponse](f, mux, s+"MakeDir", toSandbox, opts)
	unary[pb.RemoveFileRequest, pb.RemoveFileResponse](f, mux, s+"RemoveFile", toSandbox, opts)
	stream[pb.WatchDirRequest, pb.WatchDirEvent](f, mux, s+"WatchDir", toSandbox, opts)

	stream[pb.ExecRequest, pb.CommandEvent](f, mux, c+"Exec", toSandbox, opts)
	unary[pb.ExecRequest, pb.Command](f, mux, c+"StartCommand", toSandbox, opts)
	stream[pb.ConnectCommandRequest, pb.CommandEvent](f, mux, c+"ConnectCommand", toSandbox, opts)
	unary[pb.WaitCommandRequest, pb.Command](f, mux, c+"WaitCommand", toSandbox, opts)
	unary[pb.GetCommandRequest, pb.Command](f, mux, c+"GetCommand", toSandbox, opts)
	unary[pb.ListCommandsRequest, pb.ListCommandsResponse](f, mux, c+"ListCommands", toSandbox, opts)
	unary[pb.SendStdinRequest, pb.SendStdinResponse](f, mux, c+"SendStdin", toSandbox, opts)
	unary[pb.SignalCommandRequest, pb.SignalCommandResponse](f, mux, c+"SignalCommand", toSandbox, opts)
	unary[pb.ResizePtyRequest, pb.ResizePtyResponse](f, mux, c+"ResizePty", toSandbox, opts)
	unary[pb.ListTrajectoriesRequest, pb.ListTrajectoriesResponse](f, mux, c+"ListTrajectories", toSandbox, opts)
	unary[pb.GetTrajectoryRequest, pb.Trajectory](f, mux, c+"GetTrajectory", toSandbox, opts)
	unary[pb.CreateShellRequest, pb.Shell](f, mux, c+"CreateShell", toSandbox, opts)
	unary[pb.RunInShellRequest, pb.ShellResult](f, mux, c+"RunInShell", toSandbox, opts)
	unary[pb.ListShellsRequest, pb.ListShellsResponse](f, mux, c+"ListShells", toSandbox, opts)
	unary[pb.DeleteShellRequest, pb.DeleteShellResponse](f, mux, c+"DeleteShell", toSandbox, opts)

	// Layers: tags are etcd's, mirrored by every node (forward_layers.go).
	stream[pb.BuildLayerRequest, pb.BuildLayerResponse](f, mux, l+"BuildLayer", toLayerStore, opts)
	stream[pb.CommitLayerRequest, pb.BuildLayerResponse](f, mux, l+"CommitLayer", toSandbox, opts)
	mux.Handle(l+"ListLayers", connect.NewUnaryHandler(l+"ListLayers", f.listLayers, opts...))
	mux.Handle(l+"GetLayer", connect.NewUnaryHandler(l+"GetLayer", f.getLayer, opts...))
	unary[pb.TagLayerRequest, pb.TagLayerResponse](f, mux, l+"TagLayer", toLayerStore, opts)
	unary[pb.DeleteLayerRequest, pb.DeleteLayerResponse](f, mux, l+"DeleteLayer", toTagOrAll, opts)
	unary[pb.GarbageCollectLayersRequest, pb.GarbageCollectLayersResponse](f, mux, l+"GarbageCollectLayers", toAll, opts)
	unary[pb.PushLayerRequest, pb.PushLayerResponse](f, mux, l+"PushLayer", toLayer, opts)
	stream[pb.PushLayerRequest, pb.PushLayerEvent](f, mux, l+"PushLayerProgress", toLayer, opts)
	unary[pb.PullLayerRequest, pb.Layer](f, mux, l+"PullLayer", toAll, opts)
	stream[pb.PullImageRequest, pb.PullImageEvent](f, mux, l+"PullImage", toLayerStore, opts)
	// Environments: etcd's (envs_cluster.go).
	mux.Handle(l+"CreateEnvironment", connect.NewUnaryHandler(l+"CreateEnvironment", f.createEnvironment, opts...))
	mux.Handle(l+"GetEnvironment", connect.NewUnaryHandler(l+"GetEnvironment", f.getEnvironment, opts...))
	mux.Handle(l+"ListEnvironments", connect.NewUnaryHandler(l+"ListEnvironments", f.listEnvironments, opts...))
	mux.Handle(l+"DeleteEnvironment", connect.NewUnaryHandler(l+"DeleteEnvironment", f.deleteEnvironment, opts...))

	mux.Handle("/shoal.v1.MonitorService/GetStatus", connect.NewUnaryHandler("/shoal.v1.MonitorService/GetStatus", f.getStatus, opts...))

	unary[pb.RunRequest, pb.RunResult](f, mux, fn+"Run", toAny, opts)
	stream[pb.RunBatchRequest, pb.RunBatchResult](f, mux, fn+"RunBatch", toAny, opts)
	unary[pb.ListLanguagesRequest, pb.ListLanguagesResponse](f, mux, fn+"ListLanguages", toAny, opts)

	f.adminRoutes(mux, opts) // forward_admin.go: the cluster's keys, tenants and audit

	for _, p := range []string{"GET /v1/sandboxes/{id}/files", "PUT /v1/sandboxes/{id}/files", "/v1/sandboxes/{id}/ports/{port}/{path...}"} {
		mux.HandleFunc(p, f.proxySandboxRoute)
	}
	// Exports to a node that holds the layer; imports and builds from an
	// upload to one with a layer store (forward_layers.go).
	mux.HandleFunc("GET /v1/layers/export", f.proxyLayerRoute)
	mux.HandleFunc("POST /v1/layers/import", f.proxyLayerRoute)
	mux.HandleFunc("POST /v1/layers/build", f.proxyLayerRoute)
	return mux
}

// scopeInterceptor checks the key's scopes for the procedure (authz.go's
// procedureScopes), as a node does; the node checks again, with the
// sandbox's tenant. A refusal is audited here (the node never sees the
// call), and so are the calls the replica serves itself (AdminService).
type scopeInterceptor struct{ f *Forwarder }

func (i scopeInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		proc := req.Spec().Procedure
		if err := authorizeProcedure(ctx, proc); err != nil {
			err = toConnect(err)
			i.f.auditRPC(ctx, proc, req.Any(), nil, err)
			return nil, err
		}
		res, err := next(ctx, req)
		if strings.HasPrefix(proc, "/shoal.v1.AdminService/") {
			var out any
			if err == nil && res != nil {
				out = res.Any()
			}
			i.f.auditRPC(ctx, proc, req.Any(), out, err)
		}
		return res, err
	}
}

func (scopeInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i scopeInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		proc := conn.Spec().Procedure
		if err := authorizeProcedure(ctx, proc); err != nil {
			err = toConnect(err)
			i.f.auditRPC(ctx, proc, nil, nil, err)
			return err
		}
		return next(ctx, conn)
	}
}

// targets returns the nodes a call of proc with request m goes to.
func (f *Forwarder) targets(proc string, how route, m proto.Message) ([]cluster.NodeInfo, error) {
	switch how {
	case toSandbox:
		id, ok := requestSandbox(proc, m)
		if !ok || id == "" {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("the request names no sandbox"))
		}
		n, err := f.dir.ForSandbox(id)
		if err != nil {
			return nil, toConnect(err)
		}
		return []cluster.NodeInfo{n}, nil
	case toTagOrAll:
		if !isTag(layerRef(m)) {
			return f.targets(proc, toAll, m)
		}
		return f.targets(proc, toLayer, m)
	case toLayer, toLayerStore:
		n, err := f.layerNode(layerRef(m), how == toLayerStore)
		if err != nil {
			return nil, toConnect(err)
		}
		return []cluster.NodeInfo{n}, nil
	case toAny, toAll:
		live := f.dir.Live()
		if len(live) == 0 {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("no node is up in the cluster"))
		}
		if how == toAny {
			return []cluster.NodeInfo{live[rand.IntN(len(live))]}, nil
		}
		return live, nil
	}
	return nil, connect.NewError(connect.CodeUnimplemented, fmt.Errorf("%s is not served by a control replica yet: call it on a node's API", shortProcedure(proc)))
}

// outgoing is the request passed on to a node: the message, and the
// client's credentials.
func outgoing[T any](msg *T, h http.Header) *connect.Request[T] {
	out := connect.NewRequest(msg)
	for _, k := range []string{"Authorization", "X-Api-Key", LayerTagsHeader} {
		if v := h.Get(k); v != "" {
			out.Header().Set(k, v)
		}
	}
	return out
}

// relay is a node's error as the control replica's own: its code, message
// and Shoal's reason metadata, nothing of the node's HTTP headers.
func relay(err error) error {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("forward to node: %w", err))
	}
	out := connect.NewError(ce.Code(), errors.New(ce.Message()))
	if v := ce.Meta().Get(ReasonHeader); v != "" {
		out.Meta().Set(ReasonHeader, v)
	}
	for _, d := range ce.Details() {
		out.AddDetail(d)
	}
	return out
}

// shoalHeaders returns the Shoal-* headers of h.
func shoalHeaders(h http.Header) http.Header {
	out := http.Header{}
	for k, v := range h {
		if strings.HasPrefix(k, "Shoal-") {
			out[k] = v
		}
	}
	return out
}

func clientFor[Req, Res any](f *Forwarder, n cluster.NodeInfo, proc string) *connect.Client[Req, Res] {
	return connect.NewClient[Req, Res](f.client, strings.TrimSuffix(n.URL, "/")+proc)
}

// unary serves proc by forwarding each call as how says.
func unary[Req, Res any](f *Forwarder, mux *http.ServeMux, proc string, how route, opts []connect.HandlerOption) {
	mux.Handle(proc, connect.NewUnaryHandler(proc, func(ctx context.Context, req *connect.Request[Req]) (*connect.Response[Res], error) {
		nodes, err := f.targets(proc, how, any(req.Msg).(proto.Message))
		if err != nil {
			return nil, err
		}
		var first *connect.Response[Res]
		for _, n := range nodes {
			res, err := clientFor[Req, Res](f, n, proc).CallUnary(ctx, outgoing(req.Msg, req.Header()))
			if err != nil {
				if how == toAll {
					return nil, relay(fmt.Errorf("node %s: %w", n.Name, err))
				}
				return nil, relay(err)
			}
			if first == nil {
				first = connect.NewResponse(res.Msg)
			}
		}
		return first, nil
	}, opts...))
}

// stream serves the server-streaming proc by forwarding each call to one
// node and relaying its messages as they come.
func stream[Req, Res any](f *Forwarder, mux *http.ServeMux, proc string, how route, opts []connect.HandlerOption) {
	mux.Handle(proc, connect.NewServerStreamHandler(proc, func(ctx context.Context, req *connect.Request[Req], ss *connect.ServerStream[Res]) error {
		nodes, err := f.targets(proc, how, any(req.Msg).(proto.Message))
		if err != nil {
			return err
		}
		cs, err := clientFor[Req, Res](f, nodes[0], proc).CallServerStream(ctx, outgoing(req.Msg, req.Header()))
		if err != nil {
			return relay(err)
		}
		defer cs.Close()
		// Shoal's own response headers (e.g. Shoal-Watch-Armed, which a
		// node sends ahead of any message) are relayed as they come.
		if h := shoalHeaders(cs.ResponseHeader()); len(h) > 0 {
			for k, v := range h {
				ss.ResponseHeader()[k] = v
			}
			if err := ss.Send(nil); err != nil {
				return err
			}
		}
		for cs.Receive() {
			if err := ss.Send(cs.Msg()); err != nil {
				return err
			}
		}
		if err := cs.Err(); err != nil {
			return relay(err)
		}
		return nil
	}, opts...))
}

// Defaults a node fills in for a create that gives none (node.Config);
// placement counts them.
const (
	placeDefaultMemory   = 512 << 20
	placeDefaultMilliCPU = 1000
)

func (f *Forwarder) createSandbox(ctx context.Context, req *connect.Request[pb.CreateSandboxRequest]) (*connect.Response[pb.Sandbox], error) {
	m := proto.Clone(req.Msg).(*pb.CreateSandboxRequest)
	if err := f.expandTemplate(ctx, m); err != nil {
		return nil, toConnect(err)
	}
	pr := placement.Request{Tenant: tenant.FromContext(ctx).Tenant, Backend: m.Backend, MilliCPU: m.Millicpu, Memory: m.MemoryBytes}
	if pr.Backend == "" {
		pr.Backend = "container"
	}
	if pr.Memory == 0 {
		pr.Memory = placeDefaultMemory
	}
	if pr.MilliCPU == 0 {
		pr.MilliCPU = placeDefaultMilliCPU
	}
	if m.Base != "" {
		pr.Layers = append(pr.Layers, m.Base)
	}
	pr.Layers = append(append(pr.Layers, m.Workspaces...), m.Toolkits...)
	if err := limits.String("client key", m.ClientKey, limits.IDBytes); err != nil {
		return nil, toConnect(err)
	}
	// The tenant's quota across the cluster (forward_admin.go), before
	// any node is asked; not for the retry of a keyed create whose
	// sandbox is made already (it adds none).
	var rsv *cluster.Reservation
	if !f.keyedCreateMade(ctx, pr.Tenant, m.ClientKey) {
		r, err := f.reserve(ctx, "sandbox.create", m.Base, pr.Memory, pr.MilliCPU)
		if err != nil {
			return nil, toConnect(err)
		}
		rsv = r
	}
	defer rsv.Done()
	// The node is told the revisions of the tags the create names, so
	// that it resolves them as etcd has them now.
	h := req.Header().Clone()
	h.Del(LayerTagsHeader)
	if v := f.layerTagsHeader(ctx, m); v != "" {
		h.Set(LayerTagsHeader, v)
	}
	node, sb, err := f.placeAndCreate(ctx, pr, m, h) // idempotent.go
	if err != nil {
		var ce *connect.Error
		if errors.As(err, &ce) && !errors.Is(err, placement.ErrNoCapacity) {
			return nil, relay(err)
		}
		return nil, toConnect(err)
	}
	// The catalog has it before the client does (the node's heartbeat
	// would within a third of its TTL): a node that dies now has it
	// reported lost. Not on the data path: only creates wait.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	rsv.Created(sb.Id)
	if err := f.dir.Catalog(cctx, cluster.CatalogEntry{ID: sb.Id, Node: node, Tenant: sb.Tenant, Created: sb.GetCreatedAt().AsTime(),
		MilliCPU: sb.Millicpu, Memory: sb.MemoryBytes}); err != nil {
		f.log.Warn("cluster: catalog a new sandbox", "sandbox_id", sb.Id, "node", node, "err", err)
	}
	return connect.NewResponse(sb), nil
}

func (f *Forwarder) deleteSandbox(ctx context.Context, req *connect.Request[pb.DeleteSandboxRequest]) (*connect.Response[pb.DeleteSandboxResponse], error) {
	const proc = "/shoal.v1.SandboxService/DeleteSandbox"
	n, err := f.dir.ForSandbox(req.Msg.Id)
	if err != nil {
		return nil, toConnect(err)
	}
	res, err := clientFor[pb.DeleteSandboxRequest, pb.DeleteSandboxResponse](f, n, proc).CallUnary(ctx, outgoing(req.Msg, req.Header()))
	if err != nil {
		return nil, relay(err)
	}
	// Out of the catalog now (the node's heartbeat would, later).
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	if err := f.dir.Uncatalog(cctx, req.Msg.Id); err != nil {
		f.log.Warn("cluster: uncatalog a deleted sandbox", "sandbox_id", req.Msg.Id, "err", err)
	}
	return connect.NewResponse(res.Msg), nil
}

// onEveryNode calls fn for each node at once and returns their answers and
// errors, in the nodes' order.
func onEveryNode[T any](nodes []cluster.NodeInfo, fn func(n cluster.NodeInfo) (T, error)) ([]T, []error) {
	results := make([]T, len(nodes))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = fn(n)
		}()
	}
	wg.Wait()
	return results, errs
}

func (f *Forwarder) listSandboxes(ctx context.Context, req *connect.Request[pb.ListSandboxesRequest]) (*connect.Response[pb.ListSandboxesResponse], error) {
	const proc = "/shoal.v1.SandboxService/ListSandboxes"
	live := f.dir.Live()
	results, errs := onEveryNode(live, func(n cluster.NodeInfo) (*pb.ListSandboxesResponse, error) {
		res, err := clientFor[pb.ListSandboxesRequest, pb.ListSandboxesResponse](f, n, proc).CallUnary(ctx, outgoing(req.Msg, req.Header()))
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", n.Name, err)
		}
		return res.Msg, nil
	})
	p := tenant.FromContext(ctx)
	out := &pb.ListSandboxesResponse{}
	lostAs := func(e cluster.CatalogEntry, why string) {
		if p.Sees(e.Tenant) {
			out.Sandboxes = append(out.Sandboxes, &pb.Sandbox{
				Id: e.ID, State: pb.SandboxState_SANDBOX_STATE_ERROR, Tenant: e.Tenant, CreatedAt: timestamppb.New(e.Created), Error: why,
			})
		}
	}
	for i, r := range results {
		if errs[i] == nil {
			out.Sandboxes = append(out.Sandboxes, r.Sandboxes...)
			continue
		}
		if connect.CodeOf(errs[i]) != connect.CodeUnavailable {
			return nil, relay(errs[i])
		}
		// A node that does not answer (its lease not ended yet): its
		// sandboxes are listed lost, from the catalog, not left out.
		es, err := f.dir.CatalogOf(ctx, live[i].Tag)
		if err != nil {
			return nil, connect.NewError(connect.CodeUnavailable, err)
		}
		for _, e := range es {
			lostAs(e, fmt.Sprintf("lost: its node %s does not answer", live[i].Name))
		}
	}
	defer func() { // as a node lists them: by creation, then ID
		slices.SortStableFunc(out.Sandboxes, func(a, b *pb.Sandbox) int {
			if c := a.GetCreatedAt().AsTime().Compare(b.GetCreatedAt().AsTime()); c != 0 {
				return c
			}
			return strings.Compare(a.Id, b.Id)
		})
	}()
	lost, err := f.dir.Lost(ctx)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, err)
	}
	for _, e := range lost {
		lostAs(e, fmt.Sprintf("lost: its node %s is down", e.Node))
	}
	return connect.NewResponse(out), nil
}

// proxySandboxRoute passes a plain HTTP route of a sandbox (files, ports)
// to the sandbox's node as it is, streaming both ways (Upgrades too).
func (f *Forwarder) proxySandboxRoute(w http.ResponseWriter, r *http.Request) {
	n, err := f.dir.ForSandbox(r.PathValue("id"))
	if err != nil {
		writeConnectError(w, err)
		return
	}
	f.proxyTo(w, r, n) // forward_layers.go
}
