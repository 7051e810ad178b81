package control

import (
	"context"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/metrics"
)

// SetMetrics makes the server count its requests in mt and serve mt on
// GET /metrics (authenticated). Call it before Handler.
func (s *Server) SetMetrics(mt *metrics.Metrics) { s.metrics = mt }

// metricsInterceptor counts each RPC by procedure and the Connect code it
// ended with; a stream counts when it ends, with the code of its end.
type metricsInterceptor struct{ m *metrics.Metrics }

func (i metricsInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		start := time.Now()
		res, err := next(ctx, req)
		i.m.Request(req.Spec().Procedure, rpcCode(err), time.Since(start))
		return res, err
	}
}

func (i metricsInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i metricsInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		start := time.Now()
		err := next(ctx, conn)
		i.m.Request(conn.Spec().Procedure, rpcCode(err), time.Since(start))
		return err
	}
}

func rpcCode(err error) string {
	if err == nil {
		return "ok"
	}
	return connect.CodeOf(err).String()
}

// countRoutes counts the plain HTTP routes (files, ports, layer transfer,
// /metrics) by their pattern and the Connect code of their HTTP status;
// RPCs are counted by the interceptor. Requests no route matched count
// under "unmatched", so that a scan of random paths makes no new series.
func (s *Server) countRoutes(next http.Handler) http.Handler { return countRoutes(s.metrics, next) }

func countRoutes(mt *metrics.Metrics, next http.Handler) http.Handler {
	if mt == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/shoal.v1.") {
			next.ServeHTTP(w, r)
			return
		}
		start := time.Now()
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		next.ServeHTTP(sw, r)
		route := r.Pattern // set by the mux on the request it routed
		if route == "" {
			route = "unmatched"
		}
		mt.Request(route, httpCode(sw.status), time.Since(start))
	})
}

// httpCode is the wire code of an HTTP status (errdefs' table).
func httpCode(status int) string { return errdefs.CodeOfStatus(errdefs.FaceShoal, status) }

// statusWriter remembers the status a handler wrote; it passes Flush and
// Hijack on (streamed files, upgraded port connections).
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController reach Flush, Hijack and deadlines.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}
