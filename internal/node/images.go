package node

import (
	"context"
	"fmt"
	"maps"
	"strings"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// applyImage turns a create's base that names an OCI image rather than
// a layer (layer.Store.ImageForBase says which) into the image's stack,
// pulling the image first if this node has not (with the node's own
// registry logins, serve --registry-auth). The image's layers go below
// the request's workspaces, as an environment's do, and its config (or,
// for a template made by a pull, the environment's) gives the sandbox's
// defaults: its Env under the request's, its WorkingDir and User for
// commands that name none.
func (m *Manager) applyImage(ctx context.Context, req *CreateRequest) error {
	if req.image != nil || req.Base == "" {
		return nil
	}
	v := m.layers.As(req.Owner) // the owner's pulls, and the admin's (shared)
	image, pull := v.ImageForBase(req.Base)
	if image == "" {
		return nil // a layer (or an unknown one: the create says so)
	}
	var im layer.PulledImage
	var err error
	if pull {
		m.log.Info("pulling the image of a create", "image", image)
		im, err = v.PullImage(ctx, layer.PullOptions{Image: image})
	} else {
		im, err = v.LookupPulledImage(image)
	}
	if err != nil {
		return fmt.Errorf("base %s: %w", req.Base, err)
	}
	base, ws := im.Stack()
	req.Base = base
	req.Workspaces = append(ws, req.Workspaces...)
	cfg := im.Config
	req.image = &cfg
	return nil
}

// applyImageConfig puts an image's Env under the request's, and checks
// its WorkingDir and User (of which the user part of USER:GROUP is kept:
// a command runs with its user's groups).
func applyImageConfig(req *CreateRequest) error {
	if req.image == nil {
		return nil
	}
	c := *req.image
	c.User, _, _ = strings.Cut(c.User, ":")
	if c.User == "root" || c.User == "0" {
		c.User = "" // the default
	}
	if err := limits.User("the image's user", c.User); err != nil {
		return err
	}
	if err := limits.Path("the image's working directory", c.WorkingDir); err != nil {
		return err
	}
	req.image = &c
	if len(c.Env) == 0 {
		return nil
	}
	env := make(map[string]string, len(req.image.Env)+len(req.Env))
	for _, kv := range req.image.Env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return errdefs.New(ErrInvalid, "the image's environment entry %.64q is not KEY=VALUE", kv)
		}
		env[k] = v
	}
	maps.Copy(env, req.Env)
	req.Env = env
	return nil
}

// CommandDefaults returns the working directory and user of a sandbox's
// commands that name none (its image's WorkingDir and User; "" for
// sandboxes made from layers).
func (m *Manager) CommandDefaults(id string) (cwd, user string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.lookup(id)
	if err != nil {
		return "", ""
	}
	if e.rec.Image == nil {
		return "", ""
	}
	return e.rec.Image.WorkingDir, e.rec.Image.User
}
