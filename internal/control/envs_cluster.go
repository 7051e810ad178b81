package control

// Environments in a cluster live in etcd (internal/cluster's envs.go): a
// write through a control replica or through a node's own API is one etcd
// transaction, and every node mirrors them into its layer store, where its
// creates (and its E2B templates) resolve them.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
)

// ClusterEnvs makes a node's environment writes the cluster's: set by
// SetClusterEnvs on a node of a cluster (serve --role node).
type ClusterEnvs struct {
	Client *clientv3.Client
	Mirror *cluster.LayerMirror
}

// SetClusterEnvs sends the node's environment writes to etcd (c) instead
// of its own store, which then follows etcd (c.Mirror). Call before
// serving.
func (s *Server) SetClusterEnvs(c *ClusterEnvs) { s.envs = c }

// createClusterEnvironment checks an environment against this node's
// layers and writes it to etcd.
func (s *Server) createClusterEnvironment(ctx context.Context, r *pb.CreateEnvironmentRequest) (*pb.Environment, error) {
	home, err := ownerHome(ctx)
	if err != nil {
		return nil, err
	}
	e := layer.Env{Name: r.Name, Base: r.Base, Workspaces: r.Workspaces, Toolkits: r.Toolkits, Backend: r.Backend, Tenant: home}
	if err := layer.CheckEnv(e); err != nil {
		return nil, err
	}
	if _, err := s.layers(ctx).ResolveStack(e.Base, e.Workspaces, e.Toolkits); err != nil {
		return nil, fmt.Errorf("create environment %s: %w", e.Name, err)
	}
	ce, err := cluster.PutEnv(ctx, s.envs.Client, e, r.Replace, r.IfRevision)
	if err != nil {
		return nil, err
	}
	s.envs.Mirror.Apply(ce)
	out := s.environmentPB(ctx, ce.Env)
	out.Revision = ce.Revision
	return out, nil
}

func (s *Server) deleteClusterEnvironment(ctx context.Context, name string) error {
	e, err := s.layers(ctx).GetEnv(name)
	if err != nil {
		return err
	}
	if !ownerWrites(ctx, e.Tenant) {
		return fmt.Errorf("remove environment %s: %w", name, layer.ErrReadOnly)
	}
	rev, err := cluster.DeleteEnv(ctx, s.envs.Client, e.Key())
	if err != nil {
		return err
	}
	s.envs.Mirror.ApplyDelete(e.Key(), rev)
	return nil
}

// ownerWrites says whether the request's principal may change a name of
// tenant t ("": shared, the admin's).
func ownerWrites(ctx context.Context, t string) bool {
	o := layerOwner(ctx)
	return o.Admin || t != "" && t == o.Tenant
}

// ownerReads says whether the request's principal sees a name of tenant t.
func ownerReads(ctx context.Context, t string) bool {
	o := layerOwner(ctx)
	return o.Admin || t == "" || t == o.Tenant
}

// clusterEnv reads the environment name names for the request's
// principal from etcd: its own, else a shared one ("tenant/name": that
// tenant's, for itself or the admin).
func clusterEnv(ctx context.Context, cli *clientv3.Client, name string) (cluster.Env, error) {
	o := layerOwner(ctx)
	var keys []string
	if ns, n, ok := strings.Cut(name, "/"); ok {
		if ownerReads(ctx, ns) && ns != "" {
			keys = []string{ns + "/" + n}
		}
	} else if !o.Admin && o.Tenant != "" {
		keys = []string{o.Tenant + "/" + name, name}
	} else {
		keys = []string{name}
	}
	for _, k := range keys {
		e, err := cluster.GetEnv(ctx, cli, k)
		if !errors.Is(err, errdefs.ErrNotFound) {
			return e, err
		}
	}
	return cluster.Env{}, errdefs.New(errdefs.ErrNotFound, "no environment %q (see shoal env ls)", name)
}

// catchUpTags brings this node's copy of the tags a create names up to
// the revisions its control replica read in etcd (LayerTagsHeader): a tag
// whose copy is older is read from etcd now. Not on a node alone.
func (s *Server) catchUpTags(ctx context.Context, h http.Header) {
	v := h.Get(LayerTagsHeader)
	if s.envs == nil || v == "" {
		return
	}
	for ref, rev := range parseLayerTags(v) {
		if s.envs.Mirror.TagRevision(ref) >= rev {
			continue
		}
		lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if _, err := s.envs.Mirror.LookupTag(lctx, ref); err != nil {
			s.log.Warn("cluster: read a create's layer tag from etcd", "layer", ref, "err", err)
		}
		cancel()
	}
}

// --- a control replica's environments ---

func envPB(ctx context.Context, e cluster.Env) *pb.Environment {
	return &pb.Environment{Name: envName(layerOwner(ctx), e.Env), Base: e.Base, Workspaces: e.Workspaces, Toolkits: e.Toolkits, Backend: e.Backend,
		CreatedAt: timestamppb.New(e.Created), Revision: e.Revision, Tenant: e.Tenant}
}

// anyNode returns a live node, or unavailable.
func (f *Forwarder) anyNode() (cluster.NodeInfo, error) {
	live := f.dir.Live()
	if len(live) == 0 {
		return cluster.NodeInfo{}, errdefs.New(errdefs.ErrUnavailable, "no node is up in the cluster")
	}
	return live[rand.IntN(len(live))], nil
}

// resolveStack resolves an environment's references on node n, top to
// bottom as a node does (toolkits, workspaces, base), checking each
// one's kind.
func (f *Forwarder) resolveStack(ctx context.Context, n cluster.NodeInfo, e layer.Env, h map[string][]string) ([]*pb.Layer, error) {
	const proc = "/shoal.v1.LayerService/GetLayer"
	var out []*pb.Layer
	base, workspaces, toolkits := e.QualifiedRefs()
	add := func(ref string, want pb.LayerKind) error {
		res, err := clientFor[pb.GetLayerRequest, pb.Layer](f, n, proc).CallUnary(ctx, outgoing(&pb.GetLayerRequest{Ref: ref}, h))
		if err != nil {
			return relay(err)
		}
		if res.Msg.Kind != want {
			return errdefs.New(errdefs.ErrInvalidArgument, "layer %s is a %s layer, not a %s layer", ref, kindName(res.Msg.Kind), kindName(want))
		}
		out = append(out, res.Msg)
		return nil
	}
	for _, r := range toolkits {
		if err := add(r, pb.LayerKind_LAYER_KIND_TOOLKIT); err != nil {
			return nil, err
		}
	}
	for _, r := range workspaces {
		if err := add(r, pb.LayerKind_LAYER_KIND_WORKSPACE); err != nil {
			return nil, err
		}
	}
	if err := add(base, pb.LayerKind_LAYER_KIND_BASE); err != nil {
		return nil, err
	}
	return out, nil
}

func (f *Forwarder) createEnvironment(ctx context.Context, req *connect.Request[pb.CreateEnvironmentRequest]) (*connect.Response[pb.Environment], error) {
	r := req.Msg
	home, err := ownerHome(ctx)
	if err != nil {
		return nil, toConnect(err)
	}
	// The new environment's own references resolve as its owner sees them.
	e := layer.Env{Name: r.Name, Base: r.Base, Workspaces: r.Workspaces, Toolkits: r.Toolkits, Backend: r.Backend, Tenant: home}
	if err := layer.CheckEnv(e); err != nil {
		return nil, toConnect(fmt.Errorf("create environment: %w", err))
	}
	n, err := f.anyNode()
	if err != nil {
		return nil, toConnect(err)
	}
	if e.Backend != "" {
		offered := false
		for _, l := range f.dir.Live() {
			for _, b := range l.Load.Backends {
				offered = offered || b == e.Backend
			}
		}
		if !offered {
			return nil, toConnect(errdefs.New(errdefs.ErrInvalidArgument, "create environment %s: backend %q is offered by no live node", e.Name, e.Backend))
		}
	}
	resolved, err := f.resolveStack(ctx, n, e, req.Header())
	if err != nil {
		return nil, toConnect(fmt.Errorf("create environment %s: %w", e.Name, err))
	}
	ce, err := cluster.PutEnv(ctx, f.dir.Client(), e, r.Replace, r.IfRevision)
	if err != nil {
		return nil, toConnect(err)
	}
	out := envPB(ctx, ce)
	out.Resolved = resolved
	return connect.NewResponse(out), nil
}

func (f *Forwarder) getEnvironment(ctx context.Context, req *connect.Request[pb.GetEnvironmentRequest]) (*connect.Response[pb.Environment], error) {
	e, err := clusterEnv(ctx, f.dir.Client(), req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	out := envPB(ctx, e)
	if n, err := f.anyNode(); err == nil {
		// What it resolves to now (left empty if a reference does not).
		out.Resolved, _ = f.resolveStack(ctx, n, e.Env, req.Header())
	}
	return connect.NewResponse(out), nil
}

func (f *Forwarder) listEnvironments(ctx context.Context, req *connect.Request[pb.ListEnvironmentsRequest]) (*connect.Response[pb.ListEnvironmentsResponse], error) {
	envs, _, err := cluster.ListEnvs(ctx, f.dir.Client())
	if err != nil {
		return nil, toConnect(err)
	}
	out := &pb.ListEnvironmentsResponse{}
	for _, e := range envs {
		if ownerReads(ctx, e.Tenant) {
			out.Environments = append(out.Environments, envPB(ctx, e))
		}
	}
	return connect.NewResponse(out), nil
}

func (f *Forwarder) deleteEnvironment(ctx context.Context, req *connect.Request[pb.DeleteEnvironmentRequest]) (*connect.Response[pb.DeleteEnvironmentResponse], error) {
	e, err := clusterEnv(ctx, f.dir.Client(), req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	if !ownerWrites(ctx, e.Tenant) {
		return nil, toConnect(fmt.Errorf("remove environment %s: %w", req.Msg.Name, layer.ErrReadOnly))
	}
	if _, err := cluster.DeleteEnv(ctx, f.dir.Client(), e.Key()); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.DeleteEnvironmentResponse{}), nil
}

// expandTemplate fills a create that names a template with the
// environment's stack and backend, read from etcd: what placement weighs,
// and what the node is sent (so that the node need not have mirrored an
// environment written a moment ago).
func (f *Forwarder) expandTemplate(ctx context.Context, m *pb.CreateSandboxRequest) error {
	if m.Template == "" {
		return nil
	}
	if m.Base != "" {
		return errdefs.New(errdefs.ErrInvalidArgument, "give a template or a base, not both (environment %s has its own base)", m.Template)
	}
	e, err := clusterEnv(ctx, f.dir.Client(), m.Template)
	if err != nil {
		return err
	}
	base, workspaces, toolkits := e.QualifiedRefs()
	m.Base = base
	if m.Backend == "" {
		m.Backend = e.Backend
	}
	m.Workspaces = append(workspaces, m.Workspaces...)
	m.Toolkits = append(toolkits, m.Toolkits...)
	m.Template = ""
	return nil
}
