package e2b

import (
	"net/http"
	"strconv"
	"time"

	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/shoal-sandbox/shoal/api/e2b/filesystem"
	"github.com/shoal-sandbox/shoal/api/e2b/process"
)

// CountRequests makes the endpoint report each request when it ends: its
// route (a pattern of the API, "envd " and the envd procedure or route,
// or "port" for traffic to a sandbox's own port; requests nothing matched
// count as "unmatched", so that random paths make no new series) and its
// HTTP status. Call it before serving.
func (s *Server) CountRequests(count func(route, code string, took time.Duration)) {
	s.count = count
	s.apiMux, _ = s.apiRoutes().(*http.ServeMux)
	s.envdMux, _ = s.envdRoutes().(*http.ServeMux)
	s.envdProcs = map[string]bool{}
	for _, fd := range []protoreflect.FileDescriptor{process.File_process_process_proto, filesystem.File_filesystem_filesystem_proto} {
		for i := 0; i < fd.Services().Len(); i++ {
			sd := fd.Services().Get(i)
			for j := 0; j < sd.Methods().Len(); j++ {
				s.envdProcs["/"+string(sd.FullName())+"/"+string(sd.Methods().Get(j).Name())] = true
			}
		}
	}
}

// route names the route of a request for CountRequests (the muxes only
// match here; they serve nothing).
func (s *Server) route(r *http.Request) string {
	port, sandbox := EnvdPort, r.Header.Get("E2b-Sandbox-Id") != ""
	if p := r.Header.Get("E2b-Sandbox-Port"); sandbox && p != "" {
		port, _ = strconv.Atoi(p)
	}
	if !sandbox {
		if p, _, ok := parseSandboxHost(r.Host); ok {
			port, sandbox = p, true
		}
	}
	var mux *http.ServeMux
	prefix := ""
	switch {
	case sandbox && port != EnvdPort:
		return "port"
	case sandbox:
		if s.envdProcs[r.URL.Path] {
			return "envd " + r.URL.Path
		}
		mux, prefix = s.envdMux, "envd "
	default:
		mux = s.apiMux
	}
	if mux == nil {
		return "unmatched"
	}
	_, pattern := mux.Handler(r)
	if pattern == "" || pattern == "/" {
		return "unmatched"
	}
	return prefix + pattern
}

// counting serves a request through serve and reports it.
func (s *Server) counting(w http.ResponseWriter, r *http.Request, serve func(http.ResponseWriter, *http.Request)) {
	route := s.route(r)
	start := time.Now()
	sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
	// Deferred: a handler that drops the connection (panics with
	// http.ErrAbortHandler) is counted too.
	defer func() { s.count(route, strconv.Itoa(sw.status), time.Since(start)) }()
	serve(sw, r)
}

// statusWriter remembers the status a handler wrote; Unwrap lets
// http.ResponseController reach Flush, Hijack and deadlines.
type statusWriter struct {
	http.ResponseWriter
	status int
	wrote  bool
}

func (w *statusWriter) WriteHeader(code int) {
	if !w.wrote {
		w.status, w.wrote = code, true
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	w.wrote = true
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}
