package layer

// Tenants own names. Every tag and environment lives in a namespace: a
// tenant's, or the admin's, which is shared (read-only to tenants). The
// store keys them by their qualified name:
//
//	layer.tags   "name:version"          a shared tag (the admin's)
//	             "tenant/name:version"   a tenant's tag
//	layer.envs   "name" / "tenant/name"  likewise for environments
//	layer.blobs  "sha256:<hex>"          images are content: never namespaced
//
// Records written before tenants owned names have unqualified keys and no
// tenant field: they load as the admin's, shared (no migration step). An
// image (a digest) is stored once whoever built it; what a tenant holds is
// its references to it. A tenant resolves a name in its own namespace
// first, then in the shared one; "tenant/name:version" names one namespace
// (its own, or any for the admin), "/name:version" the shared one. A digest
// resolves for a tenant only when one of its own or a shared tag points at
// it, or it (or the admin) built it last.

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Owner is whom a call of the store is made for.
type Owner struct {
	// Tenant is the namespace the caller's names live in ("" for the
	// admin's: shared).
	Tenant string
	// Admin sees and changes every namespace; what it makes is shared.
	Admin bool
}

// AdminOwner is the admin: every namespace, writing the shared one.
var AdminOwner = Owner{Admin: true}

// OwnerOf is the owner of a call by a principal of tenant t, with the
// admin scope or not: the admin writes shared names whatever its tenant.
func OwnerOf(t string, admin bool) Owner {
	if admin {
		return AdminOwner
	}
	return Owner{Tenant: t}
}

// ErrReadOnly: a tenant tried to change a shared (the admin's) name.
var ErrReadOnly = errdefs.Mark(errdefs.ErrPermissionDenied, errors.New("shared by the admin: read-only to tenants"))

// nsKey qualifies name by namespace ns ("" : shared, unqualified).
func nsKey(ns, name string) string {
	if ns == "" {
		return name
	}
	return ns + "/" + name
}

// home is the namespace o writes.
func (o Owner) home() (string, error) {
	if o.Admin {
		return "", nil
	}
	if o.Tenant == "" {
		return "", errdefs.New(errdefs.ErrPermissionDenied, "a key without a tenant cannot own layers or environments")
	}
	return o.Tenant, nil
}

// reads says whether o may read names of namespace ns.
func (o Owner) reads(ns string) bool { return o.Admin || ns == "" || ns == o.Tenant }

// writes says whether o may change names of namespace ns.
func (o Owner) writes(ns string) bool { return o.Admin || ns != "" && ns == o.Tenant }

// namespaces are where o looks a reference up, in order.
func (o Owner) namespaces(p parsedRef) []string {
	if p.qualified {
		if !o.reads(p.tenant) {
			return nil
		}
		return []string{p.tenant}
	}
	if o.Tenant != "" && !o.Admin {
		return []string{o.Tenant, ""}
	}
	return []string{""}
}

// target is the namespace and key a name given by o is written under: a
// qualified one (if o may write it), else o's home.
func (o Owner) target(p parsedRef) (ns string, err error) {
	if p.qualified {
		if !o.writes(p.tenant) {
			if p.tenant == "" {
				return "", ErrReadOnly
			}
			return "", errdefs.New(errdefs.ErrPermissionDenied, "namespace %s is another tenant's", p.tenant)
		}
		return p.tenant, nil
	}
	return o.home()
}

// View is the store as one owner sees it: its own names and the shared
// ones (every name for the admin). The API faces use a View for every
// call a principal makes; the Store's own methods are the admin's view.
type View struct {
	s *Store
	o Owner
}

// As returns the store as o sees it.
func (s *Store) As(o Owner) View { return View{s: s, o: o} }

// Owner returns whom v is for.
func (v View) Owner() Owner { return v.o }

// seesDigest says whether the owner may use the image of digest: the
// admin; or one of the owner's or a shared tag points at it; or its record
// is the owner's or shared.
func (v View) seesDigest(tx *bbolt.Tx, digest string) (bool, error) {
	if v.o.Admin {
		return true, nil
	}
	var l Layer
	found, err := get(tx.Bucket(blobsBucket), digest, &l)
	if err != nil || found && v.o.reads(l.Tenant) {
		return found, err
	}
	seen := false
	err = tx.Bucket(tagsBucket).ForEach(func(k, val []byte) error {
		if seen {
			return nil
		}
		var t Layer
		if err := json.Unmarshal(val, &t); err != nil {
			return fmt.Errorf("decode tag %s: %w", k, err)
		}
		seen = t.Digest == digest && v.o.reads(t.Tenant)
		return nil
	})
	return seen, err
}

// List returns the tagged layers the owner sees, sorted by name then
// version then tenant (shared first).
func (v View) List() ([]Layer, error) {
	all, err := v.s.list()
	if err != nil {
		return nil, err
	}
	out := all[:0]
	for _, l := range all {
		if v.o.reads(l.Tenant) {
			out = append(out, l)
		}
	}
	return out, nil
}

// Images returns the stored images the owner sees, with their tags that
// the owner sees (qualified by their tenant when not the owner's own or
// shared).
func (v View) Images() ([]Image, error) {
	ims, err := v.s.images(v.o)
	if err != nil {
		return nil, err
	}
	var out []Image
	err = v.s.db.View(func(tx *bbolt.Tx) error {
		for _, im := range ims {
			if len(im.Tags) == 0 {
				ok, err := v.seesDigest(tx, im.Digest)
				if err != nil {
					return err
				}
				if !ok {
					continue
				}
			}
			out = append(out, im)
		}
		return nil
	})
	return out, err
}

// Tags returns the tags of digest the owner sees, sorted.
func (v View) Tags(digest string) ([]string, error) { return v.s.tags(v.o, digest) }

// displayTag is how the owner is shown tag l: "name:version" for its own
// and shared ones, "tenant/name:version" for another tenant's (the admin).
func (o Owner) displayTag(l Layer) string {
	if l.Tenant == "" || l.Tenant == o.Tenant && !o.Admin {
		return l.Ref()
	}
	return l.Key()
}

// CreateEnv saves an environment in the owner's namespace (see
// Store.CreateEnv), its references resolved as the owner sees them.
func (v View) CreateEnv(e Env, replace bool) (Env, error) {
	ns, err := v.o.home()
	if err != nil {
		return Env{}, fmt.Errorf("create environment %s: %w", e.Name, err)
	}
	e.Tenant = ns
	return v.s.createEnv(v, e, replace)
}

// GetEnv returns the environment name names for the owner: its own, else
// a shared one ("tenant/name" or "/name": that namespace's).
func (v View) GetEnv(name string) (Env, error) {
	for _, k := range v.envKeys(name) {
		e, found, err := v.s.getEnv(k)
		if err != nil || found {
			return e, err
		}
	}
	return Env{}, errdefs.New(errdefs.ErrNotFound, "no environment %q (see shoal env ls)", name)
}

// envKeys are the keys an environment name given by the owner may have,
// in the order they are looked up.
func (v View) envKeys(name string) []string {
	ns, n, ok := strings.Cut(name, "/")
	if !ok {
		if v.o.Tenant != "" && !v.o.Admin {
			return []string{nsKey(v.o.Tenant, name), name}
		}
		return []string{name}
	}
	if !v.o.reads(ns) || strings.Contains(n, "/") {
		return nil
	}
	return []string{nsKey(ns, n)}
}

// Envs returns the environments the owner sees, sorted by key.
func (v View) Envs() ([]Env, error) {
	all, err := v.s.envs()
	if err != nil {
		return nil, err
	}
	out := all[:0]
	for _, e := range all {
		if v.o.reads(e.Tenant) {
			out = append(out, e)
		}
	}
	return out, nil
}

// DeleteEnv removes one of the owner's environments; a shared one is
// read-only to tenants (ErrReadOnly).
func (v View) DeleteEnv(name string) error {
	e, err := v.GetEnv(name)
	if err != nil {
		return fmt.Errorf("remove environment %s: %w", name, err)
	}
	if !v.o.writes(e.Tenant) {
		return fmt.Errorf("remove environment %s: %w", name, ErrReadOnly)
	}
	return v.s.deleteEnv(e.Key())
}

// ResolveStack is Store.ResolveStack with every reference resolved as the
// owner sees it.
func (v View) ResolveStack(base string, workspaces, toolkits []string) ([]Layer, error) {
	return v.s.resolveStack(v, base, workspaces, toolkits)
}

// Remove removes one of the owner's tags or images (see Store.Remove): a
// shared one is read-only to tenants (ErrReadOnly); an image by digest
// only when the owner built it last (the admin: any).
func (v View) Remove(ref string, usage Usage) (RemoveResult, error) {
	res, err := v.s.remove(v, ref, usage)
	if err != nil {
		return RemoveResult{}, fmt.Errorf("remove layer %s: %w", ref, err)
	}
	return res, nil
}

// envNames says whether environment e names the tag of key (as a create
// from it could resolve it: in e's namespace or the shared one).
func envNames(e Env, key string) bool {
	return slices.ContainsFunc(e.refs(), func(r string) bool {
		p, err := parseRef(r)
		if err != nil || p.version == "" {
			return false
		}
		if p.qualified {
			return p.key(p.tenant) == key
		}
		return p.key(e.Tenant) == key || p.key("") == key
	})
}
