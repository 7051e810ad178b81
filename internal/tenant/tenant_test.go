package tenant

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

func openDB(t *testing.T) (*bbolt.DB, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "shoal.db")
	db, err := bbolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	return db, path
}

func TestKeyStore(t *testing.T) {
	db, path := openDB(t)
	s, err := Open(db)
	if err != nil {
		t.Fatal(err)
	}
	plain, k, err := s.CreateKey(context.Background(), "ci", "team-a", []Scope{ScopeSandboxes})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(plain, KeyPrefix) || strings.Contains(k.Hash, plain) {
		t.Fatalf("key %q hash %q", plain, k.Hash)
	}
	if _, _, err := s.CreateKey(context.Background(), "ci", "team-b", []Scope{ScopeSandboxes}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("duplicate name: %v", err)
	}
	for _, bad := range []struct{ name, tenant string }{{"", "a"}, {"admin", "a"}, {"Bad", "a"}, {"x", ""}, {"x", "-a"}, {"x", strings.Repeat("a", 64)}} {
		if _, _, err := s.CreateKey(context.Background(), bad.name, bad.tenant, []Scope{ScopeSandboxes}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("CreateKey(%q, %q): %v, want invalid", bad.name, bad.tenant, err)
		}
	}
	if _, _, err := s.CreateKey(context.Background(), "ops", "", []Scope{ScopeAdmin}); err != nil {
		t.Fatalf("admin key without tenant: %v", err)
	}
	if got, ok := s.Resolve(plain); !ok || got.Tenant != "team-a" || got.Name != "ci" {
		t.Fatalf("Resolve: %+v %v", got, ok)
	}
	if _, ok := s.Resolve(plain + "x"); ok {
		t.Fatal("a wrong key resolved")
	}
	// Persisted: a reopened store resolves it; the plaintext is not stored.
	db.Close()
	db, err = bbolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketKeys).ForEach(func(k, v []byte) error {
			if strings.Contains(string(k)+string(v), plain) {
				t.Error("the plaintext key is stored")
			}
			return nil
		})
	})
	s, err = Open(db)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := s.Resolve(plain); !ok {
		t.Fatal("key lost over reopen")
	}
	if len(s.Keys()) != 2 {
		t.Fatalf("keys: %+v", s.Keys())
	}
	if _, err := s.DeleteKey(context.Background(), "ci"); err != nil {
		t.Fatal(err)
	}
	if _, ok := s.Resolve(plain); ok {
		t.Fatal("a removed key still resolves")
	}
	if _, err := s.DeleteKey(context.Background(), "ci"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
}

func TestQuotas(t *testing.T) {
	db, _ := openDB(t)
	defer db.Close()
	s, err := Open(db)
	if err != nil {
		t.Fatal(err)
	}
	q := Quota{MaxSandboxes: 2, MaxMemory: 1 << 30, MaxMilliCPU: 2000, CreatesPerSecond: 5}
	if err := s.SetQuota(context.Background(), "team-a", q); err != nil {
		t.Fatal(err)
	}
	if got := s.Quota("team-a"); got != q {
		t.Fatalf("quota %+v", got)
	}
	if got := s.Tenants(); len(got) != 1 || got["team-a"] != q {
		t.Fatalf("tenants %+v", got)
	}
	for _, bad := range []Quota{{MaxSandboxes: -1}, {CreatesPerSecond: -1}, {Burst: -2}, {CreatesPerSecond: 1e9}} {
		if err := s.SetQuota(context.Background(), "team-a", bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("SetQuota(%+v): %v", bad, err)
		}
	}
	if err := s.SetQuota(context.Background(), "team-a", Quota{}); err != nil {
		t.Fatal(err)
	}
	if got := s.Tenants(); len(got) != 0 {
		t.Fatalf("tenants after clearing %+v", got)
	}
}

func TestScopes(t *testing.T) {
	if _, err := ParseScopes("sandboxes,layers:read"); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"", "root", "sandboxes,layers"} {
		if _, err := ParseScopes(bad); err == nil {
			t.Errorf("ParseScopes(%q) accepted", bad)
		}
	}
	p := &Principal{Key: "ci", Tenant: "a", Scopes: []Scope{ScopeSandboxes}}
	if err := p.Require("CreateSandbox", ScopeSandboxes); err != nil {
		t.Fatal(err)
	}
	err := p.Require("BuildLayer", ScopeLayersWrite)
	if !errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), `"layers:write"`) {
		t.Fatalf("Require: %v", err)
	}
	if !p.Sees("a") || p.Sees("b") || p.Sees("") {
		t.Fatal("Sees: a tenant's key sees another tenant's objects")
	}
	if !Admin().Sees("b") || !Admin().Has(ScopeLayersWrite) {
		t.Fatal("admin is not admin")
	}
	var none *Principal
	if none.Has(ScopeSandboxes) || none.Sees("") || none.Require("x", ScopeSandboxes) == nil {
		t.Fatal("a nil principal may do something")
	}
	ctx := WithPrincipal(context.Background(), p)
	if FromContext(ctx) != p || FromContext(context.Background()) != nil {
		t.Fatal("context")
	}
}

func TestBucket(t *testing.T) {
	now := time.Unix(1000, 0)
	b := NewBucket(2, 3, now)
	for i := 0; i < 3; i++ {
		if !b.Take(now) {
			t.Fatalf("burst: take %d refused", i)
		}
	}
	if b.Take(now) {
		t.Fatal("took more than the burst")
	}
	if b.Take(now.Add(400 * time.Millisecond)) { // 0.8 tokens
		t.Fatal("took a token not yet refilled")
	}
	if !b.Take(now.Add(500 * time.Millisecond)) {
		t.Fatal("refill at 2/s: no token after 0.5 s")
	}
	b.Put()
	if !b.Take(now.Add(500 * time.Millisecond)) {
		t.Fatal("Put gave no token back")
	}
	// Long idle: at most the burst.
	later := now.Add(time.Hour)
	n := 0
	for b.Take(later) {
		n++
	}
	if n != 3 {
		t.Fatalf("after an hour: %d tokens, want the burst 3", n)
	}
	if d := NewBucket(0.5, 0, now); d.burst != 1 || !d.Same(0.5, 0) || d.Same(1, 0) {
		t.Fatalf("default burst %v", d.burst)
	}
}
