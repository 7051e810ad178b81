package control

// Authorization: who may call what, and on which sandbox.
//
// Every request is authenticated by Auth.Middleware, which puts the key's
// tenant.Principal in the request context. Then, in one place per kind of
// route, before any handler runs:
//
//   - RPCs (every procedure of api/shoal/v1): authzInterceptor, installed
//     by handlerOptions on every connect handler, requires the scopes
//     procedureScopes lists for the procedure (a procedure not listed
//     needs admin: a new RPC is closed until it is classified), and, when
//     the request message names a sandbox (a sandbox_id field, or id in
//     SandboxService), resolves it for the principal with sandboxFor: a
//     sandbox of another tenant is answered exactly as a missing one
//     (node.NotFound). Streams are checked on every message received.
//   - Plain HTTP routes: routeGate requires the scopes routeScopes lists
//     for the matched pattern (not listed: admin), and a route whose
//     pattern has a sandbox {id} is served only when registered through
//     sandboxRoute, which resolves {id} with sandboxFor.
//
// The same interceptor and gate write the audit log (audit.go in
// internal/audit): every call of a procedure or route listed in
// auditActions, with the principal, the object, and the result code.

import (
	"context"
	"fmt"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/audit"
	"github.com/shoal-sandbox/shoal/internal/node"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

var (
	sbx = []tenant.Scope{tenant.ScopeSandboxes}
	lr  = []tenant.Scope{tenant.ScopeLayersRead}
	lw  = []tenant.Scope{tenant.ScopeLayersWrite}
	adm = []tenant.Scope{tenant.ScopeAdmin}
)

// procedureScopes lists the scopes each procedure needs, by short name
// (Service/Method). A procedure not listed needs admin.
var procedureScopes = map[string][]tenant.Scope{
	"SandboxService/CreateSandbox": {tenant.ScopeSandboxes, tenant.ScopeLayersRead},
	"SandboxService/GetSandbox":    sbx,
	"SandboxService/ListSandboxes": sbx,
	"SandboxService/DeleteSandbox": sbx,
	"SandboxService/SetTimeout":    sbx,
	"SandboxService/StatFile":      sbx,
	"SandboxService/ListDir":       sbx,
	"SandboxService/MakeDir":       sbx,
	"SandboxService/RemoveFile":    sbx,
	"SandboxService/PauseSandbox":  sbx,
	"SandboxService/ResumeSandbox": sbx,
	"SandboxService/ResetSandbox":  sbx,
	"SandboxService/WatchDir":      sbx,

	"CommandService/Exec":             sbx,
	"CommandService/StartCommand":     sbx,
	"CommandService/ConnectCommand":   sbx,
	"CommandService/WaitCommand":      sbx,
	"CommandService/GetCommand":       sbx,
	"CommandService/ListCommands":     sbx,
	"CommandService/SendStdin":        sbx,
	"CommandService/SignalCommand":    sbx,
	"CommandService/ResizePty":        sbx,
	"CommandService/ListTrajectories": sbx,
	"CommandService/GetTrajectory":    sbx,
	"CommandService/CreateShell":      sbx,
	"CommandService/RunInShell":       sbx,
	"CommandService/ListShells":       sbx,
	"CommandService/DeleteShell":      sbx,

	// BuildLayer reads a path on the server: admin only.
	"LayerService/BuildLayer":           adm,
	"LayerService/CommitLayer":          {tenant.ScopeSandboxes, tenant.ScopeLayersWrite},
	"LayerService/ListLayers":           lr,
	"LayerService/GetLayer":             lr,
	"LayerService/TagLayer":             lw,
	"LayerService/DeleteLayer":          lw,
	"LayerService/GarbageCollectLayers": adm, // every tenant's dangling images
	"LayerService/CreateEnvironment":    lw,
	"LayerService/GetEnvironment":       lr,
	"LayerService/ListEnvironments":     lr,
	"LayerService/DeleteEnvironment":    lw,
	// Push and pull move images between this node and its own store.
	"LayerService/PushLayer":         lw,
	"LayerService/PushLayerProgress": lw,
	"LayerService/PullLayer":         lw,
	// PullImage fetches from a registry, with the server's own
	// credentials for a registry the request brings none for.
	"LayerService/PullImage": lw,

	"FnCallService/Run":           sbx,
	"FnCallService/RunBatch":      sbx,
	"FnCallService/ListLanguages": sbx,

	"AdminService/WhoAmI": {}, // any key

	"MonitorService/GetStatus": sbx, // node figures for admin keys only
	// The rest of AdminService: admin (not listed).
}

// routeScopes lists the scopes each plain HTTP route needs, by its
// ServeMux pattern; sandbox routes ({id}) must also be registered through
// sandboxRoute. A route not listed needs admin.
var routeScopes = map[string][]tenant.Scope{
	"GET /v1/sandboxes/{id}/files":              sbx,
	"PUT /v1/sandboxes/{id}/files":              sbx,
	"/v1/sandboxes/{id}/ports/{port}/{path...}": sbx,
	"GET /v1/layers/export":                     lw,
	"POST /v1/layers/import":                    lw,
	"POST /v1/layers/build":                     lw,                                                                       // the upload route of branch upload: client bytes, no server path
	"POST /v1/layers/dockerfile":                {tenant.ScopeLayersRead, tenant.ScopeLayersWrite, tenant.ScopeSandboxes}, // FROM names layers; its RUNs are sandboxes
	"GET /metrics":                              adm,
	"GET /healthz":                              {},
}

// auditActions names the audited procedures and routes.
var auditActions = map[string]string{
	"SandboxService/CreateSandbox":      "sandbox.create",
	"SandboxService/DeleteSandbox":      "sandbox.delete",
	"SandboxService/SetTimeout":         "sandbox.timeout",
	"SandboxService/MakeDir":            "file.mkdir",
	"SandboxService/RemoveFile":         "file.remove",
	"CommandService/Exec":               "command.start",
	"CommandService/StartCommand":       "command.start",
	"CommandService/SendStdin":          "command.stdin",
	"CommandService/SignalCommand":      "command.signal",
	"CommandService/CreateShell":        "shell.create",
	"CommandService/RunInShell":         "shell.run",
	"CommandService/DeleteShell":        "shell.delete",
	"LayerService/BuildLayer":           "layer.build",
	"LayerService/PullImage":            "layer.pull-image",
	"LayerService/CommitLayer":          "layer.commit",
	"LayerService/TagLayer":             "layer.tag",
	"LayerService/DeleteLayer":          "layer.rm",
	"LayerService/GarbageCollectLayers": "layer.gc",
	"LayerService/CreateEnvironment":    "env.create",
	"LayerService/DeleteEnvironment":    "env.rm",
	"AdminService/CreateKey":            "key.create",
	"AdminService/DeleteKey":            "key.rm",
	"AdminService/SetTenant":            "tenant.set",
	"PUT /v1/sandboxes/{id}/files":      "file.write",
	"POST /v1/layers/import":            "layer.import",
	"POST /v1/layers/build":             "layer.build",
	"POST /v1/layers/dockerfile":        "layer.build-dockerfile",
}

// shortProcedure is "Service/Method" of "/shoal.v1.Service/Method".
func shortProcedure(procedure string) string {
	return strings.TrimPrefix(procedure, "/shoal.v1.")
}

// sandboxFor returns sandbox id's record if the principal of ctx may see
// it; a sandbox of another tenant is answered exactly as a missing one.
// Every sandbox-scoped request goes through it (authzInterceptor,
// sandboxRoute).
func (s *Server) sandboxFor(ctx context.Context, id string) (node.Record, error) {
	rec, err := s.node.Get(id)
	if err != nil {
		return node.Record{}, err
	}
	if !tenant.FromContext(ctx).Sees(rec.Tenant) {
		return node.Record{}, node.NotFound(id)
	}
	return rec, nil
}

// requestSandbox is the sandbox a request message names: its sandbox_id
// field, or id in SandboxService's requests. ok is false when it names
// none.
func requestSandbox(procedure string, m proto.Message) (id string, ok bool) {
	md := m.ProtoReflect().Descriptor()
	f := md.Fields().ByName("sandbox_id")
	if f == nil && strings.HasPrefix(shortProcedure(procedure), "SandboxService/") {
		f = md.Fields().ByName("id")
	}
	if f == nil || f.Kind() != protoreflect.StringKind || f.Cardinality() == protoreflect.Repeated {
		return "", false
	}
	return m.ProtoReflect().Get(f).String(), true
}

// authorizeProcedure checks the principal's scopes for procedure.
func authorizeProcedure(ctx context.Context, procedure string) error {
	name := shortProcedure(procedure)
	scopes, ok := procedureScopes[name]
	if !ok {
		scopes = adm
	}
	return tenant.FromContext(ctx).Require(name, scopes...)
}

// authorizeMessage checks that the sandbox a request message names (if
// any) is the principal's to see.
func (s *Server) authorizeMessage(ctx context.Context, procedure string, msg any) error {
	m, ok := msg.(proto.Message)
	if !ok {
		return fmt.Errorf("%T is not a protobuf message", msg)
	}
	if id, ok := requestSandbox(procedure, m); ok {
		if _, err := s.sandboxFor(ctx, id); err != nil {
			return err
		}
	}
	return nil
}

// authzInterceptor authorizes every RPC and audits those in auditActions.
type authzInterceptor struct{ s *Server }

func (i authzInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		proc := req.Spec().Procedure
		err := authorizeProcedure(ctx, proc)
		if err == nil {
			err = i.s.authorizeMessage(ctx, proc, req.Any())
		}
		if err != nil {
			err = toConnect(err)
			i.s.auditRPC(ctx, proc, req.Any(), nil, err)
			return nil, err
		}
		res, err := next(ctx, req)
		var out any
		if err == nil && res != nil { // on error res may hold a nil *Response
			out = res.Any()
		}
		i.s.auditRPC(ctx, proc, req.Any(), out, err)
		return res, err
	}
}

func (i authzInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i authzInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		proc := conn.Spec().Procedure
		if err := authorizeProcedure(ctx, proc); err != nil {
			err = toConnect(err)
			i.s.auditRPC(ctx, proc, nil, nil, err)
			return err
		}
		ac := &authzConn{StreamingHandlerConn: conn, s: i.s, ctx: ctx}
		err := next(ctx, ac)
		i.s.auditRPC(ctx, proc, ac.first, nil, err)
		return err
	}
}

// authzConn checks every message a stream receives.
type authzConn struct {
	connect.StreamingHandlerConn
	s     *Server
	ctx   context.Context
	first any // the first message received (audited)
}

func (c *authzConn) Receive(msg any) error {
	if err := c.StreamingHandlerConn.Receive(msg); err != nil {
		return err
	}
	if c.first == nil {
		c.first = msg
	}
	if err := c.s.authorizeMessage(c.ctx, c.Spec().Procedure, msg); err != nil {
		return toConnect(err)
	}
	return nil
}

// routeGate authorizes the plain HTTP routes of mux (everything but RPCs,
// which authzInterceptor checks) and audits those in auditActions.
func (s *Server) routeGate(mux *http.ServeMux, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/shoal.v1.") {
			next.ServeHTTP(w, r)
			return
		}
		_, pattern := mux.Handler(r)
		if pattern == "" { // no route (404, 405) or a redirect
			next.ServeHTTP(w, r)
			return
		}
		p := tenant.FromContext(r.Context())
		scopes, ok := routeScopes[pattern]
		if !ok {
			scopes = adm
		}
		if strings.Contains(pattern, "{id}") && !s.sandboxRoutes[pattern] {
			// A sandbox route registered without sandboxRoute: only the
			// admin may use it (fail closed).
			scopes = adm
		}
		if err := p.Require(pattern, scopes...); err != nil {
			writeConnectError(w, toConnect(err))
			s.auditRoute(r, pattern, "", "", http.StatusForbidden)
			return
		}
		if action := auditActions[pattern]; action != "" && !strings.Contains(pattern, "{id}") {
			sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
			next.ServeHTTP(sw, r)
			s.auditRoute(r, pattern, r.URL.Query().Get("tag"), "", sw.status)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// sandboxRoute registers a plain route whose pattern has a sandbox {id}:
// the handler runs only for a sandbox the principal may see.
func (s *Server) sandboxRoute(mux *http.ServeMux, pattern string, h http.HandlerFunc) {
	if s.sandboxRoutes == nil {
		s.sandboxRoutes = map[string]bool{}
	}
	s.sandboxRoutes[pattern] = true
	action := auditActions[pattern]
	mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
		id := r.PathValue("id")
		if _, err := s.sandboxFor(r.Context(), id); err != nil {
			writeConnectError(w, toConnect(err))
			if action != "" {
				s.auditRoute(r, pattern, id, r.URL.Query().Get("path"), http.StatusNotFound)
			}
			return
		}
		if action == "" {
			h(w, r)
			return
		}
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		h(sw, r)
		s.auditRoute(r, pattern, id, r.URL.Query().Get("path"), sw.status)
	})
}

// --- audit ---

// auditRPC records an audited RPC: its principal, object, detail, result.
func (s *Server) auditRPC(ctx context.Context, procedure string, req, res any, err error) {
	if s.audit == nil {
		return
	}
	if e, ok := rpcAuditEntry(ctx, procedure, req, res, err); ok {
		s.audit.Record(e)
	}
}

// rpcAuditEntry is the audit entry of a call of procedure (ok false: the
// procedure is not audited). A node and a control replica write the same.
func rpcAuditEntry(ctx context.Context, procedure string, req, res any, err error) (audit.Entry, bool) {
	name := shortProcedure(procedure)
	action := auditActions[name]
	if action == "" {
		return audit.Entry{}, false
	}
	p := tenant.FromContext(ctx)
	e := audit.Entry{Key: p.String(), Action: action, Result: rpcCode(err)}
	if p != nil {
		e.Key, e.Tenant = p.Key, p.Tenant
	}
	if m, ok := req.(proto.Message); ok {
		if id, ok := requestSandbox(procedure, m); ok {
			e.Object = id
		}
	}
	switch r := req.(type) {
	case *pb.ExecRequest:
		e.Detail = strings.Join(r.Args, " ")
		if r.TrajectoryId != "" {
			e.Detail = fmt.Sprintf("[trajectory %s step %d] %s", r.TrajectoryId, r.Step, e.Detail)
		}
	case *pb.RunInShellRequest:
		e.Detail = r.Name + ": " + r.Command
	case *pb.CreateShellRequest:
		e.Detail = r.Name
	case *pb.SignalCommandRequest:
		e.Detail = r.CommandId + " " + r.Signal
	case *pb.SendStdinRequest:
		e.Detail = fmt.Sprintf("%s: %d bytes", r.CommandId, len(r.Data))
	case *pb.MakeDirRequest:
		e.Detail = r.Path
	case *pb.RemoveFileRequest:
		e.Detail = r.Path
	case *pb.CommitLayerRequest:
		e.Detail = r.Ref
	case *pb.BuildLayerRequest:
		e.Object, e.Detail = r.Ref, r.Source
	case *pb.PullImageRequest: // never its credentials
		e.Object, e.Detail = r.Image, r.Environment
	case *pb.TagLayerRequest:
		e.Object, e.Detail = r.Target, r.Source
	case *pb.DeleteLayerRequest:
		e.Object = r.Ref
	case *pb.CreateEnvironmentRequest:
		e.Object = r.Name
	case *pb.DeleteEnvironmentRequest:
		e.Object = r.Name
	case *pb.CreateKeyRequest:
		e.Object, e.Detail = r.Name, fmt.Sprintf("tenant=%s scopes=%s", r.Tenant, strings.Join(r.Scopes, ","))
	case *pb.DeleteKeyRequest:
		e.Object = r.Name
	case *pb.SetTenantRequest:
		e.Object = r.Name
		if q := r.Quota; q != nil {
			e.Detail = fmt.Sprintf("max_sandboxes=%d max_memory_bytes=%d max_millicpu=%d creates_per_second=%g burst=%d",
				q.MaxSandboxes, q.MaxMemoryBytes, q.MaxMillicpu, q.CreatesPerSecond, q.Burst)
		}
	case *pb.CreateSandboxRequest:
		base := r.Base
		if r.Template != "" {
			base = "template " + r.Template
		}
		e.Detail = base
		if sb, ok := res.(*pb.Sandbox); ok {
			e.Object = sb.Id
		}
	}
	if c, ok := res.(*pb.Command); ok && c.Id != "" {
		e.Detail = c.Id + ": " + e.Detail
	}
	return e, true
}

// auditRoute records an audited plain route.
func (s *Server) auditRoute(r *http.Request, pattern, object, detail string, status int) {
	action := auditActions[pattern]
	if s.audit == nil || action == "" {
		return
	}
	p := tenant.FromContext(r.Context())
	e := audit.Entry{Key: p.String(), Action: action, Object: object, Detail: detail, Result: httpCode(status)}
	if p != nil {
		e.Key, e.Tenant = p.Key, p.Tenant
	}
	s.audit.Record(e)
}
