package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// --- layers ---

// layerOwner is whose layers and environments a request sees (layer.Owner):
// its tenant's own and the shared ones; every tenant's for the admin, whose
// own are shared.
func layerOwner(ctx context.Context) layer.Owner {
	p := tenant.FromContext(ctx)
	if p == nil {
		return layer.Owner{}
	}
	return layer.OwnerOf(p.Tenant, p.IsAdmin())
}

// layers is the node's layer store as the request's principal sees it.
func (s *Server) layers(ctx context.Context) layer.View { return s.node.Layers().As(layerOwner(ctx)) }

// layerRoutes registers the streamed layer transfer endpoints (layer images
// are too big for a protobuf message):
//
//	GET  /v1/layers/export?ref=REF          -> the export tar
//	POST /v1/layers/import[?tag=NAME:VER]   <- the export tar; -> Layer JSON
//	POST /v1/layers/build?kind=K&ref=NAME:VER[&compression=C][&image=I][&source=DESC]
//	                                        <- a tar (plain, gzip, zstd), an OCI
//	                                           layout tar or a docker-archive;
//	                                        -> NDJSON BuildLayerResponse events
func (s *Server) layerRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/layers/export", s.exportLayer)
	mux.HandleFunc("POST /v1/layers/import", s.importLayer)
	mux.HandleFunc("POST /v1/layers/build", s.buildLayerUpload)
	mux.HandleFunc("POST /v1/layers/dockerfile", s.buildDockerfile) // dockerfile.go
}

// BuildPolicy says what layer builds may read: server paths only inside
// Roots (none by default), uploads of at most UploadMax bytes.
type BuildPolicy struct {
	Roots     *layer.BuildRoots
	UploadMax int64
}

// SetBuildPolicy replaces the default policy (no server path, uploads up to
// layer.DefaultUploadMax). Call it before serving.
func (s *Server) SetBuildPolicy(p BuildPolicy) {
	if p.UploadMax <= 0 {
		p.UploadMax = layer.DefaultUploadMax
	}
	s.builds = p
}

func (s *Server) BuildLayer(ctx context.Context, req *connect.Request[pb.BuildLayerRequest], stream *connect.ServerStream[pb.BuildLayerResponse]) error {
	r := req.Msg
	kind, err := layer.ParseKind(kindName(r.Kind))
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	name, version, err := layer.ParseTag(r.Ref)
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("layer reference %q must be NAME:VERSION: %w", r.Ref, err))
	}
	if !path.IsAbs(r.Source) {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("source %q must be an absolute path on the server", r.Source))
	}
	// Only inside the configured build roots: the key must not read the
	// whole host (/etc, the data dir) into a layer.
	src, err := s.builds.Roots.Open(r.Source)
	if err != nil {
		return toConnect(err)
	}
	defer src.Close()
	ps := newProgressSender(stream.Send)
	l, err := s.node.Layers().Build(ctx, layer.BuildOptions{
		Kind: kind, Name: name, Version: version, Source: r.Source, Opened: src, Image: r.Image,
		Compression: r.Compression, Progress: ps.send, Tenant: layerOwner(ctx).Tenant,
	})
	if err != nil {
		return toConnect(err)
	}
	if err := ps.err(); err != nil {
		return err
	}
	return stream.Send(&pb.BuildLayerResponse{Event: &pb.BuildLayerResponse_Layer{Layer: layerPB(l)}})
}

func (s *Server) CommitLayer(ctx context.Context, req *connect.Request[pb.CommitLayerRequest], stream *connect.ServerStream[pb.BuildLayerResponse]) error {
	r := req.Msg
	kind, err := layer.ParseKind(kindName(r.Kind))
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("kind: %w (a commit is a workspace or a toolkit)", err))
	}
	name, version, err := layer.ParseTag(r.Ref)
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("layer reference %q must be NAME:VERSION: %w", r.Ref, err))
	}
	ps := newProgressSender(stream.Send)
	home, err := ownerHome(ctx)
	if err != nil {
		return toConnect(err)
	}
	l, err := s.node.CommitLayer(ctx, r.SandboxId, layer.CommitOptions{
		Kind: kind, Name: name, Version: version, Compression: r.Compression, Progress: ps.send, Tenant: home,
	})
	if err != nil {
		return toConnect(err)
	}
	if err := ps.err(); err != nil {
		return err
	}
	return stream.Send(&pb.BuildLayerResponse{Event: &pb.BuildLayerResponse_Layer{Layer: layerPB(l)}})
}

// progressSender turns the layer builder's progress into stream events: a
// line at each stage, a status for progress bars in between.
type progressSender struct {
	sendFn  func(*pb.BuildLayerResponse) error
	mu      sync.Mutex // the builder reports from one goroutine at a time; this guards sendErr
	sendErr error
}

func newProgressSender(send func(*pb.BuildLayerResponse) error) *progressSender {
	return &progressSender{sendFn: send}
}

func (p *progressSender) send(pr layer.Progress) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.sendErr != nil {
		return
	}
	var err error
	if pr.Message != "" {
		err = p.sendFn(&pb.BuildLayerResponse{Event: &pb.BuildLayerResponse_Progress{Progress: pr.Message}})
	}
	if err == nil && (pr.Total > 0 || pr.Message == "") {
		err = p.sendFn(&pb.BuildLayerResponse{Event: &pb.BuildLayerResponse_Status{Status: &pb.BuildProgress{
			Stage: pr.Stage, Done: pr.Done, Total: pr.Total, Unit: pr.Unit,
		}}})
	}
	p.sendErr = err
}

func (p *progressSender) err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sendErr
}

func (s *Server) ListLayers(ctx context.Context, req *connect.Request[pb.ListLayersRequest]) (*connect.Response[pb.ListLayersResponse], error) {
	out := &pb.ListLayersResponse{}
	if req.Msg.All {
		view := s.layers(ctx)
		ims, err := view.Images()
		if err != nil {
			return nil, toConnect(err)
		}
		// One entry per tag, then one per untagged image.
		for _, im := range ims {
			if len(im.Tags) == 0 {
				out.Layers = append(out.Layers, layerPB(im.Layer))
				out.Layers[len(out.Layers)-1].Ref = ""
				continue
			}
			for _, t := range im.Tags {
				l, err := view.Resolve(t)
				if err != nil {
					continue // moved meanwhile
				}
				lp := layerPB(l)
				lp.Tags = im.Tags
				out.Layers = append(out.Layers, lp)
			}
		}
		return connect.NewResponse(out), nil
	}
	ls, err := s.layers(ctx).List()
	if err != nil {
		return nil, toConnect(err)
	}
	for _, l := range ls {
		out.Layers = append(out.Layers, layerPB(l))
	}
	return connect.NewResponse(out), nil
}

func (s *Server) GetLayer(ctx context.Context, req *connect.Request[pb.GetLayerRequest]) (*connect.Response[pb.Layer], error) {
	store := s.node.Layers()
	view := s.layers(ctx)
	l, err := view.Resolve(req.Msg.Ref)
	if err != nil {
		return nil, toConnect(err)
	}
	out := layerPB(l)
	if out.Tags, err = view.Tags(l.Digest); err != nil {
		return nil, toConnect(err)
	}
	usage, err := s.node.LayerUsage()
	if err != nil {
		return nil, toConnect(err)
	}
	for _, id := range usage[l.Digest] {
		if _, err := s.sandboxFor(ctx, id); err == nil { // another tenant's: not shown
			out.UsedBySandboxes = append(out.UsedBySandboxes, id)
		}
	}
	envs, err := view.Envs()
	if err != nil {
		return nil, toConnect(err)
	}
	for _, e := range envs {
		if stack, err := envStack(store.As(e.ResolvedBy(view.Owner())), e); err == nil {
			for _, sl := range stack {
				if sl.Digest == l.Digest {
					out.UsedByEnvironments = append(out.UsedByEnvironments, envName(layerOwner(ctx), e))
					break
				}
			}
		}
	}
	out.Mounts = int32(store.Refs(l.Digest))
	if lz := store.Lazy(); lz != nil {
		if st, ok := lz.ImageStats(strings.TrimPrefix(l.Digest, "sha256:")); ok {
			out.Lazy = &pb.LazyLayerStats{
				ChunkSize: st.ChunkSize, Chunks: int64(st.Chunks), ChunksCached: int64(st.ChunksCached),
				BytesFetched: st.BytesFetched, BytesRead: st.BytesRead, BytesTouched: st.BytesTouched, CacheHits: st.CacheHits, CacheMisses: st.CacheMisses,
				TraceChunks: int64(st.TraceChunks), Prefetched: st.Prefetched, Prefetching: st.Prefetching,
			}
		}
	}
	return connect.NewResponse(out), nil
}

func (s *Server) PushLayer(ctx context.Context, req *connect.Request[pb.PushLayerRequest]) (*connect.Response[pb.PushLayerResponse], error) {
	res, err := s.pushLayer(ctx, req.Msg, nil)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(res), nil
}

// PushLayerProgress is PushLayer streaming the push's progress, as
// BuildLayer streams a build's.
func (s *Server) PushLayerProgress(ctx context.Context, req *connect.Request[pb.PushLayerRequest], stream *connect.ServerStream[pb.PushLayerEvent]) error {
	ps := newProgressSender(func(ev *pb.BuildLayerResponse) error {
		switch e := ev.Event.(type) {
		case *pb.BuildLayerResponse_Progress:
			return stream.Send(&pb.PushLayerEvent{Event: &pb.PushLayerEvent_Progress{Progress: e.Progress}})
		case *pb.BuildLayerResponse_Status:
			return stream.Send(&pb.PushLayerEvent{Event: &pb.PushLayerEvent_Status{Status: e.Status}})
		}
		return nil
	})
	res, err := s.pushLayer(ctx, req.Msg, ps.send)
	if err != nil {
		return err
	}
	if err := ps.err(); err != nil {
		return err
	}
	return stream.Send(&pb.PushLayerEvent{Event: &pb.PushLayerEvent_Result{Result: res}})
}

func (s *Server) pushLayer(ctx context.Context, req *pb.PushLayerRequest, progress func(layer.Progress)) (*pb.PushLayerResponse, error) {
	store := s.node.Layers()
	if want := req.Store; want != "" {
		rs := store.RemoteStore()
		if rs == nil || strings.TrimSuffix(want, "/") != strings.TrimSuffix(rs.URL(), "/") {
			have := "none"
			if rs != nil {
				have = rs.URL()
			}
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("store %q: this node pushes only to its own layer store (%s; shoal serve --layer-store)", want, have))
		}
	}
	l, res, err := store.As(layerOwner(ctx)).PushProgress(ctx, req.Ref, progress)
	if err != nil {
		return nil, toConnect(err)
	}
	return &pb.PushLayerResponse{Layer: layerPB(l), Store: res.Store, UploadedBytes: res.UploadedBytes}, nil
}

func (s *Server) PullLayer(ctx context.Context, req *connect.Request[pb.PullLayerRequest]) (*connect.Response[pb.Layer], error) {
	l, err := s.layers(ctx).Pull(ctx, req.Msg.Ref)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(layerPB(l)), nil
}

func (s *Server) TagLayer(ctx context.Context, req *connect.Request[pb.TagLayerRequest]) (*connect.Response[pb.TagLayerResponse], error) {
	l, old, err := s.layers(ctx).Tag(req.Msg.Source, req.Msg.Target)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.TagLayerResponse{Layer: layerPB(l), PreviousDigest: old}), nil
}

func (s *Server) DeleteLayer(ctx context.Context, req *connect.Request[pb.DeleteLayerRequest]) (*connect.Response[pb.DeleteLayerResponse], error) {
	res, err := s.node.RemoveLayer(layerOwner(ctx), req.Msg.Ref)
	if err != nil {
		return nil, toConnect(err)
	}
	out := &pb.DeleteLayerResponse{Untagged: res.Untagged, FreedBytes: res.FreedBytes}
	for _, l := range res.Removed {
		out.Removed = append(out.Removed, layerPB(l))
	}
	return connect.NewResponse(out), nil
}

func (s *Server) GarbageCollectLayers(ctx context.Context, req *connect.Request[pb.GarbageCollectLayersRequest]) (*connect.Response[pb.GarbageCollectLayersResponse], error) {
	res, err := s.node.GCLayers(req.Msg.DryRun)
	if err != nil {
		return nil, toConnect(err)
	}
	out := &pb.GarbageCollectLayersResponse{FreedBytes: res.FreedBytes, Kept: int32(res.Kept)}
	for _, l := range res.Removed {
		out.Removed = append(out.Removed, layerPB(l))
	}
	return connect.NewResponse(out), nil
}

// exportLayer streams a layer in the export format:
// GET /v1/layers/export?ref=REF.
func (s *Server) exportLayer(w http.ResponseWriter, r *http.Request) {
	ref := r.URL.Query().Get("ref")
	if ref == "" {
		writeHTTPError(w, http.StatusBadRequest, "invalid_argument", "ref is required: /v1/layers/export?ref=NAME:VERSION")
		return
	}
	l, img, err := s.layers(r.Context()).OpenExport(r.Context(), ref)
	if err != nil {
		writeConnectError(w, err)
		return
	}
	defer img.Close()
	w.Header().Set("Content-Type", "application/x-tar")
	w.Header().Set("Content-Disposition", fmt.Sprintf("attachment; filename=%q", l.Name+"-"+l.Version+".shoal-layer.tar"))
	w.Header().Set("X-Shoal-Layer-Digest", l.Digest)
	w.Header().Set("X-Shoal-Layer-Size", strconv.FormatInt(l.Size, 10))
	if err := layer.WriteExport(r.Context(), w, l, img); err != nil {
		// After the first byte, cutting the response short is the only way
		// to say it failed; the client's tar reader sees a truncated file.
		s.log.Warn("export layer", "layer", ref, "err", err)
		panic(http.ErrAbortHandler)
	}
}

// importLayer stores a layer sent in the export format:
// POST /v1/layers/import[?tag=NAME:VERSION].
func (s *Server) importLayer(w http.ResponseWriter, r *http.Request) {
	home, err := ownerHome(r.Context())
	if err != nil {
		writeConnectError(w, err)
		return
	}
	l, err := s.node.Layers().Import(r.Context(), r.Body, layer.ImportOptions{
		Tag: r.URL.Query().Get("tag"), Tenant: home, AllowSetID: tenant.FromContext(r.Context()).IsAdmin(),
	})
	if err != nil {
		writeConnectError(w, err)
		return
	}
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(layerPB(l))
	if err != nil {
		writeConnectError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Write(b)
}

// What the server still reads of an upload it refused as too large, so that
// the client, done sending, reads the refusal.
const (
	uploadDrainBytes = 64 << 20
	uploadDrainTime  = 10 * time.Second
)

// buildLayerUpload builds a layer from a source in the request body:
// POST /v1/layers/build?kind=K&ref=NAME:VER[&compression=C][&image=I][&source=DESC].
// Bad parameters are answered before the body is read (a client sending
// "Expect: 100-continue" sends none of it); a body over the policy's
// UploadMax is answered 413. Once the body is in, the answer is 200 and
// NDJSON: the BuildLayerResponse events of BuildLayer as protojson, one a
// line, ending with the layer, or with {"error": {"code", "message"}} (the
// Connect end-of-stream form) if the build fails.
func (s *Server) buildLayerUpload(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	kind, err := layer.ParseKind(q.Get("kind"))
	if err != nil {
		writeConnectError(w, connect.NewError(connect.CodeInvalidArgument, err))
		return
	}
	name, version, err := layer.ParseTag(q.Get("ref"))
	if err != nil {
		writeConnectError(w, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("layer reference %q must be NAME:VERSION: %w", q.Get("ref"), err)))
		return
	}
	desc := q.Get("source")
	if len(desc) > 256 || strings.ContainsFunc(desc, unicode.IsControl) {
		writeConnectError(w, connect.NewError(connect.CodeInvalidArgument, errors.New("source: a description of at most 256 printable characters")))
		return
	}
	if desc == "" {
		desc = "upload"
	} else {
		desc = "upload of " + desc
	}
	var mu sync.Mutex // serializes writes to w: progress comes from the build's goroutines
	started := false
	send := func(ev *pb.BuildLayerResponse) error {
		b, err := protojson.Marshal(ev)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if !started {
			w.Header().Set("Content-Type", "application/x-ndjson")
			started = true
		}
		if _, err := w.Write(append(b, '\n')); err != nil {
			return err
		}
		return http.NewResponseController(w).Flush()
	}
	ps := newProgressSender(send)
	max := s.builds.UploadMax
	if max <= 0 {
		max = layer.DefaultUploadMax
	}
	if r.ContentLength > max {
		refuseUpload(w, r, false, fmt.Errorf("the upload (%d bytes) is larger than %d bytes, the most this server takes (shoal serve --build-upload-max)", r.ContentLength, max))
		return
	}
	home, err := ownerHome(r.Context())
	if err != nil {
		writeConnectError(w, err)
		return
	}
	l, err := s.node.Layers().BuildUpload(r.Context(), r.Body, max, layer.BuildOptions{
		Kind: kind, Name: name, Version: version, Source: desc, Image: q.Get("image"),
		Compression: q.Get("compression"), Progress: ps.send, Tenant: home,
	})
	if err == nil {
		err = ps.err()
	}
	if err == nil {
		err = send(&pb.BuildLayerResponse{Event: &pb.BuildLayerResponse_Layer{Layer: layerPB(l)}})
	}
	if err == nil {
		return
	}
	mu.Lock()
	defer mu.Unlock()
	if !started {
		if errors.Is(err, errdefs.ErrResourceExhausted) {
			// The body was being read: a client that asked for "100
			// Continue" got it and is sending the rest.
			refuseUpload(w, r, true, err)
			return
		}
		writeConnectError(w, err)
		return
	}
	ce := toConnect(err).(*connect.Error)
	b, _ := json.Marshal(map[string]any{"error": map[string]string{"code": ce.Code().String(), "message": ce.Message()}})
	w.Write(append(b, '\n'))
}

// refuseUpload answers an upload too large with 413 (not Connect's 429:
// there is nothing to retry later). A client still sending its body when
// the server answers and closes would see a broken pipe or a reset instead
// of the answer (a race in Go's transport; always for httpx and curl): so
// unless the client is still waiting for "100 Continue" (reading has not
// begun), the rest of the body is read first, bounded in bytes and time,
// before the connection is cut.
func refuseUpload(w http.ResponseWriter, r *http.Request, reading bool, err error) {
	if reading || !strings.EqualFold(r.Header.Get("Expect"), "100-continue") {
		http.NewResponseController(w).SetReadDeadline(time.Now().Add(uploadDrainTime))
		io.CopyN(io.Discard, r.Body, uploadDrainBytes)
	}
	writeHTTPError(w, http.StatusRequestEntityTooLarge, connect.CodeResourceExhausted.String(), err.Error())
}

// --- environments ---

func (s *Server) CreateEnvironment(ctx context.Context, req *connect.Request[pb.CreateEnvironmentRequest]) (*connect.Response[pb.Environment], error) {
	r := req.Msg
	if r.Backend != "" {
		if err := s.node.CheckBackend(r.Backend); err != nil {
			return nil, toConnect(fmt.Errorf("create environment %s: %w", r.Name, err))
		}
	}
	if s.envs != nil { // a node of a cluster: etcd's (envs_cluster.go)
		out, err := s.createClusterEnvironment(ctx, r)
		if err != nil {
			return nil, toConnect(err)
		}
		return connect.NewResponse(out), nil
	}
	if r.IfRevision != 0 {
		return nil, toConnect(errdefs.New(errdefs.ErrInvalidArgument, "create environment %s: if_revision is for a cluster's environments (this server keeps its own)", r.Name))
	}
	e := layer.Env{Name: r.Name, Base: r.Base, Workspaces: r.Workspaces, Toolkits: r.Toolkits, Backend: r.Backend}
	if err := envFromImage(ctx, s.layers(ctx), &e); err != nil { // images.go
		return nil, toConnect(err)
	}
	e, err := s.layers(ctx).CreateEnv(e, r.Replace)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(s.environmentPB(ctx, e)), nil
}

func (s *Server) GetEnvironment(ctx context.Context, req *connect.Request[pb.GetEnvironmentRequest]) (*connect.Response[pb.Environment], error) {
	e, err := s.layers(ctx).GetEnv(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(s.environmentPB(ctx, e)), nil
}

func (s *Server) ListEnvironments(ctx context.Context, req *connect.Request[pb.ListEnvironmentsRequest]) (*connect.Response[pb.ListEnvironmentsResponse], error) {
	envs, err := s.layers(ctx).Envs()
	if err != nil {
		return nil, toConnect(err)
	}
	out := &pb.ListEnvironmentsResponse{}
	for _, e := range envs {
		out.Environments = append(out.Environments, s.environmentPB(ctx, e))
	}
	return connect.NewResponse(out), nil
}

func (s *Server) DeleteEnvironment(ctx context.Context, req *connect.Request[pb.DeleteEnvironmentRequest]) (*connect.Response[pb.DeleteEnvironmentResponse], error) {
	if s.envs != nil {
		if err := s.deleteClusterEnvironment(ctx, req.Msg.Name); err != nil {
			return nil, toConnect(err)
		}
		return connect.NewResponse(&pb.DeleteEnvironmentResponse{}), nil
	}
	if err := s.layers(ctx).DeleteEnv(req.Msg.Name); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&pb.DeleteEnvironmentResponse{}), nil
}

// environmentPB converts an environment, with what its references resolve
// to now for the request's principal (left empty if one of them no longer
// resolves).
func (s *Server) environmentPB(ctx context.Context, e layer.Env) *pb.Environment {
	o := layerOwner(ctx)
	out := &pb.Environment{Name: envName(o, e), Base: e.Base, Workspaces: e.Workspaces, Toolkits: e.Toolkits, Backend: e.Backend, CreatedAt: timestamppb.New(e.Created),
		Tenant: e.Tenant, Image: imageConfigPB(e.Image)}
	if s.envs != nil {
		out.Revision = s.envs.Mirror.Revision(e.Key())
	}
	if stack, err := envStack(s.node.Layers().As(e.ResolvedBy(o)), e); err == nil {
		for _, l := range stack {
			out.Resolved = append(out.Resolved, layerPB(l))
		}
	}
	return out
}

// envStack resolves e's stack as a create from it by v's owner would.
func envStack(v layer.View, e layer.Env) ([]layer.Layer, error) {
	base, ws, tks := e.QualifiedRefs()
	return v.ResolveStack(base, ws, tks)
}

// envName is how o is shown environment e: its name when it is o's own
// or shared, "tenant/name" (the admin, for a tenant's).
func envName(o layer.Owner, e layer.Env) string {
	if e.Tenant == "" || e.Tenant == o.Tenant && !o.Admin {
		return e.Name
	}
	return e.Key()
}

// ownerHome is the namespace the request's principal writes layers and
// environments to ("" for the admin: shared).
func ownerHome(ctx context.Context) (string, error) {
	o := layerOwner(ctx)
	if o.Admin {
		return "", nil
	}
	if o.Tenant == "" {
		return "", errdefs.New(errdefs.ErrPermissionDenied, "a key without a tenant cannot own layers or environments")
	}
	return o.Tenant, nil
}

func kindName(k pb.LayerKind) string {
	switch k {
	case pb.LayerKind_LAYER_KIND_BASE:
		return "base"
	case pb.LayerKind_LAYER_KIND_WORKSPACE:
		return "workspace"
	case pb.LayerKind_LAYER_KIND_TOOLKIT:
		return "toolkit"
	}
	return ""
}

func kindPB(k string) pb.LayerKind {
	switch k {
	case "base":
		return pb.LayerKind_LAYER_KIND_BASE
	case "workspace":
		return pb.LayerKind_LAYER_KIND_WORKSPACE
	case "toolkit":
		return pb.LayerKind_LAYER_KIND_TOOLKIT
	}
	return pb.LayerKind_LAYER_KIND_UNSPECIFIED
}

func layerPB(l layer.Layer) *pb.Layer {
	out := &pb.Layer{
		Name: l.Name, Version: l.Version, Kind: kindPB(string(l.Kind)), Digest: l.Digest,
		Size: l.Size, Compression: l.Compression, CreatedAt: timestamppb.New(l.Created), Ref: l.Ref(),
		Source: l.Source, Files: l.Files, ContentBytes: l.ContentBytes, Remote: l.Remote, Tenant: l.Tenant,
	}
	if l.Name == "" {
		out.Ref = ""
	}
	return out
}
