package layer

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"slices"
	"testing"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// TestTenantsOwnNames: each hostile action of tenant A on tenant B's
// layers and environments is refused as not found or permission denied,
// B's names untouched; shared (admin) names are read-only to both; the
// same content is one image whoever built it, each tenant's tag its own.
func TestTenantsOwnNames(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	src := writeTree(t, filepath.Join(e.root, "src"), map[string]string{"etc/os-release": "ID=test\n"})
	other := writeTree(t, filepath.Join(e.root, "other"), map[string]string{"mine": "A's\n"})
	shared := e.build(t, "base", "1", src) // the admin's: shared
	a, b := e.store.As(Owner{Tenant: "a"}), e.store.As(Owner{Tenant: "b"})
	build := func(tenant, name, source string) Layer {
		t.Helper()
		l, err := e.store.Build(ctx, BuildOptions{Kind: KindBase, Name: name, Version: "1", Source: source, Tenant: tenant})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	lb := build("b", "app", src)    // same content as the shared base: one image
	la := build("a", "evil", other) // A's own
	la2 := build("a", "app", other) // A's "app:1" is not B's
	if lb.Digest != shared.Digest || lb.Tenant != "b" || la2.Tenant != "a" {
		t.Fatalf("b's app %s (tenant %q), shared %s, a's app tenant %q", lb.Digest, lb.Tenant, shared.Digest, la2.Tenant)
	}
	if _, err := b.CreateEnv(Env{Name: "prod", Base: "app:1"}, false); err != nil {
		t.Fatal(err)
	}
	denied := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, errdefs.ErrPermissionDenied) {
			t.Fatalf("%s: %v, want not found or permission denied", what, err)
		}
	}

	// A lists only its own and shared names.
	ls, err := a.List()
	if err != nil {
		t.Fatal(err)
	}
	var refs []string
	for _, l := range ls {
		refs = append(refs, l.Key())
	}
	if want := []string{"a/app:1", "base:1", "a/evil:1"}; !slices.Equal(refs, want) {
		t.Fatalf("A lists %v, want %v", refs, want)
	}
	envs, err := a.Envs()
	if err != nil || len(envs) != 0 {
		t.Fatalf("A lists environments %v (%v), want none", envs, err)
	}
	// A's "app:1" is its own; B's is out of reach, qualified or not.
	if l, err := a.Resolve("app:1"); err != nil || l.Digest != la2.Digest {
		t.Fatalf("A resolves app:1 to %v (%v), want its own", l.Digest, err)
	}
	_, err = a.Resolve("b/app:1")
	denied("A resolves b/app:1", err)
	_, err = a.Resolve("app@" + lb.Digest)
	denied("A resolves B's name@digest", err)
	_, err = a.GetEnv("prod")
	denied("A gets B's environment", err)
	_, err = a.GetEnv("b/prod")
	denied("A gets b/prod", err)
	_, _, err = a.OpenExport(ctx, "b/app:1")
	denied("A exports B's layer", err)
	// A's environment of the same name is its own: B's next create still
	// resolves B's stack.
	if _, err := a.CreateEnv(Env{Name: "prod", Base: "evil:1"}, true); err != nil {
		t.Fatal(err)
	}
	if env, err := b.GetEnv("prod"); err != nil || env.Base != "app:1" || env.Tenant != "b" {
		t.Fatalf("B's prod after A's replace: %+v (%v)", env, err)
	}
	// A cannot move B's tag, nor the shared one, nor point its own at an
	// image it does not see.
	_, _, err = a.Tag("evil:1", "b/app:1")
	denied("A moves b/app:1", err)
	_, _, err = a.Tag("evil:1", "/base:1")
	denied("A moves the shared base:1", err)
	if _, _, err := a.Tag("evil:1", "app:1"); err != nil { // its own app:1
		t.Fatal(err)
	}
	if l, err := b.Resolve("app:1"); err != nil || l.Digest != lb.Digest {
		t.Fatalf("B's app:1 after A's tag: %s (%v), want %s", l.Digest, err, lb.Digest)
	}
	// A cannot remove B's tag or image, nor a shared one.
	_, err = a.Remove("b/app:1", nil)
	denied("A removes b/app:1", err)
	_, err = a.Remove("base:1", nil)
	denied("A removes the shared base:1", err)
	_, err = a.Remove(lb.Digest, nil)
	denied("A removes the image of B's layer", err)
	err = a.DeleteEnv("b/prod")
	denied("A removes b/prod", err)
	// B's names are all there.
	if l, err := b.Resolve("app:1"); err != nil || l.Digest != lb.Digest {
		t.Fatalf("B's app:1: %v", err)
	}

	// Shared names: read by both (a digest included), changed by neither.
	if l, err := a.Resolve("base:1"); err != nil || l.Tenant != "" {
		t.Fatalf("A resolves the shared base:1: %v", err)
	}
	if _, err := a.Resolve(shared.Digest); err != nil {
		t.Fatalf("A resolves the shared image by digest: %v", err)
	}
	if _, err := a.Resolve(la.Digest); err != nil {
		t.Fatalf("A resolves its own image by digest: %v", err)
	}
	_, err = b.Resolve(la.Digest)
	denied("B resolves A's image by digest", err)
	if _, err := a.CreateEnv(Env{Name: "on-shared", Base: "base:1"}, false); err != nil {
		t.Fatalf("A's environment on the shared base: %v", err)
	}
	if _, err := e.store.CreateEnv(Env{Name: "std", Base: "base:1"}, false); err != nil {
		t.Fatal(err)
	}
	err = a.DeleteEnv("std")
	denied("A removes the shared environment", err)
	if env, err := a.GetEnv("std"); err != nil || env.Tenant != "" {
		t.Fatalf("A gets the shared environment: %+v (%v)", env, err)
	}
	// A shared environment's references are the shared layers, even for a
	// tenant with a tag of the same name.
	if _, _, err := b.Tag(la2.Digest, "base:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("B tags A's image: %v, want not found", err)
	}
	if _, _, err := b.Tag("app:1", "base:1"); err != nil { // B's own base:1
		t.Fatal(err)
	}
	env, _ := b.GetEnv("std")
	base, _, _ := env.QualifiedRefs()
	if l, err := b.Resolve(base); err != nil || l.Tenant != "" {
		t.Fatalf("the shared environment resolves for B to %+v (%v), want the shared base", l, err)
	}

	// The admin publishes A's layer as shared: B uses it, changes it not.
	if _, _, err := e.store.Tag("a/evil:1", "pub:1"); err != nil {
		t.Fatal(err)
	}
	if l, err := b.Resolve("pub:1"); err != nil || l.Digest != la.Digest || l.Tenant != "" {
		t.Fatalf("B resolves the published pub:1: %+v (%v)", l, err)
	}
	_, err = b.Remove("pub:1", nil)
	denied("B removes the published pub:1", err)
	if _, err := e.store.Remove("pub:1", nil); err != nil {
		t.Fatal(err)
	}
	// The admin uses B's environment as B would: B's app:1.
	benv, err := e.store.GetEnv("b/prod")
	if err != nil {
		t.Fatal(err)
	}
	bbase, _, _ := benv.QualifiedRefs()
	if l, err := e.store.As(benv.ResolvedBy(AdminOwner)).Resolve(bbase); err != nil || l.Tenant != "b" || l.Digest != lb.Digest {
		t.Fatalf("B's environment for the admin resolves to %+v (%v), want B's app:1", l, err)
	}
	// A tenant removes its own environment; the admin sees and removes
	// everyone's tags, by qualified names.
	if err := a.DeleteEnv("prod"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.Remove("a/evil:1", nil); err != nil {
		t.Fatal(err)
	}
	// A tenant removes its own tag.
	if _, err := a.Remove("app:1", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Resolve("app:1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("A's app:1 after removal: %v", err)
	}
	// A key without a tenant owns nothing.
	if _, err := e.store.As(Owner{}).CreateEnv(Env{Name: "x", Base: "base:1"}, false); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("an environment by a key without a tenant: %v", err)
	}
}

// TestOldRecordsAreShared: tags and environments recorded before tenants
// owned them (no tenant field, unqualified keys) load as the admin's,
// shared: every tenant resolves them, none changes them.
func TestOldRecordsAreShared(t *testing.T) {
	e := newEnv(t)
	src := writeTree(t, filepath.Join(e.root, "src"), map[string]string{"f": "x"})
	l := e.build(t, "old", "1", src)
	// Rewrite the records as an older version wrote them.
	old := map[string]any{"name": l.Name, "version": l.Version, "kind": l.Kind, "digest": l.Digest, "size": l.Size, "compression": l.Compression, "created": l.Created}
	raw, _ := json.Marshal(old)
	envRaw, _ := json.Marshal(map[string]any{"name": "oldenv", "base": "old:1", "created": l.Created})
	err := e.db.Update(func(tx *bbolt.Tx) error {
		if err := tx.Bucket(tagsBucket).Put([]byte("old:1"), raw); err != nil {
			return err
		}
		if err := tx.Bucket(blobsBucket).Put([]byte(l.Digest), raw); err != nil {
			return err
		}
		return tx.Bucket(envsBucket).Put([]byte("oldenv"), envRaw)
	})
	if err != nil {
		t.Fatal(err)
	}
	s := e.open(t)
	a := s.As(Owner{Tenant: "a"})
	if got, err := a.Resolve("old:1"); err != nil || got.Tenant != "" {
		t.Fatalf("A resolves an old tag: %+v (%v)", got, err)
	}
	if _, err := a.Resolve(l.Digest); err != nil {
		t.Fatalf("A resolves an old image by digest: %v", err)
	}
	if env, err := a.GetEnv("oldenv"); err != nil || env.Tenant != "" {
		t.Fatalf("A gets an old environment: %+v (%v)", env, err)
	}
	if _, err := a.Remove("old:1", nil); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("A removes an old (shared) tag: %v", err)
	}
	if err := a.DeleteEnv("oldenv"); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("A removes an old (shared) environment: %v", err)
	}
	if _, err := s.Remove("old:1", nil); !errors.Is(err, ErrInUse) { // named by oldenv
		t.Fatalf("the admin removes a tag an old environment names: %v", err)
	}
}
