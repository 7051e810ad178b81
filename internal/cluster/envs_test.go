package cluster

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"slices"
	"sync"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/cluster/etcdtest"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/layer"
)

// memSink is a node's environment store in memory.
type memSink struct {
	mu   sync.Mutex
	envs map[string]layer.Env
}

func (s *memSink) MirrorEnv(e layer.Env) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.envs[e.Name] = e
	return nil
}

func (s *memSink) UnmirrorEnv(name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.envs, name)
	return nil
}

func (s *memSink) Envs() ([]layer.Env, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []layer.Env
	for _, e := range s.envs {
		out = append(out, e)
	}
	return out, nil
}

func (s *memSink) get(name string) (layer.Env, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.envs[name]
	return e, ok
}

// TestEnvs writes environments through one client and reads them through
// another: a create of a name taken is refused, a replace conditional on a
// revision someone moved past is refused, and two nodes' mirrors follow
// every write; a node that was down (its mirror started late, over a
// stale copy) catches up, dropping what was removed meanwhile.
func TestEnvs(t *testing.T) {
	ep := etcdtest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	a, b := client(t, ep), client(t, ep)

	n1 := &memSink{envs: map[string]layer.Env{}}
	if _, err := MirrorLayers(ctx, client(t, ep), n1, log); err != nil {
		t.Fatal(err)
	}

	e1, err := PutEnv(ctx, a, layer.Env{Name: "task", Base: "debian:12", Toolkits: []string{"pytest:7"}}, false, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := PutEnv(ctx, b, layer.Env{Name: "task", Base: "alpine:3"}, false, 0); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("a second create of the same name: %v; want already exists", err)
	}
	got, err := GetEnv(ctx, b, "task")
	if err != nil || got.Base != "debian:12" || got.Revision != e1.Revision || !slices.Equal(got.Toolkits, []string{"pytest:7"}) {
		t.Fatalf("read through the other client: %+v %v; want %+v", got, err, e1)
	}
	// Two writers replace from the same revision: the second is refused.
	e2, err := PutEnv(ctx, a, layer.Env{Name: "task", Base: "debian:13"}, true, e1.Revision)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := PutEnv(ctx, b, layer.Env{Name: "task", Base: "alpine:3"}, true, e1.Revision); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("a replace from a stale revision: %v; want failed precondition", err)
	}
	if _, err := PutEnv(ctx, b, layer.Env{Name: "Bad/Name", Base: "x:1"}, false, 0); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("a bad name: %v; want invalid argument", err)
	}
	eventually(t, "node 1 mirrors the replace", func() bool { e, ok := n1.get("task"); return ok && e.Base == "debian:13" })

	// A node down meanwhile: its copy has "old" (removed since), the
	// first "task", and "local", made on it before it was in a cluster.
	if _, err := PutEnv(ctx, a, layer.Env{Name: "old", Base: "x:1"}, false, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := DeleteEnv(ctx, b, "old"); err != nil {
		t.Fatal(err)
	}
	if _, err := DeleteEnv(ctx, b, "old"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("remove an environment twice: %v; want not found", err)
	}
	n2 := &memSink{envs: map[string]layer.Env{
		"old":   {Name: "old", Base: "x:1", Mirrored: e1.Revision},
		"task":  {Name: "task", Base: "debian:12", Mirrored: e1.Revision},
		"local": {Name: "local", Base: "mine:1"},
	}}
	m2, err := MirrorLayers(ctx, client(t, ep), n2, log)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := n2.get("old"); ok {
		t.Fatal("a node back up keeps an environment removed while it was down")
	}
	if e, err := GetEnv(ctx, b, "local"); err != nil || e.Base != "mine:1" {
		t.Fatalf("an environment made on a node before it joined: %+v %v; want it in etcd", e, err)
	}
	if e, _ := n2.get("local"); e.Mirrored == 0 {
		t.Fatalf("the node's copy of its own environment, now etcd's: %+v; want it mirrored", e)
	}
	if _, err := DeleteEnv(ctx, a, "local"); err != nil {
		t.Fatal(err)
	}
	if e, _ := n2.get("task"); e.Base != "debian:13" || m2.Revision("task") != e2.Revision {
		t.Fatalf("a node back up has %+v at revision %d; want the replace at %d", e, m2.Revision("task"), e2.Revision)
	}
	eventually(t, "node 1 mirrors the removal", func() bool { _, ok := n1.get("old"); return !ok })

	// A write applied at once, then its (older) watch event: not undone.
	e3, err := PutEnv(ctx, a, layer.Env{Name: "task", Base: "debian:14"}, true, 0)
	if err != nil {
		t.Fatal(err)
	}
	m2.Apply(e3)
	m2.Apply(e2)
	if e, _ := n2.get("task"); e.Base != "debian:14" {
		t.Fatalf("an older write applied after a newer one: %+v", e)
	}
	envs, _, err := ListEnvs(ctx, b)
	if err != nil || len(envs) != 1 || envs[0].Name != "task" {
		t.Fatalf("list: %+v %v; want task alone", envs, err)
	}
}
