package control

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"

	v1 "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// TestSmallAnswersNotCompressed: a client that accepts gzip (httpx does by
// default) gets small answers as they are; only large ones are compressed.
func TestSmallAnswersNotCompressed(t *testing.T) {
	h := connect.NewUnaryHandler("/shoal.v1.SandboxService/GetSandbox",
		func(_ context.Context, r *connect.Request[v1.GetSandboxRequest]) (*connect.Response[v1.Sandbox], error) {
			size := 10
			if r.Msg.Id == "large" {
				size = limits.CompressMinBytes + 1
			}
			return connect.NewResponse(&v1.Sandbox{Id: strings.Repeat("x", size)}), nil
		}, baseHandlerOptions()...)
	for _, c := range []struct{ id, encoding string }{{"small", ""}, {"large", "gzip"}} {
		r := httptest.NewRequest("POST", "/shoal.v1.SandboxService/GetSandbox", strings.NewReader(`{"id":"`+c.id+`"}`))
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set("Accept-Encoding", "gzip")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", c.id, w.Code, w.Body)
		}
		if got := w.Header().Get("Content-Encoding"); got != c.encoding {
			t.Errorf("%s answer: Content-Encoding %q, want %q", c.id, got, c.encoding)
		}
	}
}
