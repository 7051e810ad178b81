package control

// Layers through a control replica. Tags are the cluster's (etcd,
// internal/cluster's layertags.go), mirrored by every node, so a layer
// call goes to one node, chosen for the layer:
//
//   - a read of a layer (GetLayer, a push, an export) goes to a node that
//     holds its image (its capacity report lists the tag), else any;
//   - a write that makes a layer (a build, an upload, an import) or names
//     one (a tag) goes to a node with a layer store, which pushes the
//     image there before the tag is the cluster's: every node then
//     resolves the tag and mounts the image from the store. A tag goes to
//     a node that holds its source if there is one (it has the image to
//     push). Without any node with a store, it goes to any node (then
//     only that node holds the image);
//   - the removal of a tag goes to one node (the tag leaves etcd, and
//     every node's copy); of an image by digest, to every node in turn
//     (images are each node's); GC and pulls, to every node.
//
// The streams (builds' progress, uploads, exports) are relayed as they
// come; the node enforces its bounds (upload size, build roots) as it
// does for its own clients.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// layerRef is the layer a layer request names ("" if none).
func layerRef(m proto.Message) string {
	switch r := m.(type) {
	case *pb.GetLayerRequest:
		return r.Ref
	case *pb.TagLayerRequest:
		return r.Source
	case *pb.DeleteLayerRequest:
		return r.Ref
	case *pb.PushLayerRequest:
		return r.Ref
	case *pb.PullLayerRequest:
		return r.Ref
	}
	return ""
}

// layerNode picks the node for a call about layer ref ("": none): one
// that holds it if any (for a write, one of those with a layer store
// first), else for a write one with a layer store, else any live node.
func (f *Forwarder) layerNode(ref string, write bool) (cluster.NodeInfo, error) {
	live := f.dir.Live()
	if len(live) == 0 {
		return cluster.NodeInfo{}, errdefs.New(errdefs.ErrUnavailable, "no node is up in the cluster")
	}
	pick := func(ns []cluster.NodeInfo) cluster.NodeInfo { return ns[rand.IntN(len(ns))] }
	withStore := func(ns []cluster.NodeInfo) []cluster.NodeInfo {
		var out []cluster.NodeInfo
		for _, n := range ns {
			if n.LayerStore != "" {
				out = append(out, n)
			}
		}
		return out
	}
	if ref != "" {
		var holders []cluster.NodeInfo
		for _, n := range live {
			if slices.Contains(n.Load.Layers, ref) {
				holders = append(holders, n)
			}
		}
		if s := withStore(holders); write && len(s) > 0 {
			return pick(s), nil
		}
		if len(holders) > 0 {
			return pick(holders), nil
		}
	}
	if s := withStore(live); write && len(s) > 0 {
		return pick(s), nil
	}
	return pick(live), nil
}

// isTag says whether ref is a tag (name:version), not a digest.
func isTag(ref string) bool {
	_, _, err := layer.ParseTag(ref)
	return err == nil
}

// isTagKey says whether k is the key of a tag ([tenant/]name:version,
// layer.Layer.Key).
func isTagKey(k string) bool {
	_, _, _, err := layer.ParseTagKey(k)
	return err == nil
}

// tagKeys are the keys a create's tag reference may resolve to for the
// request's principal (layer.Owner): its own tag, then the shared one; a
// qualified reference names one.
func tagKeys(ctx context.Context, ref string) []string {
	if ns, rest, ok := strings.Cut(ref, "/"); ok {
		if !isTag(rest) || !ownerReads(ctx, ns) {
			return nil
		}
		if ns == "" {
			return []string{rest}
		}
		return []string{ns + "/" + rest}
	}
	if !isTag(ref) {
		return nil
	}
	if o := layerOwner(ctx); !o.Admin && o.Tenant != "" {
		return []string{o.Tenant + "/" + ref, ref}
	}
	return []string{ref}
}

// proxyLayerRoute passes a plain HTTP layer route (export, import, build
// from an upload) to the node layerNode picks, streaming both ways.
func (f *Forwarder) proxyLayerRoute(w http.ResponseWriter, r *http.Request) {
	var ref string
	write := true
	if strings.HasSuffix(r.URL.Path, "/export") {
		ref, write = r.URL.Query().Get("ref"), false
	}
	n, err := f.layerNode(ref, write)
	if err != nil {
		writeConnectError(w, err)
		return
	}
	f.proxyTo(w, r, n)
}

// proxyTo passes r to node n as it is, streaming both ways (Upgrades
// too).
func (f *Forwarder) proxyTo(w http.ResponseWriter, r *http.Request, n cluster.NodeInfo) {
	target, err := url.Parse(n.URL)
	if err != nil {
		writeConnectError(w, errdefs.New(errdefs.ErrUnavailable, "node %s has a bad URL %q", n.Name, n.URL))
		return
	}
	p := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Host = r.Host
		},
		Transport:     f.client.Transport,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			writeConnectError(w, errdefs.New(errdefs.ErrUnavailable, "node %s: %v", n.Name, err))
		},
	}
	p.ServeHTTP(w, r)
}

// LayerTagsHeader carries, from a control replica to a node with a
// create, the revisions (in etcd) of the tags the create names:
// "name:version=REV,...". A node whose copy of one of them is older reads
// it from etcd before it resolves the stack: a create right after a tag
// moved through another node or replica gets the new layer.
const LayerTagsHeader = "Shoal-Layer-Tags"

// layerTagsHeader reads the revisions of the tags m names from etcd (one
// transaction, bounded by a second); "" if it names none or etcd does not
// answer (the node resolves from its copy then).
func (f *Forwarder) layerTagsHeader(ctx context.Context, m *pb.CreateSandboxRequest) string {
	var refs []string
	for _, r := range append(append([]string{m.Base}, m.Workspaces...), m.Toolkits...) {
		for _, k := range tagKeys(ctx, r) {
			if len(refs) < limits.Layers {
				refs = append(refs, k)
			}
		}
	}
	if len(refs) == 0 {
		return ""
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	revs, err := cluster.TagRevisions(ctx, f.dir.Client(), refs)
	if err != nil {
		f.log.Warn("cluster: read the revisions of a create's layer tags", "err", err)
		return ""
	}
	var b strings.Builder
	for _, r := range refs {
		if rev, ok := revs[r]; ok {
			if b.Len() > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, "%s=%d", r, rev)
		}
	}
	return b.String()
}

// parseLayerTags parses LayerTagsHeader: at most limits.Layers tags, each
// a valid tag with a positive revision (the rest is ignored).
func parseLayerTags(v string) map[string]int64 {
	out := map[string]int64{}
	for _, p := range strings.Split(v, ",") {
		ref, rev, ok := strings.Cut(p, "=")
		n, err := strconv.ParseInt(rev, 10, 64)
		if !ok || err != nil || n <= 0 || !isTagKey(ref) || len(out) == limits.Layers {
			continue
		}
		out[ref] = n
	}
	return out
}

// listLayers lists the cluster's tags from etcd, where a build or a move
// writes them first (a node's mirror may be a moment behind: a layer
// built through one node, listed at once through another, was missing).
// With all (every image, tagged or not) the images are a node's: one
// live node answers for its own.
func (f *Forwarder) listLayers(ctx context.Context, req *connect.Request[pb.ListLayersRequest]) (*connect.Response[pb.ListLayersResponse], error) {
	const proc = "/shoal.v1.LayerService/ListLayers"
	if req.Msg.All {
		nodes, err := f.targets(proc, toAny, req.Msg)
		if err != nil {
			return nil, err
		}
		res, err := clientFor[pb.ListLayersRequest, pb.ListLayersResponse](f, nodes[0], proc).CallUnary(ctx, outgoing(req.Msg, req.Header()))
		if err != nil {
			return nil, relay(err)
		}
		return connect.NewResponse(res.Msg), nil
	}
	tags, _, err := cluster.ListLayerTags(ctx, f.dir.Client())
	if err != nil {
		return nil, toConnect(err)
	}
	out := &pb.ListLayersResponse{}
	for _, t := range tags {
		if ownerReads(ctx, t.Tenant) {
			out.Layers = append(out.Layers, layerPB(t.Layer))
		}
	}
	return connect.NewResponse(out), nil
}

// getLayerTimeout bounds one node's answer to an inspect.
const getLayerTimeout = 15 * time.Second

// getLayer inspects a layer on every live node: its users are each
// node's (the sandboxes that run on it, its mounts), so the answer is the
// union of the sandboxes and environments, the sum of the mounts, and the
// rest from a node that holds the image (else any that knows it). A node
// that does not answer is left out; none knowing the layer is the
// nodes' not-found.
func (f *Forwarder) getLayer(ctx context.Context, req *connect.Request[pb.GetLayerRequest]) (*connect.Response[pb.Layer], error) {
	const proc = "/shoal.v1.LayerService/GetLayer"
	nodes := f.dir.Live()
	if len(nodes) == 0 {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("no node of the cluster is up"))
	}
	res, errs := onEveryNode(nodes, func(n cluster.NodeInfo) (*pb.Layer, error) {
		cctx, cancel := context.WithTimeout(ctx, getLayerTimeout)
		defer cancel()
		r, err := clientFor[pb.GetLayerRequest, pb.Layer](f, n, proc).CallUnary(cctx, outgoing(req.Msg, req.Header()))
		if err != nil {
			return nil, err
		}
		return r.Msg, nil
	})
	// The answer of a node that holds it, as the node's reports say (the
	// one an inspect went to before), else of one that has a copy.
	var out *pb.Layer
	holders := map[string]bool{}
	for _, n := range nodes {
		if slices.Contains(n.Load.Layers, req.Msg.Ref) {
			holders[n.Name] = true
		}
	}
	rank := func(i int) int { // higher is better
		r := 0
		if holders[nodes[i].Name] {
			r += 2
		}
		if res[i].Remote == "" {
			r++
		}
		return r
	}
	best := -1
	sbx, envs, tags := map[string]bool{}, map[string]bool{}, map[string]bool{}
	var mounts int32
	for i, l := range res {
		if errs[i] != nil {
			continue
		}
		if best < 0 || rank(i) > rank(best) {
			best = i
		}
		for _, id := range l.UsedBySandboxes {
			sbx[id] = true
		}
		for _, e := range l.UsedByEnvironments {
			envs[e] = true
		}
		for _, t := range l.Tags {
			tags[t] = true
		}
		mounts += l.Mounts
	}
	if best >= 0 {
		out = proto.Clone(res[best]).(*pb.Layer)
	}
	if out == nil {
		for _, err := range errs {
			if connect.CodeOf(err) != connect.CodeNotFound {
				return nil, relay(err)
			}
		}
		return nil, relay(errs[0])
	}
	sorted := func(m map[string]bool) []string {
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		return keys
	}
	out.UsedBySandboxes, out.UsedByEnvironments, out.Tags, out.Mounts = sorted(sbx), sorted(envs), sorted(tags), mounts
	return connect.NewResponse(out), nil
}
