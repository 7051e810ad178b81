package cluster_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// checkTenants checks tenants' keys and quotas across the cluster: a key
// and a quota made through replica A (with the CLI) work through replica B
// and at each node (which authenticate the key from the same etcd store);
// the tenant's sandboxes on both nodes count together against its quota,
// refused with the code a single node gives (resource_exhausted; E2B's
// 429); another tenant sees and touches none of them (not found, as on
// one node), through Shoal's API and E2B's; the replica's audit log has
// the key's creation and the refusals; a key removed through A stops
// working at B and at the nodes within a bound.
func checkTenants(t *testing.T, ctx context.Context, bin string, controls, nodes []*proc, adminKey string, tags map[string]string) {
	t0 := time.Now()
	cli := func(c *proc, args ...string) string {
		t.Helper()
		cmd := exec.Command(filepath.Join(bin, "shoal"), args...)
		cmd.Env = append(os.Environ(), "SHOAL_URL=http://"+c.addr, "SHOAL_API_KEY="+adminKey)
		out, err := cmd.Output()
		if err != nil {
			var stderr []byte
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = ee.Stderr
			}
			t.Fatalf("shoal %v through %s: %v\n%s%s", args, c.name, err, out, stderr)
		}
		return strings.TrimSpace(string(out))
	}
	// Through replica A, with the CLI: two tenants' keys, a read-only key,
	// and team-a's quota.
	secretA := cli(controls[0], "key", "create", "--name", "ten-a", "--tenant", "team-a", "--scope", "sandboxes,layers:read")
	secretB := cli(controls[0], "key", "create", "--name", "ten-b", "--tenant", "team-b", "--scope", "sandboxes,layers:read")
	secretR := cli(controls[0], "key", "create", "--name", "ten-a-ro", "--tenant", "team-a", "--scope", "layers:read")
	cli(controls[0], "tenant", "set", "team-a", "--max-sandboxes", "3")
	defer func() {
		admin := client(t, controls[0].addr, adminKey)
		for _, k := range []string{"ten-a", "ten-b", "ten-a-ro"} {
			admin.DeleteKey(context.Background(), k)
		}
		admin.SetQuota(context.Background(), "team-a", &pb.Quota{})
	}()
	if ls := cli(controls[1], "key", "ls"); !strings.Contains(ls, "ten-a") || !strings.Contains(ls, "team-b") || strings.Contains(ls, secretA) {
		t.Fatalf("key ls through replica B:\n%s", ls)
	}
	a := client(t, controls[1].addr, secretA) // team-a, through replica B
	b := client(t, controls[1].addr, secretB) // team-b, through replica B
	// At once: a key unknown to a process's copy makes it catch up with
	// etcd before it refuses (cluster.Tenancy.ResolveFresh).
	if k, err := a.WhoAmI(ctx); err != nil || k.Tenant != "team-a" || k.Name != "ten-a" {
		t.Fatalf("whoami with team-a's key through replica B, just made through A: %v %v", k, err)
	}
	// Create, exec and ls through replica B with the tenant's key.
	sb, err := a.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 64 << 20, TimeoutSeconds: 600})
	if err != nil {
		t.Fatalf("create with team-a's key through replica B: %v", err)
	}
	mine := []string{sb.Id}
	if sb.Tenant != "team-a" {
		t.Fatalf("sandbox made with team-a's key belongs to %q", sb.Tenant)
	}
	var out bytes.Buffer
	if st, err := a.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"echo", "tenant"}, Stdout: &out}); err != nil || st.Code != 0 || out.String() != "tenant\n" {
		t.Fatalf("exec with team-a's key: %q %+v %v", out.String(), st, err)
	}
	// The nodes take the key themselves (the same store): one sandbox
	// straight on each node, so that team-a has sandboxes on both.
	for _, n := range nodes {
		sb, err := client(t, n.addr, secretA).Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 64 << 20, TimeoutSeconds: 600})
		if err != nil {
			t.Fatalf("create with team-a's key on node %s: %v", n.name, err)
		}
		mine = append(mine, sb.Id)
	}
	sbs, err := a.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, s := range sbs {
		listed = append(listed, s.Id)
	}
	slices.Sort(listed)
	want := slices.Clone(mine)
	slices.Sort(want)
	if !slices.Equal(listed, want) {
		t.Fatalf("team-a's list through replica B: %v, want its own %v only", listed, want)
	}
	// The quota holds across the cluster: 3 of 3, one on each node at
	// least, so each node alone would admit a fourth. Through either
	// replica, both faces: refused, as one node refuses.
	adminA := client(t, controls[0].addr, adminKey)
	waitFor(t, "replica A counts team-a's 3 sandboxes (the catalog)", func() error {
		res, err := adminA.Admin.ListTenants(ctx, connect.NewRequest(&pb.ListTenantsRequest{}))
		if err != nil {
			return err
		}
		for _, tn := range res.Msg.Tenants {
			if tn.Name == "team-a" && tn.Sandboxes == 3 && tn.Keys == 2 && tn.GetQuota().GetMaxSandboxes() == 3 {
				return nil
			}
		}
		return fmt.Errorf("tenants: %v", res.Msg.Tenants)
	})
	for _, c := range controls {
		_, err := client(t, c.addr, secretA).Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 64 << 20})
		if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "max-sandboxes") {
			t.Fatalf("a fourth create through %s with 3 of 3 across the nodes: %v, want resource_exhausted (max-sandboxes)", c.name, err)
		}
	}
	ea := newE2BClient(t, controls[0].e2b, secretA)
	if st, _, body := ea.do(ctx, "POST", "/sandboxes", map[string]any{"templateID": baseRef, "timeout": 600}, nil); st != http.StatusTooManyRequests {
		t.Fatalf("E2B create through a replica with 3 of 3: %d %s, want 429", st, body)
	}
	// Room for one more: E2B's create through the replica, with the key.
	cli(controls[1], "tenant", "set", "team-a", "--max-sandboxes", "4")
	var esb e2bSandbox
	waitFor(t, "team-a's raised quota at replica A", func() error {
		st, _, body := ea.do(ctx, "POST", "/sandboxes", map[string]any{"templateID": baseRef, "timeout": 600}, nil)
		if st != http.StatusCreated {
			return fmt.Errorf("E2B create: %d %s", st, body)
		}
		return json.Unmarshal(body, &esb)
	})
	mine = append(mine, esb.SandboxID)
	if _, ok := tags[cluster.TagOf(esb.SandboxID)]; !ok {
		t.Fatalf("E2B sandbox %s names no node", esb.SandboxID)
	}
	// Another tenant sees and touches none of them (not found, as on one
	// node), on both faces of both replicas.
	if sbs, err := b.List(ctx); err != nil || len(sbs) != 0 {
		t.Fatalf("team-b's list: %v %v, want none", sbs, err)
	}
	for _, id := range mine {
		if _, err := b.Get(ctx, id); connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("team-b gets team-a's %s: %v, want not found", id, err)
		}
		if _, err := b.Exec(ctx, id, shoal.ExecOptions{Args: []string{"true"}}); connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("team-b execs in team-a's %s: %v, want not found", id, err)
		}
		if err := b.Delete(ctx, id); connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("team-b deletes team-a's %s: %v, want not found", id, err)
		}
	}
	for _, c := range controls {
		eb := newE2BClient(t, c.e2b, secretB)
		st, _, body := eb.do(ctx, "GET", "/v2/sandboxes", nil, nil)
		if st != http.StatusOK || strings.TrimSpace(string(body)) != "[]" {
			t.Fatalf("team-b's E2B list through %s: %d %s, want []", c.name, st, body)
		}
		if st, _, body := eb.do(ctx, "GET", "/sandboxes/"+esb.SandboxID, nil, nil); st != http.StatusNotFound {
			t.Fatalf("team-b's E2B get of team-a's sandbox through %s: %d %s, want 404", c.name, st, body)
		}
		if st, _, body := eb.do(ctx, "DELETE", "/sandboxes/"+esb.SandboxID, nil, nil); st != http.StatusNotFound {
			t.Fatalf("team-b's E2B kill of team-a's sandbox through %s: %d %s, want 404", c.name, st, body)
		}
	}
	st, _, body := newE2BClient(t, controls[1].e2b, secretA).do(ctx, "GET", "/v2/sandboxes", nil, nil)
	if st != http.StatusOK || strings.Count(string(body), `"sandboxID"`) != 4 {
		t.Fatalf("team-a's E2B list through replica B: %d %s, want its 4", st, body)
	}
	// Layers and environments are the tenants' own across the cluster
	// (etcd's records carry the tenant): team-b's tag and environment,
	// made through replica A, are team-b's on every node and through
	// either replica; team-a's key neither sees nor changes them.
	secretBW := cli(controls[0], "key", "create", "--name", "ten-b-w", "--tenant", "team-b", "--scope", "sandboxes,layers:read,layers:write")
	secretAW := cli(controls[0], "key", "create", "--name", "ten-a-w", "--tenant", "team-a", "--scope", "layers:read,layers:write")
	defer func() {
		admin := client(t, controls[0].addr, adminKey)
		for _, e := range []string{"team-b/benv", "team-a/benv"} {
			admin.Layers.DeleteEnvironment(context.Background(), connect.NewRequest(&pb.DeleteEnvironmentRequest{Name: e}))
		}
		admin.Layers.DeleteLayer(context.Background(), connect.NewRequest(&pb.DeleteLayerRequest{Ref: "team-b/bown:1"}))
		for _, k := range []string{"ten-b-w", "ten-a-w"} {
			admin.DeleteKey(context.Background(), k)
		}
	}()
	bw, aw := client(t, controls[0].addr, secretBW), client(t, controls[1].addr, secretAW)
	if res, err := bw.Layers.TagLayer(ctx, connect.NewRequest(&pb.TagLayerRequest{Source: baseRef, Target: "bown:1"})); err != nil || res.Msg.Layer.GetTenant() != "team-b" {
		t.Fatalf("team-b's tag through replica A: %v %v", res, err)
	}
	if _, err := bw.Layers.CreateEnvironment(ctx, connect.NewRequest(&pb.CreateEnvironmentRequest{Name: "benv", Base: "bown:1"})); err != nil {
		t.Fatalf("team-b's environment through replica A: %v", err)
	}
	for _, n := range nodes {
		waitFor(t, "node "+n.name+" has team-b's tag for team-b", func() error {
			l, err := client(t, n.addr, secretBW).Layers.GetLayer(ctx, connect.NewRequest(&pb.GetLayerRequest{Ref: "bown:1"}))
			if err != nil || l.Msg.Tenant != "team-b" {
				return fmt.Errorf("%v %v", l, err)
			}
			return nil
		})
		if _, err := client(t, n.addr, secretAW).Layers.GetLayer(ctx, connect.NewRequest(&pb.GetLayerRequest{Ref: "bown:1"})); connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("team-a inspects team-b's tag on node %s: %v, want not found", n.name, err)
		}
	}
	ls, err := aw.Layers.ListLayers(ctx, connect.NewRequest(&pb.ListLayersRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls.Msg.Layers {
		if l.Tenant == "team-b" {
			t.Fatalf("team-a lists team-b's %s through replica B", l.Ref)
		}
	}
	envs, err := aw.Layers.ListEnvironments(ctx, connect.NewRequest(&pb.ListEnvironmentsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range envs.Msg.Environments {
		if e.Tenant == "team-b" {
			t.Fatalf("team-a lists team-b's environment %s through replica B", e.Name)
		}
	}
	for _, name := range []string{"benv", "team-b/benv"} {
		if _, err := aw.Layers.GetEnvironment(ctx, connect.NewRequest(&pb.GetEnvironmentRequest{Name: name})); connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("team-a gets %s through replica B: %v, want not found", name, err)
		}
		if _, err := aw.Layers.DeleteEnvironment(ctx, connect.NewRequest(&pb.DeleteEnvironmentRequest{Name: name})); connect.CodeOf(err) != connect.CodeNotFound {
			t.Fatalf("team-a removes %s through replica B: %v, want not found", name, err)
		}
	}
	if _, err := aw.Layers.TagLayer(ctx, connect.NewRequest(&pb.TagLayerRequest{Source: baseRef, Target: "team-b/bown:1"})); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("team-a moves team-b's tag through replica B: %v, want permission denied", err)
	}
	if _, err := aw.Layers.DeleteLayer(ctx, connect.NewRequest(&pb.DeleteLayerRequest{Ref: "team-b/bown:1"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("team-a removes team-b's tag through replica B: %v, want not found", err)
	}
	if _, err := aw.Layers.CreateEnvironment(ctx, connect.NewRequest(&pb.CreateEnvironmentRequest{Name: "benv", Base: baseRef, Replace: true})); err != nil {
		t.Fatalf("team-a's own benv: %v", err)
	}
	if e, err := bw.Layers.GetEnvironment(ctx, connect.NewRequest(&pb.GetEnvironmentRequest{Name: "benv"})); err != nil || e.Msg.Base != "bown:1" || e.Msg.Tenant != "team-b" {
		t.Fatalf("team-b's benv after team-a's: %v %v", e, err)
	}
	// A key without the sandboxes scope is refused at the replica.
	if _, err := client(t, controls[1].addr, secretR).Create(ctx, &pb.CreateSandboxRequest{Base: baseRef}); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("create with a layers:read key: %v, want permission_denied", err)
	}
	// The audit log through either replica: each replica's own (the
	// refusals it made, the keys made through it) merged with every
	// node's (the creates).
	audited := func(c *proc) map[string]int {
		t.Helper()
		res, err := client(t, c.addr, adminKey).Admin.ReadAudit(ctx, connect.NewRequest(&pb.ReadAuditRequest{Tail: 1000, Tenant: "team-a"}))
		if err != nil {
			t.Fatal(err)
		}
		count := map[string]int{}
		for _, e := range res.Msg.Entries {
			count[e.Action+" "+e.Result]++
		}
		return count
	}
	for _, c := range controls {
		if count := audited(c); count["sandbox.create resource_exhausted"] != 2 || count["e2b.sandbox.create resource_exhausted"] != 1 ||
			count["sandbox.create permission_denied"] != 1 || count["sandbox.create ok"] != 3 || count["e2b.sandbox.create ok"] != 1 ||
			count["command.start ok"] != 1 {
			t.Fatalf("team-a's audit through %s: %v", c.name, count)
		}
	}
	res, err := adminA.Admin.ReadAudit(ctx, connect.NewRequest(&pb.ReadAuditRequest{Tail: 1000}))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(res.Msg.Entries, func(e *pb.AuditEntry) bool {
		return e.Action == "key.create" && e.Object == "ten-a" && e.Result == "ok"
	}) {
		t.Fatalf("no key.create of ten-a in the audit through replica A: %v", res.Msg.Entries)
	}
	// The key removed through A: refused at B, and at the nodes, within a
	// bound (their watches).
	cli(controls[0], "key", "rm", "ten-a")
	removed := time.Now()
	waitFor(t, "team-a's key refused at replica B and the nodes", func() error {
		for _, addr := range []string{controls[1].addr, nodes[0].addr, nodes[1].addr} {
			if _, err := client(t, addr, secretA).WhoAmI(ctx); connect.CodeOf(err) != connect.CodeUnauthenticated {
				return fmt.Errorf("%s: %v", addr, err)
			}
		}
		return nil
	})
	if st, _, _ := newE2BClient(t, controls[1].e2b, secretA).do(ctx, "GET", "/v2/sandboxes", nil, nil); st != http.StatusUnauthorized {
		t.Fatalf("E2B list with a removed key: %d, want 401", st)
	}
	t.Logf("a removed key was refused at the other replica and both nodes %v after the removal", time.Since(removed).Round(time.Millisecond))
	for _, id := range mine {
		if err := adminA.Delete(ctx, id); err != nil {
			t.Fatalf("delete %s: %v", id, err)
		}
	}
	t.Logf("tenants checked in %.1fs", time.Since(t0).Seconds())
}
