package control

import (
	"context"
	"fmt"
	"path"
	"strings"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"

	"connectrpc.com/connect"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// --- layers ---

func (s *Server) BuildLayer(ctx context.Context, req *connect.Request[pb.BuildLayerRequest], stream *connect.ServerStream[pb.BuildLayerResponse]) error {
	r := req.Msg
	kind, err := layer.ParseKind(kindName(r.Kind))
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	name, version, ok := strings.Cut(r.Ref, ":")
	if !ok || name == "" || version == "" {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("layer reference %q must be NAME:VERSION", r.Ref))
	}
	if !path.IsAbs(r.Source) {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("source %q must be an absolute path on the server", r.Source))
	}
	pw := &progressWriter{stream: stream}
	l, err := s.node.Layers().Build(ctx, layer.BuildOptions{
		Kind: kind, Name: name, Version: version, Source: r.Source,
		Compression: r.Compression, Progress: pw,
	})
	if err != nil {
		return toConnect(err)
	}
	return stream.Send(&pb.BuildLayerResponse{Event: &pb.BuildLayerResponse_Layer{Layer: layerPB(l)}})
}

// progressWriter turns the layer builder's progress lines into stream events.
type progressWriter struct {
	stream *connect.ServerStream[pb.BuildLayerResponse]
}

func (p *progressWriter) Write(b []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		if line == "" {
			continue
		}
		if err := p.stream.Send(&pb.BuildLayerResponse{Event: &pb.BuildLayerResponse_Progress{Progress: line}}); err != nil {
			return 0, err
		}
	}
	return len(b), nil
}

func (s *Server) ListLayers(ctx context.Context, req *connect.Request[pb.ListLayersRequest]) (*connect.Response[pb.ListLayersResponse], error) {
	ls, err := s.node.Layers().List()
	if err != nil {
		return nil, toConnect(err)
	}
	out := &pb.ListLayersResponse{}
	for _, l := range ls {
		out.Layers = append(out.Layers, layerPB(l))
	}
	return connect.NewResponse(out), nil
}

func (s *Server) GetLayer(ctx context.Context, req *connect.Request[pb.GetLayerRequest]) (*connect.Response[pb.Layer], error) {
	l, err := s.node.Layers().Resolve(req.Msg.Ref)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(layerPB(l)), nil
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
	return &pb.Layer{
		Name: l.Name, Version: l.Version, Kind: kindPB(string(l.Kind)), Digest: l.Digest,
		Size: l.Size, Compression: l.Compression, CreatedAt: timestamppb.New(l.Created), Ref: l.Ref(),
	}
}
