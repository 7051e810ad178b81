package control

import (
	"context"
	"log/slog"
	"sort"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/audit"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// --- AdminService: keys, tenants' quotas, the audit log ---
//
// Scopes are checked by authzInterceptor (authz.go): every method but
// WhoAmI needs admin.

// KeyStore holds the tenants' keys and quotas: one node's (*tenant.Store,
// in its bbolt file) or a cluster's (*cluster.Tenancy, in etcd, followed by
// every node and control replica). Reads are from memory; writes are
// durable when they return. Implementations are safe for concurrent use.
type KeyStore interface {
	// Resolve returns the key whose plaintext is plaintext.
	Resolve(plaintext string) (tenant.Key, bool)
	// Keys lists the keys by name.
	Keys() []tenant.Key
	// Quota returns a tenant's quota (zero: no bound).
	Quota(t string) tenant.Quota
	// Tenants lists every tenant that has a key or a quota.
	Tenants() map[string]tenant.Quota
	// CreateKey makes and stores a key (tenant.NewKey) and returns its
	// plaintext: already_exists when the name is taken.
	CreateKey(ctx context.Context, name, tenant string, scopes []tenant.Scope) (string, tenant.Key, error)
	// DeleteKey removes the key named name: not_found when there is none.
	DeleteKey(ctx context.Context, name string) (tenant.Key, error)
	// SetQuota sets a tenant's quota (a zero Quota removes it).
	SetQuota(ctx context.Context, t string, q tenant.Quota) error
}

var _ KeyStore = (*tenant.Store)(nil)

// SetTenancy gives the server its key store (AdminService, tenants' keys)
// and audit log (nil: none). Call it before Handler.
func (s *Server) SetTenancy(keys KeyStore, log *audit.Log) {
	s.keys, s.audit = keys, log
	s.auth.SetKeys(keys)
}

func (s *Server) keyStore() (KeyStore, error) {
	if s.keys == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errdefs.New(errdefs.ErrFailedPrecondition, "this server has no key store"))
	}
	return s.keys, nil
}

func keyPB(k tenant.Key) *pb.Key {
	out := &pb.Key{Name: k.Name, Tenant: k.Tenant, CreatedAt: timestamppb.New(k.Created)}
	for _, sc := range k.Scopes {
		out.Scopes = append(out.Scopes, string(sc))
	}
	return out
}

func (s *Server) CreateKey(ctx context.Context, req *connect.Request[pb.CreateKeyRequest]) (*connect.Response[pb.CreateKeyResponse], error) {
	ks, err := s.keyStore()
	if err != nil {
		return nil, err
	}
	return createKey(ctx, ks, req, s.log)
}

// createKey serves CreateKey from ks (a node's, a control replica's).
func createKey(ctx context.Context, ks KeyStore, req *connect.Request[pb.CreateKeyRequest], log *slog.Logger) (*connect.Response[pb.CreateKeyResponse], error) {
	var scopes []tenant.Scope
	for _, sc := range req.Msg.Scopes {
		p, err := tenant.ParseScopes(sc)
		if err != nil {
			return nil, toConnect(err)
		}
		scopes = append(scopes, p...)
	}
	if len(scopes) == 0 {
		return nil, toConnect(errdefs.New(errdefs.ErrInvalidArgument, "a key needs at least one scope (sandboxes, layers:read, layers:write, admin)"))
	}
	secret, k, err := ks.CreateKey(ctx, req.Msg.Name, req.Msg.Tenant, scopes)
	if err != nil {
		return nil, toConnect(err)
	}
	log.Info("key created", "key", k.Name, "tenant", k.Tenant, "scopes", k.Scopes, "by", tenant.FromContext(ctx).String())
	return connect.NewResponse(&pb.CreateKeyResponse{Key: keyPB(k), Secret: secret}), nil
}

func (s *Server) ListKeys(ctx context.Context, req *connect.Request[pb.ListKeysRequest]) (*connect.Response[pb.ListKeysResponse], error) {
	ks, err := s.keyStore()
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(listKeys(ks)), nil
}

func listKeys(ks KeyStore) *pb.ListKeysResponse {
	out := &pb.ListKeysResponse{}
	for _, k := range ks.Keys() {
		out.Keys = append(out.Keys, keyPB(k))
	}
	return out
}

func (s *Server) DeleteKey(ctx context.Context, req *connect.Request[pb.DeleteKeyRequest]) (*connect.Response[pb.DeleteKeyResponse], error) {
	ks, err := s.keyStore()
	if err != nil {
		return nil, err
	}
	k, err := ks.DeleteKey(ctx, req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	s.log.Info("key removed", "key", k.Name, "tenant", k.Tenant, "by", tenant.FromContext(ctx).String())
	return connect.NewResponse(&pb.DeleteKeyResponse{}), nil
}

func quotaOf(q *pb.Quota) tenant.Quota {
	if q == nil {
		return tenant.Quota{}
	}
	return tenant.Quota{MaxSandboxes: q.MaxSandboxes, MaxMemory: q.MaxMemoryBytes, MaxMilliCPU: q.MaxMillicpu, CreatesPerSecond: q.CreatesPerSecond, Burst: q.Burst}
}

func quotaPB(q tenant.Quota) *pb.Quota {
	return &pb.Quota{MaxSandboxes: q.MaxSandboxes, MaxMemoryBytes: q.MaxMemory, MaxMillicpu: q.MaxMilliCPU, CreatesPerSecond: q.CreatesPerSecond, Burst: q.Burst}
}

func (s *Server) SetTenant(ctx context.Context, req *connect.Request[pb.SetTenantRequest]) (*connect.Response[pb.Tenant], error) {
	ks, err := s.keyStore()
	if err != nil {
		return nil, err
	}
	if err := ks.SetQuota(ctx, req.Msg.Name, quotaOf(req.Msg.Quota)); err != nil {
		return nil, toConnect(err)
	}
	s.log.Info("tenant quota set", "tenant", req.Msg.Name, "quota", quotaOf(req.Msg.Quota), "by", tenant.FromContext(ctx).String())
	return connect.NewResponse(s.tenants()[req.Msg.Name]), nil
}

// tenants is every tenant with a key, a quota or a sandbox, with usage.
func (s *Server) tenants() map[string]*pb.Tenant {
	out := map[string]*pb.Tenant{}
	get := func(name string) *pb.Tenant {
		t := out[name]
		if t == nil {
			t = &pb.Tenant{Name: name, Quota: quotaPB(s.keys.Quota(name))}
			out[name] = t
		}
		return t
	}
	for name := range s.keys.Tenants() {
		get(name)
	}
	for _, k := range s.keys.Keys() {
		if k.Tenant != "" {
			get(k.Tenant).Keys++
		}
	}
	for _, rec := range s.node.List() {
		if rec.Tenant == "" {
			continue
		}
		t := get(rec.Tenant)
		t.Sandboxes++
		t.MemoryBytes += rec.Resources.MemoryBytes
		t.Millicpu += rec.Resources.MilliCPU
	}
	return out
}

func (s *Server) ListTenants(ctx context.Context, req *connect.Request[pb.ListTenantsRequest]) (*connect.Response[pb.ListTenantsResponse], error) {
	if _, err := s.keyStore(); err != nil {
		return nil, err
	}
	out := &pb.ListTenantsResponse{}
	for _, t := range s.tenants() {
		out.Tenants = append(out.Tenants, t)
	}
	sort.Slice(out.Tenants, func(i, j int) bool { return out.Tenants[i].Name < out.Tenants[j].Name })
	return connect.NewResponse(out), nil
}

func (s *Server) ReadAudit(ctx context.Context, req *connect.Request[pb.ReadAuditRequest]) (*connect.Response[pb.ReadAuditResponse], error) {
	if s.audit == nil {
		return nil, toConnect(errdefs.New(errdefs.ErrFailedPrecondition, "this server keeps no audit log"))
	}
	tail, err := auditTail(req.Msg.Tail)
	if err != nil {
		return nil, err
	}
	entries, err := audit.Read(s.audit.Path(), tail, req.Msg.Tenant)
	if err != nil {
		return nil, toConnect(err)
	}
	out := &pb.ReadAuditResponse{}
	for _, e := range entries {
		out.Entries = append(out.Entries, auditPB(e))
	}
	return connect.NewResponse(out), nil
}

// auditTail checks ReadAudit's tail (0: 100).
func auditTail(n int32) (int, error) {
	tail := int(n)
	switch {
	case tail < 0 || tail > audit.MaxTail:
		return 0, toConnect(errdefs.New(errdefs.ErrInvalidArgument, "tail %d: want 1 to %d (0: 100)", tail, audit.MaxTail))
	case tail == 0:
		tail = 100
	}
	return tail, nil
}

func auditPB(e audit.Entry) *pb.AuditEntry {
	return &pb.AuditEntry{
		Time: timestamppb.New(e.Time), Key: e.Key, Tenant: e.Tenant, Action: e.Action,
		Object: e.Object, Detail: e.Detail, Result: e.Result,
	}
}

func (s *Server) WhoAmI(ctx context.Context, req *connect.Request[pb.WhoAmIRequest]) (*connect.Response[pb.Key], error) {
	return whoAmI(ctx, req)
}

func whoAmI(ctx context.Context, _ *connect.Request[pb.WhoAmIRequest]) (*connect.Response[pb.Key], error) {
	p := tenant.FromContext(ctx)
	if p == nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, errdefs.New(errdefs.ErrPermissionDenied, "no key"))
	}
	out := &pb.Key{Name: p.Key, Tenant: p.Tenant}
	for _, sc := range p.Scopes {
		out.Scopes = append(out.Scopes, string(sc))
	}
	return connect.NewResponse(out), nil
}
