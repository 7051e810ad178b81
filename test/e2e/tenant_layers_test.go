package e2e

// Tenants own their layers and environments: tenant A's key, through the
// API, neither lists, creates from, exports, replaces, moves nor removes
// tenant B's; both read the admin's (shared) layers and change none of
// them.

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// secretTar is a tar holding /secret.
func secretTar(t *testing.T, body string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: "secret", Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	tw.Write([]byte(body))
	tw.Close()
	return buf.Bytes()
}

func TestTenantLayers(t *testing.T) {
	need(t)
	all := []string{"sandboxes", "layers:read", "layers:write"}
	ca, _ := tenantClient(t, "lay-a", "lay-a", all...)
	cb, _ := tenantClient(t, "lay-b", "lay-b", all...)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	notFoundOrDenied := func(what string, err error) {
		t.Helper()
		if !isCode(err, "not_found") && !isCode(err, "permission_denied") {
			t.Fatalf("%s: %v; want not_found or permission_denied", what, err)
		}
	}

	// B's layer (its file) and environment.
	tb := secretTar(t, "B's secret\n")
	lb, err := cb.BuildLayerUpload(ctx, &pb.BuildLayerRequest{Kind: pb.LayerKind_LAYER_KIND_WORKSPACE, Ref: "secret:1"}, bytes.NewReader(tb), int64(len(tb)), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sdk(t).Layers.DeleteLayer(context.Background(), connect.NewRequest(&pb.DeleteLayerRequest{Ref: "lay-b/secret:1"}))
	if lb.Tenant != "lay-b" {
		t.Fatalf("B's layer: tenant %q", lb.Tenant)
	}
	if _, err := cb.Layers.CreateEnvironment(ctx, connect.NewRequest(&pb.CreateEnvironmentRequest{Name: "prod", Base: baseRef, Workspaces: []string{"secret:1"}})); err != nil {
		t.Fatal(err)
	}
	defer sdk(t).Layers.DeleteEnvironment(context.Background(), connect.NewRequest(&pb.DeleteEnvironmentRequest{Name: "lay-b/prod"}))

	// A lists neither.
	ls, err := ca.Layers.ListLayers(ctx, connect.NewRequest(&pb.ListLayersRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls.Msg.Layers {
		if l.Tenant != "" && l.Tenant != "lay-a" {
			t.Fatalf("A lists %s of tenant %q", l.Ref, l.Tenant)
		}
	}
	if !strings.Contains(ls.Msg.String(), `"busybox"`) {
		t.Fatalf("A does not list the shared %s: %v", baseRef, ls.Msg)
	}
	all2, err := ca.Layers.ListLayers(ctx, connect.NewRequest(&pb.ListLayersRequest{All: true}))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range all2.Msg.Layers {
		if l.Digest == lb.Digest {
			t.Fatalf("A lists the image of B's layer: %v", l)
		}
	}
	envs, err := ca.Layers.ListEnvironments(ctx, connect.NewRequest(&pb.ListEnvironmentsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range envs.Msg.Environments {
		if e.Tenant == "lay-b" || e.Name == "prod" {
			t.Fatalf("A lists B's environment %v", e)
		}
	}
	// A inspects, creates from, exports neither.
	for _, ref := range []string{"secret:1", "lay-b/secret:1", "secret@" + lb.Digest, lb.Digest} {
		_, err := ca.Layers.GetLayer(ctx, connect.NewRequest(&pb.GetLayerRequest{Ref: ref}))
		notFoundOrDenied("A inspects "+ref, err)
		_, err = ca.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, Workspaces: []string{ref}})
		notFoundOrDenied("A creates from "+ref, err)
		_, err = ca.ExportLayer(ctx, ref, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "not found") && !strings.Contains(err.Error(), "not_found") {
			t.Fatalf("A exports %s: %v; want not found", ref, err)
		}
	}
	for _, name := range []string{"prod", "lay-b/prod"} {
		_, err := ca.Create(ctx, &pb.CreateSandboxRequest{Template: name})
		notFoundOrDenied("A creates from template "+name, err)
		_, err = ca.Layers.GetEnvironment(ctx, connect.NewRequest(&pb.GetEnvironmentRequest{Name: name}))
		notFoundOrDenied("A gets environment "+name, err)
		_, err = ca.Layers.DeleteEnvironment(ctx, connect.NewRequest(&pb.DeleteEnvironmentRequest{Name: name}))
		notFoundOrDenied("A removes environment "+name, err)
	}
	// A removes none of B's.
	for _, ref := range []string{"secret:1", "lay-b/secret:1", lb.Digest} {
		_, err := ca.Layers.DeleteLayer(ctx, connect.NewRequest(&pb.DeleteLayerRequest{Ref: ref}))
		notFoundOrDenied("A removes "+ref, err)
	}
	// A's own layer, its environment "prod" (replace) and tag "secret:1"
	// are its own: B's are untouched.
	ta := secretTar(t, "A's files\n")
	la, err := ca.BuildLayerUpload(ctx, &pb.BuildLayerRequest{Kind: pb.LayerKind_LAYER_KIND_WORKSPACE, Ref: "evil:1"}, bytes.NewReader(ta), int64(len(ta)), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sdk(t).Layers.DeleteLayer(context.Background(), connect.NewRequest(&pb.DeleteLayerRequest{Ref: "lay-a/evil:1"}))
	_, err = ca.Layers.TagLayer(ctx, connect.NewRequest(&pb.TagLayerRequest{Source: "evil:1", Target: "lay-b/secret:1"}))
	notFoundOrDenied("A moves B's tag", err)
	if _, err := ca.Layers.TagLayer(ctx, connect.NewRequest(&pb.TagLayerRequest{Source: "evil:1", Target: "secret:1"})); err != nil {
		t.Fatal(err)
	}
	defer sdk(t).Layers.DeleteLayer(context.Background(), connect.NewRequest(&pb.DeleteLayerRequest{Ref: "lay-a/secret:1"}))
	if _, err := ca.Layers.CreateEnvironment(ctx, connect.NewRequest(&pb.CreateEnvironmentRequest{Name: "prod", Base: baseRef, Workspaces: []string{"evil:1"}, Replace: true})); err != nil {
		t.Fatal(err)
	}
	defer sdk(t).Layers.DeleteEnvironment(context.Background(), connect.NewRequest(&pb.DeleteEnvironmentRequest{Name: "lay-a/prod"}))
	got, err := cb.Layers.GetLayer(ctx, connect.NewRequest(&pb.GetLayerRequest{Ref: "secret:1"}))
	if err != nil || got.Msg.Digest != lb.Digest {
		t.Fatalf("B's secret:1 after A's tag: %v %v; want %s", got, err, lb.Digest)
	}
	// B's next sandbox from its environment runs B's files.
	sb, err := cb.Create(ctx, &pb.CreateSandboxRequest{Template: "prod"})
	if err != nil {
		t.Fatal(err)
	}
	defer sdk(t).Delete(context.Background(), sb.Id)
	var out bytes.Buffer
	if _, err := cb.ReadFile(ctx, sb.Id, "/secret", &out); err != nil || out.String() != "B's secret\n" {
		t.Fatalf("B's sandbox from its environment reads %q (%v): want B's file", out.String(), err)
	}
	if la.Digest == lb.Digest {
		t.Fatal("A's and B's layers have the same content")
	}

	// Shared layers: A creates from them, changes none.
	sa, err := ca.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef})
	if err != nil {
		t.Fatalf("A creates from the shared %s: %v", baseRef, err)
	}
	sdk(t).Delete(context.Background(), sa.Id)
	_, err = ca.Layers.DeleteLayer(ctx, connect.NewRequest(&pb.DeleteLayerRequest{Ref: baseRef}))
	notFoundOrDenied("A removes the shared "+baseRef, err)
	_, err = ca.Layers.TagLayer(ctx, connect.NewRequest(&pb.TagLayerRequest{Source: "evil:1", Target: "/" + baseRef}))
	notFoundOrDenied("A moves the shared "+baseRef, err)
	_, err = ca.Layers.GarbageCollectLayers(ctx, connect.NewRequest(&pb.GarbageCollectLayersRequest{DryRun: true}))
	notFoundOrDenied("A collects every tenant's images", err)
	shared, err := sdk(t).Layers.GetLayer(ctx, connect.NewRequest(&pb.GetLayerRequest{Ref: baseRef}))
	if err != nil || shared.Msg.Tenant != "" || shared.Msg.Digest == la.Digest {
		t.Fatalf("the shared %s: %v %v", baseRef, shared, err)
	}
	// The admin creates from B's environment as B would (B's files).
	sx, err := sdk(t).Create(ctx, &pb.CreateSandboxRequest{Template: "lay-b/prod"})
	if err != nil {
		t.Fatalf("the admin creates from lay-b/prod: %v", err)
	}
	defer sdk(t).Delete(context.Background(), sx.Id)
	out.Reset()
	if _, err := sdk(t).ReadFile(ctx, sx.Id, "/secret", &out); err != nil || out.String() != "B's secret\n" {
		t.Fatalf("the admin's sandbox from lay-b/prod reads %q (%v)", out.String(), err)
	}
	// The admin sees B's layer by its qualified name.
	if l, err := sdk(t).Layers.GetLayer(ctx, connect.NewRequest(&pb.GetLayerRequest{Ref: "lay-b/secret:1"})); err != nil || l.Msg.Tenant != "lay-b" {
		t.Fatalf("the admin inspects lay-b/secret:1: %v %v", l, err)
	}
}
