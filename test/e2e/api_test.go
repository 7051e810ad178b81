package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// The API's edges as a client without the Go SDK sees them: plain HTTP
// requests in the Connect protocol, JSON bodies.

// postJSON sends a Connect unary call with a JSON body and returns the
// status, the body and the reply headers.
func postJSON(t *testing.T, procedure, body string, header ...string) (int, string, http.Header) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, apiURL+procedure, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+apiKey)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Connect-Protocol-Version", "1")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b), res.Header
}

// wantError checks an HTTP error reply carrying Connect's JSON error.
func wantError(t *testing.T, what string, status int, body string, wantStatus int, wantCode string, wantInMessage ...string) {
	t.Helper()
	if status != wantStatus {
		t.Fatalf("%s: HTTP %d %s, want %d", what, status, body, wantStatus)
	}
	code, msg := errorBody(t, body)
	if code != wantCode {
		t.Fatalf("%s: code %q (%s), want %q", what, code, msg, wantCode)
	}
	for _, s := range wantInMessage {
		if !strings.Contains(msg, s) {
			t.Fatalf("%s: message %q does not say %q", what, msg, s)
		}
	}
}

// A JSON request naming a field the server does not know is refused with
// invalid_argument naming the field: a client can tell that the server did
// not understand it (instead of the field being dropped silently).
func TestUnknownJSONFieldsRefused(t *testing.T) {
	need(t)

	// Known fields, by JSON name and by proto name, are accepted.
	status, body, _ := postJSON(t, "/shoal.v1.SandboxService/GetSandbox", `{"id":"nosuchsandbox"}`)
	wantError(t, "GetSandbox of a missing sandbox", status, body, http.StatusNotFound, "not_found")
	if status, body, _ = postJSON(t, "/shoal.v1.LayerService/ListLayers", `{"all":true}`); status != http.StatusOK {
		t.Fatalf("ListLayers: HTTP %d %s", status, body)
	}
	if status, body, _ = postJSON(t, "/shoal.v1.CommandService/ListCommands", `{"sandbox_id":"nosuchsandbox"}`); status == http.StatusBadRequest {
		t.Fatalf("ListCommands with a proto field name: HTTP %d %s", status, body)
	}

	for _, c := range []struct{ procedure, body, field string }{
		{"/shoal.v1.SandboxService/GetSandbox", `{"id":"nosuchsandbox","clientKey2":"k"}`, "clientKey2"},
		{"/shoal.v1.SandboxService/ListSandboxes", `{"filter":{"state":"running"}}`, "filter"},
		{"/shoal.v1.LayerService/ListLayers", `{"all":true,"dangling":true}`, "dangling"},
		{"/shoal.v1.LayerService/CreateEnvironment", `{"name":"strict-json","base":"` + baseRef + `","toolkit":"x:1"}`, "toolkit"},
		{"/shoal.v1.CommandService/ListCommands", `{"sandboxId":"x","running":true}`, "running"},
		{"/shoal.v1.FnCallService/ListLanguages", `{"verbose":true}`, "verbose"},
	} {
		status, body, _ := postJSON(t, c.procedure, c.body)
		wantError(t, c.procedure+" "+c.body, status, body, http.StatusBadRequest, "invalid_argument", `unknown field "`+c.field+`"`)
	}
	// The environment of the refused create was not made.
	if status, body, _ := postJSON(t, "/shoal.v1.LayerService/GetEnvironment", `{"name":"strict-json"}`); status != http.StatusNotFound {
		t.Fatalf("GetEnvironment after a refused create: HTTP %d %s", status, body)
	}

	// The charset form of the content type is served by the same codec.
	status, body, _ = postJSON(t, "/shoal.v1.SandboxService/ListSandboxes", `{"bogus":1}`, "Content-Type", "application/json; charset=utf-8")
	wantError(t, "ListSandboxes, charset=utf-8", status, body, http.StatusBadRequest, "invalid_argument", `unknown field "bogus"`)

	// A server stream (Connect envelopes): the error is in the end of the stream.
	msg := []byte(`{"kind":"LAYER_KIND_WORKSPACE","ref":"strict:1","source":"/nonexistent","progressEvery":5}`)
	env := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(env[1:], uint32(len(msg)))
	env = append(env, msg...)
	req, _ := http.NewRequest(http.MethodPost, apiURL+"/shoal.v1.LayerService/BuildLayer", bytes.NewReader(env))
	req.Header.Set("Authorization", "Bearer "+apiKey)
	req.Header.Set("Content-Type", "application/connect+json")
	req.Header.Set("Connect-Protocol-Version", "1")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if len(b) < 5 || b[0]&0x02 == 0 {
		t.Fatalf("BuildLayer with an unknown field: HTTP %d, want an end-of-stream message, got %q", res.StatusCode, b)
	}
	var end struct {
		Error struct{ Code, Message string }
	}
	if err := json.Unmarshal(b[5:], &end); err != nil || end.Error.Code != "invalid_argument" || !strings.Contains(end.Error.Message, `unknown field "progressEvery"`) {
		t.Fatalf("BuildLayer with an unknown field: end of stream %q", b)
	}

	// CreateSandbox (served through fncall.go's handler): an unknown field
	// must not create a sandbox that silently lacks what was asked for.
	status, body, _ = postJSON(t, "/shoal.v1.SandboxService/CreateSandbox", `{"base":"`+baseRef+`","clientKeyV2":"strict-json-1"}`)
	if status == http.StatusOK {
		var sb struct{ Id string }
		json.Unmarshal([]byte(body), &sb)
		run(nil, "rm", sb.Id)
	}
	wantError(t, "CreateSandbox with an unknown field", status, body, http.StatusBadRequest, "invalid_argument", `unknown field "clientKeyV2"`)
}

// A procedure the server does not have answers Connect's JSON error
// "unimplemented" with HTTP 404, not a plain-text "404 page not found".
func TestUnknownProcedureIsUnimplemented(t *testing.T) {
	need(t)
	for _, p := range []string{
		"/shoal.v1.SandboxService/NoSuchMethod", // a known service (its generated handler)
		"/shoal.v1.NoSuchService/Run",           // an unknown service
		"/shoal.v1.FnCallService/Compile",       // another service's unknown method
		"/shoal.v1.LayerService/",               // no method
		"/shoal.v1.SandboxService",              // no method, no slash
		"/shoal.v1.SandboxService/GetSandbox/x", // too long
	} {
		status, body, hdr := postJSON(t, p, `{}`)
		wantError(t, p, status, body, http.StatusNotFound, "unimplemented", p)
		if ct := hdr.Get("Content-Type"); ct != "application/json" {
			t.Fatalf("%s: Content-Type %q", p, ct)
		}
	}
	// Still behind authentication.
	req, _ := http.NewRequest(http.MethodPost, apiURL+"/shoal.v1.NoSuchService/Run", strings.NewReader("{}"))
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusUnauthorized {
		t.Fatalf("unknown procedure without a key: HTTP %d, want 401", res.StatusCode)
	}
	// gRPC clients get grpc-status 12 (UNIMPLEMENTED), trailers-only.
	status, _, hdr := postJSON(t, "/shoal.v1.SandboxService/NoSuchMethod", "", "Content-Type", "application/grpc")
	if status != http.StatusOK || hdr.Get("Grpc-Status") != "12" {
		t.Fatalf("gRPC call of an unknown method: HTTP %d, grpc-status %q", status, hdr.Get("Grpc-Status"))
	}
	// Procedures that exist are unaffected, and so are other unknown paths.
	if status, body, _ := postJSON(t, "/shoal.v1.SandboxService/ListSandboxes", `{}`); status != http.StatusOK {
		t.Fatalf("ListSandboxes: HTTP %d %s", status, body)
	}
	if status, _, _ := postJSON(t, "/v1/nothing-here", `{}`); status != http.StatusNotFound {
		t.Fatalf("/v1/nothing-here: HTTP %d", status)
	}
	// The Go SDK (binary protobuf) sees CodeUnimplemented too.
	c := connect.NewClient[pb.GetSandboxRequest, pb.Sandbox](http.DefaultClient, apiURL+"/shoal.v1.SandboxService/NoSuchMethod")
	req2 := connect.NewRequest(&pb.GetSandboxRequest{Id: "x"})
	req2.Header().Set("Authorization", "Bearer "+apiKey)
	if _, err := c.CallUnary(context.Background(), req2); connect.CodeOf(err) != connect.CodeUnimplemented {
		t.Fatalf("connect client, unknown method: %v", err)
	}
}

// Removing a directory that is not empty without recursive is a failed
// precondition saying what to do, not "already exists".
func TestRemoveNonEmptyDirectory(t *testing.T) {
	need(t)
	id := create(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := sdk(t)
	if _, err := c.WriteFile(ctx, id, "/work/d/f", 0o644, strings.NewReader("x")); err != nil {
		t.Fatal(err)
	}

	status, body, _ := postJSON(t, "/shoal.v1.SandboxService/RemoveFile", `{"sandboxId":"`+id+`","path":"/work/d"}`)
	wantError(t, "RemoveFile of a non-empty directory", status, body, http.StatusBadRequest, "failed_precondition", "not empty", "recursive")
	_, err := c.Sandboxes.RemoveFile(ctx, connect.NewRequest(&pb.RemoveFileRequest{SandboxId: id, Path: "/work/d"}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("RemoveFile (Go SDK) of a non-empty directory: %v", err)
	}

	// A real "exists" is still already_exists.
	status, body, _ = postJSON(t, "/shoal.v1.SandboxService/MakeDir", `{"sandboxId":"`+id+`","path":"/work/d/f"}`)
	wantError(t, "MakeDir over a file", status, body, http.StatusConflict, "already_exists")

	// Recursive removes it; an empty directory goes without.
	if _, err := c.Sandboxes.RemoveFile(ctx, connect.NewRequest(&pb.RemoveFileRequest{SandboxId: id, Path: "/work/d", Recursive: true})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Sandboxes.MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{SandboxId: id, Path: "/work/e"})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Sandboxes.RemoveFile(ctx, connect.NewRequest(&pb.RemoveFileRequest{SandboxId: id, Path: "/work/e"})); err != nil {
		t.Fatal(err)
	}
	_, err = c.Sandboxes.StatFile(ctx, connect.NewRequest(&pb.StatFileRequest{SandboxId: id, Path: "/work/e"}))
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeNotFound {
		t.Fatalf("StatFile after remove: %v", err)
	}
}

// /metrics needs the API key, and counts what happened: a create, a create
// of a missing layer, a file read, the sandboxes running now.
func TestMetricsEndpoint(t *testing.T) {
	need(t)
	get := func(key string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, apiURL+"/metrics", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	if status, _ := get(""); status != http.StatusUnauthorized {
		t.Fatalf("/metrics without a key: HTTP %d, want 401", status)
	}
	id := create(t)
	if _, code := run(nil, "create", "--base", "no-such-layer:1"); code == 0 {
		t.Fatal("create of a missing layer succeeded")
	}
	if out, code := run(nil, "cp", id+":/bin/busybox", "/dev/null"); code != 0 {
		t.Fatalf("cp: %s", out)
	}
	status, body := get(apiKey)
	if status != http.StatusOK {
		t.Fatalf("/metrics: HTTP %d", status)
	}
	for _, want := range []string{
		`shoal_sandbox_creates_total{backend="container",result="ok"}`,
		`shoal_sandbox_creates_total{backend="container",result="not_found"}`,
		`shoal_sandbox_create_seconds_count{backend="container"`,
		`shoal_sandboxes{backend="container",state="running"}`,
		`shoal_api_requests_total{code="ok",procedure="/shoal.v1.SandboxService/CreateSandbox"}`,
		`shoal_api_requests_total{code="not_found",procedure="/shoal.v1.SandboxService/CreateSandbox"}`,
		`shoal_api_requests_total{code="ok",procedure="GET /v1/sandboxes/{id}/files"}`,
		`shoal_pool_containers{kind="ready"}`,
		`shoal_node_capacity{kind="used",resource="memory_bytes"}`,
		`shoal_node_capacity{kind="host",resource="millicpu"}`,
		`shoal_node_oversubscription{resource="memory"}`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}
