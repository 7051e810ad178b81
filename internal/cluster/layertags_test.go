package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"go.etcd.io/bbolt"

	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
)

// openStore opens a node's layer store in a temporary directory.
func openStore(t *testing.T) *layer.Store {
	t.Helper()
	dir := t.TempDir()
	db, err := bbolt.Open(filepath.Join(dir, "shoal.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := layer.Open(filepath.Join(dir, "layers"), db, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func digestOf(i int) string { return fmt.Sprintf("sha256:%064x", i) }

func baseLayer(ref string, i int) layer.Layer {
	name, version, _ := strings.Cut(ref, ":")
	return layer.Layer{Name: name, Version: version, Kind: layer.KindBase, Digest: digestOf(i), Size: 4096}
}

// resolvesTo says whether s resolves ref to digest.
func resolvesTo(s *layer.Store, ref, digest string) bool {
	l, err := s.Resolve(ref)
	return err == nil && l.Digest == digest
}

// TestLayerTags moves layer tags in etcd through one client and through
// nodes' layer stores, and checks that every node's store follows: a move
// is one transaction that says what the tag pointed at, a store's own
// Tag and Remove go to etcd first (and it reads its own write at once),
// garbage collection on a node keeps an image a cluster tag names and
// collects it once the tag is gone, and a node that was down catches up.
func TestLayerTags(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	a := client(t, ep)
	n1, n2 := openStore(t), openStore(t)
	for _, s := range []*layer.Store{n1, n2} {
		m, err := MirrorLayers(ctx, client(t, ep), s, log)
		if err != nil {
			t.Fatal(err)
		}
		s.SetClusterTags(m)
	}

	t1, old, err := PutLayerTag(ctx, a, baseLayer("base:1", 1))
	if err != nil || old != "" || t1.Revision == 0 {
		t.Fatalf("a new tag: %+v, was %q, %v", t1, old, err)
	}
	eventually(t, "both nodes resolve base:1", func() bool {
		return resolvesTo(n1, "base:1", digestOf(1)) && resolvesTo(n2, "base:1", digestOf(1))
	})
	// The same content again: nothing moves.
	if same, old, err := PutLayerTag(ctx, a, baseLayer("base:1", 1)); err != nil || same.Revision != t1.Revision || old != digestOf(1) {
		t.Fatalf("the same layer tagged again: %+v, was %q, %v; want revision %d unchanged", same, old, err, t1.Revision)
	}
	if _, _, err := PutLayerTag(ctx, a, layer.Layer{Name: "Bad", Version: "1", Kind: layer.KindBase, Digest: digestOf(1), Size: 1}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("a bad name: %v; want invalid argument", err)
	}

	// A tag made through a node's store: etcd's first, read back at once
	// there, mirrored by the other node.
	l, old, err := n1.Tag("base:1", "py:3")
	if err != nil || l.Digest != digestOf(1) || old != "" {
		t.Fatalf("tag through node 1: %+v, was %q, %v", l, old, err)
	}
	if !resolvesTo(n1, "py:3", digestOf(1)) {
		t.Fatal("node 1 does not read its own tag at once")
	}
	if got, err := GetLayerTag(ctx, a, "py:3"); err != nil || got.Digest != digestOf(1) {
		t.Fatalf("the node's tag in etcd: %+v %v", got, err)
	}
	eventually(t, "node 2 resolves py:3", func() bool { return resolvesTo(n2, "py:3", digestOf(1)) })

	// A move: one transaction, which says where the tag was.
	moved, old, err := PutLayerTag(ctx, a, baseLayer("base:1", 2))
	if err != nil || old != digestOf(1) || moved.Revision <= t1.Revision {
		t.Fatalf("move base:1: %+v, was %q, %v", moved, old, err)
	}
	eventually(t, "both nodes follow the move", func() bool {
		return resolvesTo(n1, "base:1", digestOf(2)) && resolvesTo(n2, "base:1", digestOf(2))
	})

	// GC on node 2: the image py:3 names (a cluster tag, never recorded
	// on node 2) stays; an image nothing names goes.
	for _, i := range []int{1, 3} {
		if err := os.WriteFile(n2.ImagePath(digestOf(i)), []byte("image"), 0o444); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := n2.GC(nil, false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(n2.ImagePath(digestOf(1))); err != nil {
		t.Fatalf("GC removed the image a cluster tag names: %v", err)
	}
	if _, err := os.Stat(n2.ImagePath(digestOf(3))); err == nil {
		t.Fatal("GC kept an image nothing names")
	}
	// The tag removed through node 1: out of etcd, out of node 2's copy;
	// then node 2's GC collects the image.
	if _, err := n1.Remove("py:3", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := GetLayerTag(ctx, a, "py:3"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a removed tag in etcd: %v; want not found", err)
	}
	if _, err := n1.Remove("py:3", nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("remove a tag twice: %v; want not found", err)
	}
	eventually(t, "node 2 drops py:3", func() bool { _, err := n2.Resolve("py:3"); return errors.Is(err, errdefs.ErrNotFound) })
	if _, err := n2.GC(nil, false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(n2.ImagePath(digestOf(1))); err == nil {
		t.Fatal("GC kept an image whose cluster tag was removed")
	}

	// Concurrent moves of one tag: each one sees the one before it
	// (no two moves say they replaced the same layer).
	const movers = 8
	olds := make([]string, movers)
	var wg sync.WaitGroup
	for i := range movers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, o, err := PutLayerTag(ctx, client(t, ep), baseLayer("race:1", 100+i))
			if err != nil {
				t.Error(err)
			}
			olds[i] = o
		}()
	}
	wg.Wait()
	seen := map[string]bool{}
	for _, o := range olds {
		if seen[o] {
			t.Fatalf("two moves of race:1 replaced %q: %q", o, olds)
		}
		seen[o] = true
	}

	// A node down meanwhile: its copy has gone:1 (removed since), base:1
	// at its first layer, and mine:1, made on it before it joined.
	n3 := openStore(t)
	for _, l := range []layer.Layer{
		func() layer.Layer { l := baseLayer("gone:1", 5); l.Mirrored = t1.Revision; return l }(),
		func() layer.Layer { l := baseLayer("base:1", 1); l.Mirrored = t1.Revision; return l }(),
		baseLayer("mine:1", 6),
	} {
		if err := n3.MirrorTag(l); err != nil {
			t.Fatal(err)
		}
	}
	m3, err := MirrorLayers(ctx, client(t, ep), n3, log)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n3.Resolve("gone:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a node back up keeps a tag removed while it was down: %v", err)
	}
	if !resolvesTo(n3, "base:1", digestOf(2)) || m3.TagRevision("base:1") != moved.Revision {
		t.Fatalf("a node back up: base:1 at revision %d; want the move at %d", m3.TagRevision("base:1"), moved.Revision)
	}
	if got, err := GetLayerTag(ctx, a, "mine:1"); err != nil || got.Digest != digestOf(6) {
		t.Fatalf("a tag made on a node before it joined: %+v %v; want it in etcd", got, err)
	}
	eventually(t, "node 1 resolves mine:1", func() bool { return resolvesTo(n1, "mine:1", digestOf(6)) })

	// A node whose copy lags (its watch stopped here): a tag it does not
	// have yet is read from etcd, not refused.
	n4 := openStore(t)
	mctx, stop := context.WithCancel(ctx)
	m4, err := MirrorLayers(mctx, client(t, ep), n4, log)
	if err != nil {
		t.Fatal(err)
	}
	n4.SetClusterTags(m4)
	stop()
	if _, _, err := PutLayerTag(ctx, a, baseLayer("fresh:1", 7)); err != nil {
		t.Fatal(err)
	}
	if !resolvesTo(n4, "fresh:1", digestOf(7)) {
		t.Fatal("a node whose copy lags does not resolve a tag made a moment ago")
	}
}

// TestTenantLayerTagsAndEnvs: in a cluster a tenant's tags and
// environments carry their tenant in etcd (their own keys), so that every
// node resolves them for that tenant only: tenant b, through another
// node, neither resolves a's tag nor moves it (its own tag of the same
// name is another key), and a's environment is not b's.
func TestTenantLayerTagsAndEnvs(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	cli := client(t, ep)
	n1, n2 := openStore(t), openStore(t)
	for _, s := range []*layer.Store{n1, n2} {
		m, err := MirrorLayers(ctx, client(t, ep), s, log)
		if err != nil {
			t.Fatal(err)
		}
		s.SetClusterTags(m)
	}
	if _, _, err := PutLayerTag(ctx, cli, baseLayer("base:1", 1)); err != nil { // shared
		t.Fatal(err)
	}
	a1, b2 := n1.As(layer.Owner{Tenant: "a"}), n2.As(layer.Owner{Tenant: "b"})
	eventually(t, "node 1 resolves base:1", func() bool { return resolvesTo(n1, "base:1", digestOf(1)) })
	l, _, err := a1.Tag("base:1", "app:1")
	if err != nil || l.Tenant != "a" {
		t.Fatalf("a's tag through node 1: %+v %v", l, err)
	}
	if got, err := GetLayerTag(ctx, cli, "a/app:1"); err != nil || got.Tenant != "a" {
		t.Fatalf("a's tag in etcd: %+v %v", got, err)
	}
	if _, err := GetLayerTag(ctx, cli, "app:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a's tag is shared in etcd: %v", err)
	}
	eventually(t, "node 2 mirrors a/app:1", func() bool { return resolvesTo(n2, "a/app:1", digestOf(1)) })
	if l, err := b2.Resolve("app:1"); !errors.Is(err, errdefs.ErrNotFound) {
		all, _ := n2.List()
		t.Fatalf("b resolves a's app:1 on node 2: %+v %v; node 2 has %+v", l, err, all)
	}
	if _, err := b2.Resolve("a/app:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("b resolves a/app:1 on node 2: %v", err)
	}
	if _, _, err := b2.Tag("base:1", "a/app:1"); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("b moves a's tag: %v", err)
	}
	if _, err := b2.Remove("a/app:1", nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("b removes a's tag: %v", err)
	}
	if _, _, err := b2.Tag("base:1", "app:1"); err != nil { // b's own
		t.Fatal(err)
	}
	if _, err := b2.Remove("app:1", nil); err != nil {
		t.Fatal(err)
	}
	if got, err := GetLayerTag(ctx, cli, "a/app:1"); err != nil || got.Tenant != "a" {
		t.Fatalf("a's tag after b's tag and removal of its own: %+v %v", got, err)
	}

	// Environments: a's, written to etcd under its own key, mirrored.
	if _, err := PutEnv(ctx, cli, layer.Env{Name: "prod", Base: "app:1", Tenant: "a"}, false, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := PutEnv(ctx, cli, layer.Env{Name: "prod", Base: "base:1"}, false, 0); err != nil { // a shared one of the same name
		t.Fatal(err)
	}
	eventually(t, "node 2 mirrors both", func() bool {
		e, err := n2.GetEnv("a/prod")
		s, err2 := n2.GetEnv("prod")
		return err == nil && err2 == nil && e.Base == "app:1" && s.Base == "base:1"
	})
	if e, err := b2.GetEnv("prod"); err != nil || e.Tenant != "" {
		t.Fatalf("b's prod on node 2: %+v %v; want the shared one", e, err)
	}
	if e, err := n2.As(layer.Owner{Tenant: "a"}).GetEnv("prod"); err != nil || e.Tenant != "a" {
		t.Fatalf("a's prod on node 2: %+v %v", e, err)
	}
	if _, err := DeleteEnv(ctx, cli, "a/prod"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "node 2 drops a/prod", func() bool {
		_, err := n2.GetEnv("a/prod")
		return errors.Is(err, errdefs.ErrNotFound)
	})
	if _, err := n2.GetEnv("prod"); err != nil {
		t.Fatalf("the shared prod after a's removal: %v", err)
	}
}
