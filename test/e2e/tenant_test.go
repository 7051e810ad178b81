package e2e

// Tenants: isolation of one tenant's sandboxes from another's keys on every
// procedure and route, quotas, the audit log.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// tenantClient makes a key for tenant with scopes (through the admin key)
// and returns a client that uses it, and the key.
func tenantClient(t *testing.T, name, tenant string, scopes ...string) (*shoal.Client, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, secret, err := sdk(t).CreateKey(ctx, name, tenant, scopes...)
	if err != nil {
		t.Fatalf("create key %s: %v", name, err)
	}
	t.Cleanup(func() { sdk(t).DeleteKey(context.Background(), name) })
	c, err := shoal.New(shoal.Options{URL: apiURL, APIKey: secret})
	if err != nil {
		t.Fatal(err)
	}
	return c, secret
}

// rpcError is the code and message of a Connect call's error ("" if none).
type rpcError struct{ Code, Message string }

// callRaw calls procedure with msg (Connect protocol, JSON) using key, and
// returns its error, unary or server-streaming.
func callRaw(t *testing.T, key string, md protoreflect.MethodDescriptor, msg []byte) rpcError {
	t.Helper()
	path := fmt.Sprintf("/%s/%s", md.Parent().FullName(), md.Name())
	ctype, body := "application/json", msg
	if md.IsStreamingServer() || md.IsStreamingClient() {
		ctype = "application/connect+json"
		var env bytes.Buffer
		env.WriteByte(0)
		binary.Write(&env, binary.BigEndian, uint32(len(msg)))
		env.Write(msg)
		body = env.Bytes()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, apiURL+path, bytes.NewReader(body))
	req.Header.Set("Content-Type", ctype)
	req.Header.Set("Authorization", "Bearer "+key)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	defer res.Body.Close()
	data, _ := io.ReadAll(res.Body)
	var out rpcError
	if ctype == "application/json" || res.StatusCode != http.StatusOK {
		if res.StatusCode != http.StatusOK {
			json.Unmarshal(data, &out)
		}
		return out
	}
	// A stream: envelopes until the end-of-stream one, whose JSON holds
	// the error.
	for len(data) >= 5 {
		flags, n := data[0], binary.BigEndian.Uint32(data[1:5])
		if int(n) > len(data)-5 {
			break
		}
		if flags&2 != 0 {
			var end struct{ Error *rpcError }
			json.Unmarshal(data[5:5+n], &end)
			if end.Error != nil {
				out = *end.Error
			}
			return out
		}
		data = data[5+n:]
	}
	return out
}

// sandboxField is the field of a request message that names a sandbox:
// sandbox_id, or id in SandboxService.
func sandboxField(md protoreflect.MethodDescriptor) protoreflect.FieldDescriptor {
	in := md.Input()
	if f := in.Fields().ByName("sandbox_id"); f != nil {
		return f
	}
	if md.Parent().Name() == "SandboxService" {
		return in.Fields().ByName("id")
	}
	return nil
}

// TestTenantIsolation calls every procedure of api/shoal/v1 that names a
// sandbox, and every sandbox route, with tenant B's key on tenant A's
// sandbox: each must answer exactly as for a missing sandbox (or refuse
// for a missing scope), and A's sandbox must be untouched. A handler added
// later without the ownership check fails here.
func TestTenantIsolation(t *testing.T) {
	need(t)
	all := []string{"sandboxes", "layers:read", "layers:write"}
	ca, _ := tenantClient(t, "iso-a", "iso-a", all...)
	cb, keyB := tenantClient(t, "iso-b", "iso-b", all...)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sb, err := ca.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, ClientKey: "iso-shared-key"})
	if err != nil {
		t.Fatal(err)
	}
	idA := sb.Id
	defer sdk(t).Delete(context.Background(), idA)
	if sb.Tenant != "iso-a" || len(sb.Runtime) != 0 {
		t.Fatalf("tenant %q, runtime %v: want iso-a and no runtime (host paths) for a tenant's key", sb.Tenant, sb.Runtime)
	}
	// The answer for a sandbox that does not exist, with A's ID put in.
	missing := strings.Repeat("a", 20)
	want := callRaw(t, keyB, pb.File_shoal_v1_sandbox_proto.Services().ByName("SandboxService").Methods().ByName("GetSandbox"),
		[]byte(`{"id":"`+missing+`"}`))
	if want.Code != "not_found" {
		t.Fatalf("a missing sandbox: %+v", want)
	}
	want.Message = strings.ReplaceAll(want.Message, missing, idA)

	checked := 0
	protoregistry.GlobalFiles.RangeFilesByPackage("shoal.v1", func(fd protoreflect.FileDescriptor) bool {
		for i := 0; i < fd.Services().Len(); i++ {
			sd := fd.Services().Get(i)
			for j := 0; j < sd.Methods().Len(); j++ {
				md := sd.Methods().Get(j)
				f := sandboxField(md)
				if f == nil {
					continue
				}
				msg := dynamicpb.NewMessage(md.Input())
				msg.Set(f, protoreflect.ValueOfString(idA))
				body, err := protojson.Marshal(msg)
				if err != nil {
					t.Fatal(err)
				}
				got := callRaw(t, keyB, md, body)
				name := string(sd.Name()) + "/" + string(md.Name())
				if got.Code == "permission_denied" {
					t.Logf("%s: permission_denied: %s", name, got.Message)
				} else if got != want {
					t.Errorf("%s as tenant B on A's sandbox: %+v, want exactly %+v (as for a missing sandbox)", name, got, want)
				}
				checked++
			}
		}
		return true
	})
	if checked < 20 {
		t.Fatalf("only %d procedures name a sandbox: is api/shoal/v1 registered?", checked)
	}
	t.Logf("%d procedures checked", checked)

	// Every plain route of one sandbox.
	for _, rt := range []struct{ method, path string }{
		{"GET", "/v1/sandboxes/" + idA + "/files?path=/etc/hostname"},
		{"PUT", "/v1/sandboxes/" + idA + "/files?path=/tmp/x"},
		{"GET", "/v1/sandboxes/" + idA + "/ports/8080/"},
		{"GET", "/v1/sandboxes/" + idA + "/ports/8080/tcp"},
	} {
		req, _ := http.NewRequestWithContext(ctx, rt.method, apiURL+rt.path, strings.NewReader("pwned"))
		req.Header.Set("Authorization", "Bearer "+keyB)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var got rpcError
		json.NewDecoder(res.Body).Decode(&got)
		res.Body.Close()
		if res.StatusCode != http.StatusNotFound || got != want {
			t.Errorf("%s %s as tenant B: %d %+v, want 404 %+v", rt.method, rt.path, res.StatusCode, got, want)
		}
	}

	// Lists: B does not see A's sandbox; the admin does. A client key is
	// per tenant: B's create with A's key makes B's own sandbox.
	if l, err := cb.List(ctx); err != nil || len(l) != 0 {
		t.Errorf("tenant B lists %d sandboxes (%v), want none", len(l), err)
	}
	sbB, err := cb.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, ClientKey: "iso-shared-key"})
	if err != nil {
		t.Fatal(err)
	}
	defer sdk(t).Delete(context.Background(), sbB.Id)
	if sbB.Id == idA || sbB.Tenant != "iso-b" {
		t.Fatalf("tenant B's create with A's client key returned %s (tenant %q)", sbB.Id, sbB.Tenant)
	}
	adminSees := map[string]bool{}
	all2, err := sdk(t).List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range all2 {
		adminSees[s.Id] = true
	}
	if !adminSees[idA] || !adminSees[sbB.Id] {
		t.Errorf("the admin does not see both tenants' sandboxes")
	}
	if l, err := ca.List(ctx); err != nil || len(l) != 1 || l[0].Id != idA {
		t.Errorf("tenant A lists %v (%v), want its one sandbox", l, err)
	}
	// Scopes: a tenant's key cannot administer, nor build from server paths.
	if _, err := cb.Admin.ListKeys(ctx, connectReq(&pb.ListKeysRequest{})); !isCode(err, "permission_denied") {
		t.Errorf("tenant ListKeys: %v, want permission_denied", err)
	}
	if _, err := cb.BuildLayerProgress(ctx, &pb.BuildLayerRequest{Ref: "etc:1", Source: "/etc", Kind: pb.LayerKind_LAYER_KIND_BASE}, nil); !isCode(err, "permission_denied") {
		t.Errorf("tenant BuildLayer of /etc: %v, want permission_denied", err)
	}
	// A's sandbox is untouched and still A's.
	var out bytes.Buffer
	st, err := ca.Exec(ctx, idA, shoal.ExecOptions{Args: []string{"echo", "still-mine"}, Stdout: &out})
	if err != nil || st.Code != 0 || strings.TrimSpace(out.String()) != "still-mine" {
		t.Fatalf("tenant A exec after B's attempts: %v %v %q", st, err, out.String())
	}
	if _, err := ca.ReadFile(ctx, idA, "/tmp/x", io.Discard); !isCode(err, "not_found") {
		t.Errorf("B's write reached A's sandbox: read /tmp/x: %v", err)
	}
}

func isCode(err error, code string) bool { return err != nil && connect.CodeOf(err).String() == code }

// TestTenantQuota: a tenant with max-sandboxes 2 gets its third create
// refused (resource_exhausted naming the quota, nothing half-created), and
// allowed again after a delete.
func TestTenantQuota(t *testing.T) {
	need(t)
	c, key := tenantClient(t, "quota-k", "quota-t", "sandboxes", "layers:read")
	if out, code := run(nil, "tenant", "set", "quota-t", "--max-sandboxes", "2", "--max-memory", "8G"); code != 0 {
		t.Fatalf("tenant set: %s", out)
	}
	t.Cleanup(func() {
		sdk(t).SetQuota(context.Background(), "quota-t", &pb.Quota{})
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var ids []string
	for i := 0; i < 2; i++ {
		sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 64 << 20})
		if err != nil {
			t.Fatalf("create %d within the quota: %v", i, err)
		}
		ids = append(ids, sb.Id)
		defer sdk(t).Delete(context.Background(), sb.Id)
	}
	before, _ := sdk(t).List(ctx)
	_, stderr, code := run3(nil, "--api-key", key, "create", "--base", baseRef, "--memory", "64M")
	if code == 0 || !strings.Contains(stderr, "resource_exhausted") || !strings.Contains(stderr, "max-sandboxes") {
		t.Fatalf("third create: exit %d %q, want resource_exhausted naming max-sandboxes", code, stderr)
	}
	after, _ := sdk(t).List(ctx)
	if len(after) != len(before) {
		t.Fatalf("a refused create left a sandbox: %d sandboxes before, %d after", len(before), len(after))
	}
	if out, _ := run(nil, "tenant", "ls"); !strings.Contains(out, "quota-t") || !strings.Contains(out, "2/2") {
		t.Errorf("tenant ls does not show quota-t at 2/2:\n%s", out)
	}
	// The admin is not bound by the tenant's quota.
	id := create(t)
	run(nil, "rm", id)
	if err := c.Delete(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 64 << 20})
	if err != nil {
		t.Fatalf("create after a delete: %v", err)
	}
	defer sdk(t).Delete(context.Background(), sb.Id)
	// Memory: 3 x 64M used of 8G; a create of 8G is over.
	if _, err := sdk(t).SetQuota(ctx, "quota-t", &pb.Quota{MaxMemoryBytes: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, sb.Id); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef, MemoryBytes: 1 << 30}); !isCode(err, "resource_exhausted") || !strings.Contains(err.Error(), "max-memory") {
		t.Fatalf("create over max-memory: %v", err)
	}
}

// TestAuditLog: a create, exec, file write and delete made with a tenant's
// key are in the audit log with the key, tenant, object and result.
func TestAuditLog(t *testing.T) {
	need(t)
	c, _ := tenantClient(t, "aud-k", "aud-t", "sandboxes", "layers:read")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: baseRef})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"echo", "audited-argv"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile(ctx, sb.Id, "/tmp/audited", 0o644, strings.NewReader("x")); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, sb.Id); err != nil {
		t.Fatal(err)
	}
	// A tenant cannot read the log.
	if _, stderr, code := run3(nil, "--api-key", c.APIKey(), "audit"); code == 0 || !strings.Contains(stderr, "permission_denied") {
		t.Errorf("a tenant's shoal audit: exit %d %s", code, stderr)
	}
	wantActions := []string{"sandbox.create", "command.start", "file.write", "sandbox.delete"}
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, code := run(nil, "audit", "--tenant", "aud-t", "--json")
		if code != 0 {
			t.Fatalf("shoal audit: %s", out)
		}
		var entries []map[string]any
		json.Unmarshal([]byte(out), &entries)
		var got []string
		ok := true
		for _, e := range entries {
			if e["key"] != "aud-k" || e["tenant"] != "aud-t" || e["object"] != sb.Id || e["result"] != "ok" {
				ok = false
			}
			got = append(got, fmt.Sprint(e["action"]))
			if e["action"] == "command.start" && !strings.Contains(fmt.Sprint(e["detail"]), "echo audited-argv") {
				t.Errorf("command.start detail %q lacks the argv", e["detail"])
			}
		}
		if ok && strings.Join(got, " ") == strings.Join(wantActions, " ") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("audit entries of tenant aud-t: %s\nwant actions %v, each by aud-k on %s, ok", out, wantActions, sb.Id)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
