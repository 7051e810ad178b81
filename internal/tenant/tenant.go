// Package tenant is who may do what on a Shoal node: API keys that belong
// to tenants and carry scopes, the principal a request is made by, and the
// per-tenant quotas that node admission enforces.
//
// A key is stored as the SHA-256 of its plaintext (the plaintext is shown
// once, when the key is made) with its name, tenant, scopes and creation
// time, in the node's bbolt store (Store); quotas are stored beside the
// keys. A node or control replica of a cluster keeps them in etcd instead
// (internal/cluster's Tenancy, made with the same NewKey and Quota). The
// admin key of DATA/admin.key is not stored here: it is the admin principal
// (every scope, every tenant), checked by internal/control.
//
// A principal sees the sandboxes of its own tenant only, unless it has the
// admin scope; the API faces ask Principal.Sees through one helper each
// (control.Server.sandboxFor, e2b's ownership middleware).
package tenant

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// Scope is a set of operations a key may call.
type Scope string

// Scopes.
const (
	// ScopeSandboxes: everything about the key's tenant's own sandboxes
	// (create, get, list, delete, timeouts, commands, shells,
	// trajectories, files, watch, ports) and FnCall runs.
	ScopeSandboxes Scope = "sandboxes"
	// ScopeLayersRead: list and inspect layers and environments, and
	// name them in creates.
	ScopeLayersRead Scope = "layers:read"
	// ScopeLayersWrite: build, commit (of an own sandbox), tag, remove,
	// import, export, gc layers; create and remove environments.
	ScopeLayersWrite Scope = "layers:write"
	// ScopeAdmin: keys, tenants and quotas, the audit log, metrics, and
	// every tenant's sandboxes.
	ScopeAdmin Scope = "admin"
)

// Scopes lists every scope.
var Scopes = []Scope{ScopeSandboxes, ScopeLayersRead, ScopeLayersWrite, ScopeAdmin}

// ParseScopes parses a comma-separated list of scopes.
func ParseScopes(s string) ([]Scope, error) {
	var out []Scope
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		if !slices.Contains(Scopes, Scope(f)) {
			return nil, errdefs.New(errdefs.ErrInvalidArgument, "unknown scope %q (scopes: sandboxes, layers:read, layers:write, admin)", f)
		}
		if !slices.Contains(out, Scope(f)) {
			out = append(out, Scope(f))
		}
	}
	if len(out) == 0 {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "a key needs at least one scope (sandboxes, layers:read, layers:write, admin)")
	}
	return out, nil
}

// Principal is who a request is made by: a key's name, its tenant and
// scopes.
type Principal struct {
	Key    string // the key's name; "admin" for DATA/admin.key
	Tenant string // "" for the admin key
	Scopes []Scope
}

// AdminKeyName is the name the admin key of DATA/admin.key goes by.
const AdminKeyName = "admin"

// Admin is the principal of the admin key.
func Admin() *Principal {
	return &Principal{Key: AdminKeyName, Scopes: []Scope{ScopeAdmin}}
}

// IsAdmin reports whether p has the admin scope (nil: no).
func (p *Principal) IsAdmin() bool { return p != nil && slices.Contains(p.Scopes, ScopeAdmin) }

// Has reports whether p may use scope s (admin may use every scope).
func (p *Principal) Has(s Scope) bool {
	return p != nil && (slices.Contains(p.Scopes, s) || slices.Contains(p.Scopes, ScopeAdmin))
}

// Require returns a permission_denied error naming the first of scopes that
// p lacks, or nil.
func (p *Principal) Require(what string, scopes ...Scope) error {
	for _, s := range scopes {
		if !p.Has(s) {
			name := "no key"
			if p != nil {
				name = fmt.Sprintf("key %q", p.Key)
			}
			return errdefs.New(errdefs.ErrPermissionDenied, "%s needs scope %q, which %s lacks", what, s, name)
		}
	}
	return nil
}

// Sees reports whether p may see an object (a sandbox) of tenant t.
func (p *Principal) Sees(t string) bool {
	return p != nil && (p.IsAdmin() || p.Tenant == t)
}

// String names p for logs and the audit log.
func (p *Principal) String() string {
	if p == nil {
		return "nobody"
	}
	if p.Tenant == "" {
		return p.Key
	}
	return p.Key + "@" + p.Tenant
}

type principalKey struct{}

// WithPrincipal returns ctx carrying p.
func WithPrincipal(ctx context.Context, p *Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// FromContext returns the principal ctx carries, or nil (which has no
// scope and sees nothing).
func FromContext(ctx context.Context) *Principal {
	p, _ := ctx.Value(principalKey{}).(*Principal)
	return p
}

// ValidName checks a tenant or key name: 1 to 63 of [a-z0-9._-], starting
// with a letter or digit.
func ValidName(what, s string) error {
	if len(s) == 0 || len(s) > 63 {
		return errdefs.New(errdefs.ErrInvalidArgument, "%s name %q: want 1 to 63 characters", what, s)
	}
	for i, c := range s {
		ok := c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || i > 0 && (c == '.' || c == '_' || c == '-')
		if !ok {
			return errdefs.New(errdefs.ErrInvalidArgument, "%s name %q: use lowercase letters, digits, '.', '_' and '-', starting with a letter or digit", what, s)
		}
	}
	return nil
}
