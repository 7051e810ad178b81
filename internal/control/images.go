package control

import (
	"context"
	"fmt"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// maxCredentials bounds the logins one pull may carry.
const maxCredentials = 16

// PullImage pulls an image from an OCI registry into this node's layers
// (layer.Store.PullImage), streaming its progress, and optionally saves
// it as an environment. The request's credentials are used for this pull
// only: never logged (the audit records the image alone) nor stored.
func (s *Server) PullImage(ctx context.Context, req *connect.Request[pb.PullImageRequest], stream *connect.ServerStream[pb.PullImageEvent]) error {
	r := req.Msg
	if len(r.Credentials) > maxCredentials {
		return toConnect(errdefs.New(errdefs.ErrInvalidArgument, "%d registry credentials: at most %d", len(r.Credentials), maxCredentials))
	}
	var creds []layer.Credential
	for _, c := range r.Credentials {
		for _, f := range []struct{ what, v string }{{"registry", c.Registry}, {"username", c.Username}, {"password", c.Password}, {"identity token", c.IdentityToken}, {"registry token", c.RegistryToken}} {
			if err := limits.String("credential "+f.what, f.v, 8<<10); err != nil {
				return toConnect(err)
			}
		}
		creds = append(creds, layer.Credential{Registry: c.Registry, Username: c.Username, Password: c.Password, IdentityToken: c.IdentityToken, RegistryToken: c.RegistryToken})
	}
	if r.Environment != "" {
		if s.envs != nil {
			return toConnect(errdefs.New(errdefs.ErrFailedPrecondition, "pull %s: saving it as an environment is for a single server; in a cluster, make the environment with env create --base %s", r.Image, r.Image))
		}
		if err := layer.CheckEnv(layer.Env{Name: r.Environment, Base: "x"}); err != nil {
			return toConnect(err)
		}
	}
	ps := newProgressSender(func(ev *pb.BuildLayerResponse) error {
		switch e := ev.Event.(type) {
		case *pb.BuildLayerResponse_Progress:
			return stream.Send(&pb.PullImageEvent{Event: &pb.PullImageEvent_Progress{Progress: e.Progress}})
		case *pb.BuildLayerResponse_Status:
			return stream.Send(&pb.PullImageEvent{Event: &pb.PullImageEvent_Status{Status: e.Status}})
		}
		return nil
	})
	store := s.layers(ctx) // the image and its layers' tags are the caller's
	im, err := store.PullImage(ctx, layer.PullOptions{Image: r.Image, Credentials: creds, Progress: ps.send})
	if err != nil {
		return toConnect(err)
	}
	if err := ps.err(); err != nil {
		return err
	}
	out := imagePB(im)
	if r.Environment != "" {
		base, ws := im.Stack()
		cfg := im.Config
		e, err := store.CreateEnv(layer.Env{Name: r.Environment, Base: base, Workspaces: ws, Image: &cfg}, r.Replace)
		if err != nil {
			return toConnect(err)
		}
		out.Environment = s.environmentPB(ctx, e)
	}
	return stream.Send(&pb.PullImageEvent{Event: &pb.PullImageEvent_Image{Image: out}})
}

func imagePB(im layer.PulledImage) *pb.Image {
	cfg := im.Config
	return &pb.Image{
		Ref: im.Ref, Digest: im.Digest, Platform: im.Platform,
		Layers: im.Layers, OciLayers: im.OCILayers,
		Config:       imageConfigPB(&cfg),
		PulledAt:     timestamppb.New(im.Pulled),
		FetchedBytes: im.Fetched, ReusedLayers: int32(im.Reused),
	}
}

func imageConfigPB(c *layer.ImageConfig) *pb.ImageConfig {
	if c == nil {
		return nil
	}
	return &pb.ImageConfig{Env: c.Env, WorkingDir: c.WorkingDir, User: c.User, Entrypoint: c.Entrypoint, Cmd: c.Cmd}
}

// envFromImage makes an environment whose base names an OCI image rather
// than a layer (layer.Store.ImageForBase: the same rule as a create's)
// the image's stack, pulling the image if this node has not (with the
// server's own registry logins). The image's layers go below the
// request's workspaces; its config is kept as the environment's.
func envFromImage(ctx context.Context, store layer.View, e *layer.Env) error {
	image, pull := store.ImageForBase(e.Base)
	if image == "" {
		return nil // a layer: CreateEnv checks it
	}
	var im layer.PulledImage
	var err error
	if pull {
		im, err = store.PullImage(ctx, layer.PullOptions{Image: image})
	} else {
		im, err = store.LookupPulledImage(image)
	}
	if err != nil {
		return fmt.Errorf("create environment %s: base %s: %w", e.Name, e.Base, err)
	}
	base, ws := im.Stack()
	cfg := im.Config
	e.Base, e.Workspaces, e.Image = base, append(ws, e.Workspaces...), &cfg
	return nil
}
