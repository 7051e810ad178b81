package control

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// TestLayerOwnership: whose layers a request sees and writes follows from
// its principal: a tenant's key its tenant's own (then the shared ones),
// the admin every tenant's, writing the shared ones; a key without a
// tenant owns nothing; layer gc is the admin's; a replica reads a create's
// tags under the keys the node resolves them by.
func TestLayerOwnership(t *testing.T) {
	ten := tenant.Key{Name: "k", Tenant: "acme", Scopes: []tenant.Scope{tenant.ScopeLayersRead, tenant.ScopeLayersWrite}}.Principal()
	ctxT := tenant.WithPrincipal(context.Background(), ten)
	ctxA := tenant.WithPrincipal(context.Background(), tenant.Admin())
	ctxN := tenant.WithPrincipal(context.Background(), &tenant.Principal{Key: "x", Scopes: []tenant.Scope{tenant.ScopeLayersWrite}})

	if o := layerOwner(ctxT); o != (layer.Owner{Tenant: "acme"}) {
		t.Fatalf("a tenant's owner: %+v", o)
	}
	if o := layerOwner(ctxA); o != layer.AdminOwner {
		t.Fatalf("the admin's owner: %+v", o)
	}
	if o := layerOwner(context.Background()); o != (layer.Owner{}) {
		t.Fatalf("no principal: %+v", o)
	}
	if h, err := ownerHome(ctxT); err != nil || h != "acme" {
		t.Fatalf("a tenant's home: %q %v", h, err)
	}
	if h, err := ownerHome(ctxA); err != nil || h != "" {
		t.Fatalf("the admin's home: %q %v", h, err)
	}
	if _, err := ownerHome(ctxN); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("a key without a tenant writes: %v", err)
	}
	for _, c := range []struct {
		ctx           context.Context
		tenant        string
		reads, writes bool
	}{
		{ctxT, "acme", true, true}, {ctxT, "", true, false}, {ctxT, "other", false, false},
		{ctxA, "acme", true, true}, {ctxA, "", true, true},
		{ctxN, "", true, false}, {ctxN, "acme", false, false},
	} {
		if r, w := ownerReads(c.ctx, c.tenant), ownerWrites(c.ctx, c.tenant); r != c.reads || w != c.writes {
			t.Errorf("%v on tenant %q: reads %v writes %v, want %v %v", tenant.FromContext(c.ctx), c.tenant, r, w, c.reads, c.writes)
		}
	}
	if got := envName(layer.Owner{Tenant: "acme"}, layer.Env{Name: "prod", Tenant: "acme"}); got != "prod" {
		t.Errorf("a tenant's own environment shown as %q", got)
	}
	if got := envName(layer.AdminOwner, layer.Env{Name: "prod", Tenant: "acme"}); got != "acme/prod" {
		t.Errorf("a tenant's environment shown to the admin as %q", got)
	}
	if err := authorizeProcedure(ctxT, "/shoal.v1.LayerService/GarbageCollectLayers"); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("a tenant's layers:write key collects every tenant's images: %v", err)
	}
	if err := authorizeProcedure(ctxT, "/shoal.v1.LayerService/TagLayer"); err != nil {
		t.Errorf("a tenant's layers:write key tags: %v", err)
	}
	// The tags a create names, as a replica reads their revisions.
	for _, c := range []struct {
		ctx  context.Context
		ref  string
		want []string
	}{
		{ctxT, "py:3", []string{"acme/py:3", "py:3"}},
		{ctxT, "/py:3", []string{"py:3"}},
		{ctxT, "acme/py:3", []string{"acme/py:3"}},
		{ctxT, "other/py:3", nil},
		{ctxA, "py:3", []string{"py:3"}},
		{ctxA, "other/py:3", []string{"other/py:3"}},
		{ctxT, "sha256:" + strings.Repeat("a", 64), nil},
	} {
		if got := tagKeys(c.ctx, c.ref); !slices.Equal(got, c.want) {
			t.Errorf("tagKeys(%v, %q) = %q, want %q", tenant.FromContext(c.ctx), c.ref, got, c.want)
		}
	}
	if !isTagKey("acme/py:3") || !isTagKey("py:3") || isTagKey("/py:3") || isTagKey("a/b/py:3") {
		t.Error("isTagKey")
	}
}
