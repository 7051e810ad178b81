package e2b

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// TestRoutes: requests are counted by a bounded set of routes, whatever
// their path, and with the status the handler wrote.
func TestRoutes(t *testing.T) {
	s := &Server{}
	type got struct{ route, code string }
	var seen []got
	s.CountRequests(func(route, code string, took time.Duration) { seen = append(seen, got{route, code}) })
	sb := "E2b-Sandbox-Id"
	for _, c := range []struct {
		method, target, host string
		header               map[string]string
		want                 string
	}{
		{"POST", "/sandboxes", "", nil, "POST /sandboxes"},
		{"GET", "/sandboxes/abc/x", "", nil, "unmatched"},
		{"DELETE", "/sandboxes/abcdefghij", "", nil, "DELETE /sandboxes/{id}"},
		{"GET", "/random/path/1234", "", nil, "unmatched"},
		{"POST", "/process.Process/Start", "", map[string]string{sb: "abc"}, "envd /process.Process/Start"},
		{"POST", "/process.Process/NoSuchMethod", "", map[string]string{sb: "abc"}, "envd /process.Process/"},
		{"POST", "/filesystem.Filesystem/Stat", "49983-abc.shoal.localhost", nil, "envd /filesystem.Filesystem/Stat"},
		{"GET", "/files", "", map[string]string{sb: "abc"}, "envd GET /files"},
		{"GET", "/anything/at/all", "", map[string]string{sb: "abc", "E2b-Sandbox-Port": "8080"}, "port"},
		{"GET", "/x", "8080-abc.shoal.localhost", nil, "port"},
	} {
		r := httptest.NewRequest(c.method, c.target, nil)
		if c.host != "" {
			r.Host = c.host
		}
		for k, v := range c.header {
			r.Header.Set(k, v)
		}
		if got := s.route(r); got != c.want {
			t.Errorf("%s %s (host %q, %v): route %q, want %q", c.method, c.target, c.host, c.header, got, c.want)
		}
	}
	s.counting(httptest.NewRecorder(), httptest.NewRequest("GET", "/v2/sandboxes", nil), func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusTeapot)
		w.WriteHeader(http.StatusOK) // superfluous: the first counts
	})
	s.counting(httptest.NewRecorder(), httptest.NewRequest("GET", "/v2/sandboxes", nil), func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("ok"))
	})
	if len(seen) != 2 || seen[0] != (got{"GET /v2/sandboxes", "418"}) || seen[1] != (got{"GET /v2/sandboxes", "200"}) {
		t.Fatalf("counted %v", seen)
	}
}
