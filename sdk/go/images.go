package shoal

import (
	"context"
	"encoding/base64"
	"errors"
	"strings"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// PullImage pulls an image from an OCI registry into the server's layers
// (each OCI layer a layer of its own, fetched only if the server does not
// have it), reporting lines and byte counts to progress (which may be
// nil) as BuildLayerProgress does, and returns the image. Give
// req.Credentials from DockerCredentials to forward this machine's logins.
func (c *Client) PullImage(ctx context.Context, req *pb.PullImageRequest, progress LayerProgress) (*pb.Image, error) {
	stream, err := c.Layers.PullImage(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	for stream.Receive() {
		switch ev := stream.Msg().Event.(type) {
		case *pb.PullImageEvent_Progress:
			if progress != nil {
				progress(ev.Progress, nil)
			}
		case *pb.PullImageEvent_Status:
			if progress != nil {
				progress("", ev.Status)
			}
		case *pb.PullImageEvent_Image:
			drain(stream)
			return ev.Image, nil
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("pull image: the stream ended without the image")
}

// DockerCredentials returns this machine's login for the registry of
// image, as docker keeps it (~/.docker/config.json, $DOCKER_CONFIG, its
// credential helpers), to forward in a PullImageRequest; none if there
// is no login for it (or image is not a valid reference: the server says
// what is wrong with it).
func DockerCredentials(image string) ([]*pb.RegistryCredential, error) {
	ref, err := name.ParseReference(image)
	if err != nil {
		return nil, nil
	}
	a, err := authn.DefaultKeychain.Resolve(ref.Context())
	if err != nil {
		return nil, err
	}
	if a == authn.Anonymous {
		return nil, nil
	}
	ac, err := a.Authorization()
	if err != nil {
		return nil, err
	}
	if ac.Auth != "" && ac.Username == "" && ac.Password == "" {
		// "auth": base64 of user:password.
		if u, p, ok := decodeBasic(ac.Auth); ok {
			ac.Username, ac.Password = u, p
		}
	}
	if *ac == (authn.AuthConfig{}) {
		return nil, nil
	}
	return []*pb.RegistryCredential{{
		Registry: ref.Context().RegistryStr(), Username: ac.Username, Password: ac.Password,
		IdentityToken: ac.IdentityToken, RegistryToken: ac.RegistryToken,
	}}, nil
}

func decodeBasic(auth string) (user, password string, ok bool) {
	b, err := base64.StdEncoding.DecodeString(auth)
	if err != nil {
		return "", "", false
	}
	return strings.Cut(string(b), ":")
}
