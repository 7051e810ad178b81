package main

import (
	"encoding/json"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// The CLI prints states and kinds by their short names and 64-bit numbers
// as numbers (protojson would print "SANDBOX_STATE_RUNNING" and
// "536870912").
func TestJSONView(t *testing.T) {
	created := time.Date(2026, 12, 1, 8, 0, 0, 5, time.UTC)
	sb := &pb.Sandbox{
		Id: "abc", State: pb.SandboxState_SANDBOX_STATE_RUNNING, MemoryBytes: 512 << 20,
		Layers:    []*pb.LayerRef{{Kind: pb.LayerKind_LAYER_KIND_BASE, Ref: "bb:1"}},
		CreatedAt: timestamppb.New(created), Metadata: map[string]string{"k": "v"},
	}
	b, err := json.Marshal(jsonView(sb.ProtoReflect()))
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]any{
		"id": "abc", "state": "running", "memory_bytes": float64(512 << 20), "millicpu": float64(0),
		"created_at": "2026-12-01T08:00:00.000000005Z", "expires_at": nil, "error": "",
	} {
		if got[k] != want {
			t.Errorf("%s = %#v, want %#v (in %s)", k, got[k], want, b)
		}
	}
	if l := got["layers"].([]any)[0].(map[string]any); l["kind"] != "base" || l["ref"] != "bb:1" {
		t.Errorf("layers %v", got["layers"])
	}
	if m := got["metadata"].(map[string]any); m["k"] != "v" {
		t.Errorf("metadata %v", got["metadata"])
	}
	if s := string(b); s[:8] != `{"id":"a` {
		t.Errorf("fields not in declaration order: %s", s)
	}
	if got := enumName(pb.SandboxState(0).Descriptor(), 0); got != "" {
		t.Errorf("unspecified state %q", got)
	}
}
