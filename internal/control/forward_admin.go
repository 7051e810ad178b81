package control

// Tenants through a control replica: the cluster's keys and quotas live in
// etcd (cluster.Tenancy), which every replica and every node follows, so a
// tenant's key is accepted by any replica (its Shoal API and its E2B API)
// and passed on unchanged to the node, which authenticates it again from
// the same store and checks its scopes and the sandbox's tenant itself: no
// node trusts a replica's word for who a caller is.
//
//   - AdminService is served by the replica: key create/ls/rm and tenant
//     set write etcd (one request each); tenant ls gives each tenant's
//     usage across the cluster (the catalog); whoami answers from the
//     replica's copy.
//   - A create is checked against its tenant's quota across the cluster
//     before placement (cluster.Usage: the catalog plus this replica's
//     creates in flight), and again by the node's admission for the
//     node's share.
//   - The replica's audit log (DATA/audit.log of the replica) records what
//     it does itself: key and tenant changes, and the calls it refuses
//     (a scope a key lacks, a quota); the calls it passes on are recorded
//     by the node that serves them. ReadAudit through a replica merges its
//     own log with every live node's and every other live replica's (the
//     replicas register in etcd: cluster.RegisterReplica).

import (
	"context"
	"net/http"
	"slices"
	"sort"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/audit"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// forwarderTenancy is a control replica's tenants: set once by
// SetTenancy, before serving.
type forwarderTenancy struct {
	keys  KeyStore         // nil: the admin key only; AdminService refuses
	usage *cluster.Usage   // nil: quotas are the nodes' only
	audit *audit.Log       // nil: none
	peers *cluster.Replica // the replica in etcd, to find the others (nil: none)
}

// SetPeers gives the replica its registration (cluster.RegisterReplica):
// ReadAudit reads the other replicas' logs too. Call it before Handler.
func (f *Forwarder) SetPeers(r *cluster.Replica) { f.ten.peers = r }

// auditLocalHeader asks a replica's ReadAudit for its own log only (what
// a replica asks of its peers).
const auditLocalHeader = "Shoal-Audit-Local"

// SetTenancy gives the replica the cluster's keys and quotas (tenants' keys
// are accepted, AdminService is served), the catalog's usage (quotas are
// checked across the cluster before placement) and its audit log. Any may
// be nil. Call it before Handler and E2BHandler.
func (f *Forwarder) SetTenancy(keys KeyStore, usage *cluster.Usage, log *audit.Log) {
	f.ten = forwarderTenancy{keys: keys, usage: usage, audit: log}
	if keys != nil {
		f.auth.SetKeys(keys)
	}
}

func (f *Forwarder) keyStore() (KeyStore, error) {
	if f.ten.keys == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errdefs.New(errdefs.ErrFailedPrecondition, "this control replica has no key store"))
	}
	return f.ten.keys, nil
}

// auditRPC records an audited call the replica served or refused itself.
func (f *Forwarder) auditRPC(ctx context.Context, procedure string, req, res any, err error) {
	if f.ten.audit == nil {
		return
	}
	if e, ok := rpcAuditEntry(ctx, procedure, req, res, err); ok {
		f.ten.audit.Record(e)
	}
}

// reserve claims the create's share of its tenant's quota across the
// cluster (nil: no tenant, or no quota tracking); a refusal is audited as
// action (sandbox.create, e2b.sandbox.create) and returned.
func (f *Forwarder) reserve(ctx context.Context, action, detail string, memory, milliCPU int64) (*cluster.Reservation, error) {
	p := tenant.FromContext(ctx)
	if p == nil || f.ten.usage == nil {
		return nil, nil
	}
	r, err := f.ten.usage.Reserve(p.Tenant, memory, milliCPU)
	if err != nil && f.ten.audit != nil {
		f.ten.audit.Record(audit.Entry{Key: p.Key, Tenant: p.Tenant, Action: action, Detail: detail, Result: errdefs.Code(err)})
	}
	return r, err
}

// adminRoutes serves AdminService from the cluster's store.
func (f *Forwarder) adminRoutes(mux *http.ServeMux, opts []connect.HandlerOption) {
	const a = "/shoal.v1.AdminService/"
	mux.Handle(a+"WhoAmI", connect.NewUnaryHandler(a+"WhoAmI", whoAmI, opts...))
	mux.Handle(a+"CreateKey", connect.NewUnaryHandler(a+"CreateKey", f.createKey, opts...))
	mux.Handle(a+"ListKeys", connect.NewUnaryHandler(a+"ListKeys", f.listKeys, opts...))
	mux.Handle(a+"DeleteKey", connect.NewUnaryHandler(a+"DeleteKey", f.deleteKey, opts...))
	mux.Handle(a+"SetTenant", connect.NewUnaryHandler(a+"SetTenant", f.setTenant, opts...))
	mux.Handle(a+"ListTenants", connect.NewUnaryHandler(a+"ListTenants", f.listTenants, opts...))
	mux.Handle(a+"ReadAudit", connect.NewUnaryHandler(a+"ReadAudit", f.readAudit, opts...))
}

func (f *Forwarder) createKey(ctx context.Context, req *connect.Request[pb.CreateKeyRequest]) (*connect.Response[pb.CreateKeyResponse], error) {
	ks, err := f.keyStore()
	if err != nil {
		return nil, err
	}
	return createKey(ctx, ks, req, f.log)
}

func (f *Forwarder) listKeys(ctx context.Context, req *connect.Request[pb.ListKeysRequest]) (*connect.Response[pb.ListKeysResponse], error) {
	ks, err := f.keyStore()
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(listKeys(ks)), nil
}

func (f *Forwarder) deleteKey(ctx context.Context, req *connect.Request[pb.DeleteKeyRequest]) (*connect.Response[pb.DeleteKeyResponse], error) {
	ks, err := f.keyStore()
	if err != nil {
		return nil, err
	}
	k, err := ks.DeleteKey(ctx, req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	f.log.Info("key removed", "key", k.Name, "tenant", k.Tenant, "by", tenant.FromContext(ctx).String())
	return connect.NewResponse(&pb.DeleteKeyResponse{}), nil
}

func (f *Forwarder) setTenant(ctx context.Context, req *connect.Request[pb.SetTenantRequest]) (*connect.Response[pb.Tenant], error) {
	ks, err := f.keyStore()
	if err != nil {
		return nil, err
	}
	if err := ks.SetQuota(ctx, req.Msg.Name, quotaOf(req.Msg.Quota)); err != nil {
		return nil, toConnect(err)
	}
	f.log.Info("tenant quota set", "tenant", req.Msg.Name, "quota", quotaOf(req.Msg.Quota), "by", tenant.FromContext(ctx).String())
	return connect.NewResponse(f.tenants(ks)[req.Msg.Name]), nil
}

// tenants is every tenant with a key, a quota or a sandbox in the
// cluster's catalog, with its usage across the cluster.
func (f *Forwarder) tenants(ks KeyStore) map[string]*pb.Tenant {
	out := map[string]*pb.Tenant{}
	get := func(name string) *pb.Tenant {
		t := out[name]
		if t == nil {
			t = &pb.Tenant{Name: name, Quota: quotaPB(ks.Quota(name))}
			out[name] = t
		}
		return t
	}
	for name := range ks.Tenants() {
		get(name)
	}
	for _, k := range ks.Keys() {
		if k.Tenant != "" {
			get(k.Tenant).Keys++
		}
	}
	if f.ten.usage != nil {
		for name, u := range f.ten.usage.Tenants() {
			t := get(name)
			t.Sandboxes, t.MemoryBytes, t.Millicpu = u.Sandboxes, u.Memory, u.MilliCPU
		}
	}
	return out
}

func (f *Forwarder) listTenants(ctx context.Context, req *connect.Request[pb.ListTenantsRequest]) (*connect.Response[pb.ListTenantsResponse], error) {
	ks, err := f.keyStore()
	if err != nil {
		return nil, err
	}
	out := &pb.ListTenantsResponse{}
	for _, t := range f.tenants(ks) {
		out.Tenants = append(out.Tenants, t)
	}
	sort.Slice(out.Tenants, func(i, j int) bool { return out.Tenants[i].Name < out.Tenants[j].Name })
	return connect.NewResponse(out), nil
}

// readAudit merges the replica's own log with every live node's and every
// other live replica's (asked with the client's key), by time, and returns
// the last tail entries. One that does not answer is left out (logged).
func (f *Forwarder) readAudit(ctx context.Context, req *connect.Request[pb.ReadAuditRequest]) (*connect.Response[pb.ReadAuditResponse], error) {
	const proc = "/shoal.v1.AdminService/ReadAudit"
	tail, err := auditTail(req.Msg.Tail)
	if err != nil {
		return nil, err
	}
	var all []*pb.AuditEntry
	if f.ten.audit != nil {
		own, err := audit.Read(f.ten.audit.Path(), tail, req.Msg.Tenant)
		if err != nil {
			return nil, toConnect(err)
		}
		for _, e := range own {
			all = append(all, auditPB(e))
		}
	}
	if req.Header().Get(auditLocalHeader) != "" {
		return connect.NewResponse(&pb.ReadAuditResponse{Entries: all}), nil
	}
	// Every live node's log, and every other replica's own.
	others := f.dir.Live()
	nodes := len(others)
	if f.ten.peers != nil {
		peers, err := f.ten.peers.Peers(ctx)
		if err != nil {
			f.log.Warn("audit through a control replica: the other replicas' logs are left out", "err", err)
		}
		for _, p := range peers {
			others = append(others, cluster.NodeInfo{Name: "control replica " + p.ID, URL: p.URL})
		}
	}
	results, errs := onEveryNode(others, func(n cluster.NodeInfo) (*pb.ReadAuditResponse, error) {
		nctx, cancel := context.WithTimeout(ctx, statusTimeout)
		defer cancel()
		out := outgoing(req.Msg, req.Header())
		out.Header().Set(auditLocalHeader, "1") // a replica: its own log (a node ignores it)
		res, err := clientFor[pb.ReadAuditRequest, pb.ReadAuditResponse](f, n, proc).CallUnary(nctx, out)
		if err != nil {
			return nil, err
		}
		return res.Msg, nil
	})
	for i, r := range results {
		if errs[i] != nil {
			what := "a node's"
			if i >= nodes {
				what = "a control replica's"
			}
			f.log.Warn("audit through a control replica: "+what+" log is left out", "from", others[i].Name, "err", errs[i])
			continue
		}
		all = append(all, r.Entries...)
	}
	slices.SortStableFunc(all, func(a, b *pb.AuditEntry) int { return a.GetTime().AsTime().Compare(b.GetTime().AsTime()) })
	if len(all) > tail {
		all = all[len(all)-tail:]
	}
	return connect.NewResponse(&pb.ReadAuditResponse{Entries: all}), nil
}
