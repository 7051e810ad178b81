package control

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestRequireClientCert: a request without a verified client certificate
// is refused as unauthenticated, saying what to present, but for GET of
// the open paths; one with a verified chain passes.
func TestRequireClientCert(t *testing.T) {
	h := RequireClientCert(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}), "/healthz")
	for _, c := range []struct {
		method, path string
		tls          *tls.ConnectionState
		want         int
	}{
		{"POST", "/shoal.v1.SandboxService/ListSandboxes", nil, 401},
		{"POST", "/shoal.v1.SandboxService/ListSandboxes", &tls.ConnectionState{}, 401},
		{"GET", "/healthz", &tls.ConnectionState{}, 200},
		{"POST", "/healthz", &tls.ConnectionState{}, 401},
		{"POST", "/shoal.v1.SandboxService/ListSandboxes", &tls.ConnectionState{VerifiedChains: [][]*x509.Certificate{{{}}}}, 200},
	} {
		r := httptest.NewRequest(c.method, c.path, nil)
		r.TLS = c.tls
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != c.want {
			t.Errorf("%s %s (tls %v): %d, want %d", c.method, c.path, c.tls != nil, w.Code, c.want)
			continue
		}
		if c.want == 401 {
			var e struct{ Code, Message string }
			if json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Code != "unauthenticated" || e.Message == "" {
				t.Errorf("%s %s: body %q, want a Connect error: unauthenticated, saying why", c.method, c.path, w.Body)
			}
		}
	}
}
