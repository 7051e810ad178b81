package layer

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// Env is a named environment (a template): a stack of layer references,
// one base then workspaces and toolkits, kept as given. Tags in it are
// resolved when a sandbox is created from it, so moving a tag upgrades the
// environment for every later sandbox (running ones keep their digests).
type Env struct {
	Name       string   `json:"name"`
	Base       string   `json:"base"`
	Workspaces []string `json:"workspaces,omitempty"`
	Toolkits   []string `json:"toolkits,omitempty"`
	// Backend: the backend of sandboxes made from it unless their create
	// names one ("": the node's default). The node checks it exists.
	Backend string `json:"backend,omitempty"`
	// Image: for an environment made from a pulled OCI image (pull.go),
	// the image's config: the defaults (environment variables, working
	// directory, user) of the sandboxes made from it. nil otherwise.
	Image   *ImageConfig `json:"image,omitempty"`
	Created time.Time    `json:"created"`
	// Mirrored: on a node of a cluster, the etcd revision this copy was
	// mirrored at (internal/cluster's LayerMirror); 0 for one made here.
	Mirrored int64 `json:"mirrored,omitempty"`
	// Tenant owns it (owner.go); "" for the admin's, shared. Its
	// references resolve in its tenant's namespace, then the shared one.
	Tenant string `json:"tenant,omitempty"`
}

// Key returns the environment's name qualified by its tenant,
// "tenant/name", or "name" for a shared one: its key in the store and the
// cluster.
func (e Env) Key() string { return nsKey(e.Tenant, e.Name) }

// ResolvedBy is whom the environment's references resolve as in a call
// by o: o itself, but the environment's tenant when the admin uses a
// tenant's environment (its names are that tenant's).
func (e Env) ResolvedBy(o Owner) Owner {
	if e.Tenant != "" && o.Admin {
		return Owner{Tenant: e.Tenant}
	}
	return o
}

// QualifiedRefs returns the environment's references (base, workspaces,
// toolkits) each qualified by the namespace it resolves in for a create
// from it by anyone: a shared environment's in the shared namespace
// ("/name:version"), a tenant's as they are (that tenant creates from it).
func (e Env) QualifiedRefs() (base string, workspaces, toolkits []string) {
	q := func(r string) string {
		if e.Tenant != "" || strings.HasPrefix(r, "sha256:") || strings.Contains(r, "/") {
			return r
		}
		return "/" + r
	}
	for _, w := range e.Workspaces {
		workspaces = append(workspaces, q(w))
	}
	for _, t := range e.Toolkits {
		toolkits = append(toolkits, q(t))
	}
	return q(e.Base), workspaces, toolkits
}

// refs returns every reference of the environment.
func (e Env) refs() []string {
	out := append([]string{e.Base}, e.Workspaces...)
	return append(out, e.Toolkits...)
}

// ResolveStack resolves a stack of references and checks their kinds; it
// returns the layers top to bottom (toolkits in order, then workspaces in
// order, then the base): the overlayfs lowerdir order, where the first
// wins. A missing layer wraps ErrNotFound; a malformed reference, a layer
// of the wrong kind or a missing base is marked
// errdefs.ErrInvalidArgument.
func (s *Store) ResolveStack(base string, workspaces, toolkits []string) ([]Layer, error) {
	return s.resolveStack(s.As(AdminOwner), base, workspaces, toolkits)
}

func (s *Store) resolveStack(v View, base string, workspaces, toolkits []string) ([]Layer, error) {
	if base == "" {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "a base layer is required: a stack is exactly one base, then any workspaces and toolkits")
	}
	var out []Layer
	add := func(ref string, want Kind) error {
		l, err := v.Resolve(ref)
		if err != nil {
			return err
		}
		if l.Kind != want {
			return errdefs.New(errdefs.ErrInvalidArgument, "layer %s is a %s layer, not a %s layer", ref, l.Kind, want)
		}
		out = append(out, l)
		return nil
	}
	for _, r := range toolkits {
		if err := add(r, KindToolkit); err != nil {
			return nil, err
		}
	}
	for _, r := range workspaces {
		if err := add(r, KindWorkspace); err != nil {
			return nil, err
		}
	}
	if err := add(base, KindBase); err != nil {
		return nil, err
	}
	if len(out) > maxLowers {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "%d layers in one stack: at most %d", len(out), maxLowers)
	}
	return out, nil
}

// CreateEnv saves a shared environment (the admin's) after checking that
// each of its references resolves to a layer of the right kind. An
// environment of the same name is replaced if replace is set, else the
// call fails with errdefs.ErrAlreadyExists.
func (s *Store) CreateEnv(e Env, replace bool) (Env, error) {
	return s.As(AdminOwner).CreateEnv(e, replace)
}

// createEnv saves e (e.Tenant set by the caller), its stack resolved as v
// sees it.
func (s *Store) createEnv(v View, e Env, replace bool) (Env, error) {
	if err := validateName(e.Name); err != nil {
		return Env{}, errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("create environment: %w", err))
	}
	if len(e.Backend) > 64 {
		return Env{}, errdefs.New(errdefs.ErrInvalidArgument, "create environment %s: a backend name of %d bytes (at most 64)", e.Name, len(e.Backend))
	}
	// Hold off Remove and GC until the environment is saved: the layers it
	// names must not go in between.
	s.gcMu.RLock()
	defer s.gcMu.RUnlock()
	if _, err := v.ResolveStack(e.Base, e.Workspaces, e.Toolkits); err != nil {
		return Env{}, fmt.Errorf("create environment %s: %w", e.Name, err)
	}
	e.Created = time.Now().UTC().Truncate(time.Millisecond)
	val, err := json.Marshal(e)
	if err != nil {
		return Env{}, err
	}
	err = s.db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket(envsBucket)
		if !replace && b.Get([]byte(e.Key())) != nil {
			return errdefs.New(errdefs.ErrAlreadyExists, "environment %s exists: remove it first or replace it", e.Name)
		}
		return b.Put([]byte(e.Key()), val)
	})
	if err != nil {
		return Env{}, fmt.Errorf("create environment %s: %w", e.Name, err)
	}
	s.log.Info("environment saved", "env", e.Key(), "base", e.Base, "workspaces", e.Workspaces, "toolkits", e.Toolkits, "backend", e.Backend)
	return e, nil
}

// GetEnv returns the environment of that name as the admin sees it (a
// shared one, or "tenant/name"); an unknown one is marked
// errdefs.ErrNotFound.
func (s *Store) GetEnv(name string) (Env, error) { return s.As(AdminOwner).GetEnv(name) }

// getEnv returns the environment of key (Env.Key).
func (s *Store) getEnv(key string) (Env, bool, error) {
	var e Env
	var found bool
	err := s.db.View(func(tx *bbolt.Tx) error {
		var err error
		found, err = get(tx.Bucket(envsBucket), key, &e)
		return err
	})
	if err != nil {
		return Env{}, false, fmt.Errorf("get environment %s: %w", key, err)
	}
	return e, found, nil
}

// Envs returns every environment of every tenant, sorted by key.
func (s *Store) Envs() ([]Env, error) { return s.envs() }

func (s *Store) envs() ([]Env, error) {
	var out []Env
	err := s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(envsBucket).ForEach(func(k, v []byte) error {
			var e Env
			if err := json.Unmarshal(v, &e); err != nil {
				return fmt.Errorf("decode environment %s: %w", k, err)
			}
			out = append(out, e)
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("list environments: %w", err)
	}
	return out, nil // bbolt iterates in key order
}

// DeleteEnv removes an environment (a shared one, or "tenant/name");
// sandboxes created from it keep running on their layers.
func (s *Store) DeleteEnv(name string) error { return s.As(AdminOwner).DeleteEnv(name) }

func (s *Store) deleteEnv(key string) error {
	err := s.db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket(envsBucket)
		if b.Get([]byte(key)) == nil {
			return errdefs.New(errdefs.ErrNotFound, "no environment %q (see shoal env ls)", key)
		}
		return b.Delete([]byte(key))
	})
	if err != nil {
		return fmt.Errorf("remove environment %s: %w", key, err)
	}
	s.log.Info("environment removed", "env", key)
	return nil
}

// CheckEnv checks what can be checked of an environment without its
// layers: its name, the length of its backend's name and of its stack.
// CreateEnv does this too; a cluster (internal/cluster) checks with it
// before it writes an environment to etcd.
func CheckEnv(e Env) error {
	if err := validateName(e.Name); err != nil {
		return errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("environment: %w", err))
	}
	if e.Tenant != "" {
		if err := validateTenant(e.Tenant); err != nil {
			return errdefs.Mark(errdefs.ErrInvalidArgument, fmt.Errorf("environment: %w", err))
		}
	}
	if len(e.Backend) > 64 {
		return errdefs.New(errdefs.ErrInvalidArgument, "environment %s: a backend name of %d bytes (at most 64)", e.Name, len(e.Backend))
	}
	if e.Base == "" {
		return errdefs.New(errdefs.ErrInvalidArgument, "environment %s: a base layer is required", e.Name)
	}
	if n := len(e.refs()); n > limits.Layers {
		return errdefs.New(errdefs.ErrInvalidArgument, "environment %s: %d layers in one stack: at most %d", e.Name, n, limits.Layers)
	}
	for _, r := range e.refs() {
		if err := limits.String("layer ref", r, limits.RefBytes); err != nil {
			return fmt.Errorf("environment %s: %w", e.Name, err)
		}
	}
	return nil
}

// MirrorEnv saves an environment as the cluster has it (a node of a
// cluster keeps a copy of etcd's environments, internal/cluster's
// LayerMirror), replacing one of the same name, without checking that its
// layers are here: a create from it resolves them then, as for a tag
// moved after the environment was saved.
func (s *Store) MirrorEnv(e Env) error {
	if err := CheckEnv(e); err != nil {
		return err
	}
	v, err := json.Marshal(e)
	if err != nil {
		return err
	}
	return s.db.Update(func(tx *bbolt.Tx) error { return tx.Bucket(envsBucket).Put([]byte(e.Key()), v) })
}

// UnmirrorEnv removes an environment (by its key, Env.Key) the cluster no
// longer has; one already gone is not an error.
func (s *Store) UnmirrorEnv(key string) error {
	return s.db.Update(func(tx *bbolt.Tx) error { return tx.Bucket(envsBucket).Delete([]byte(key)) })
}
