// Package metrics is what a node tells Prometheus: creates and their
// latency, sandboxes by state, the warm pool, API requests by procedure and
// code, plus Go's and the process's own collectors. serve makes one
// Metrics, hands it to the parts that count, and serves it on /metrics.
// Every method is safe on a nil *Metrics (tests and tools run without one).
package metrics

import (
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Metrics holds a node's registry and the metrics it updates as things
// happen; gauges of current state are read at scrape time (Gauges).
type Metrics struct {
	reg *prometheus.Registry

	creates        *prometheus.CounterVec
	createSeconds  *prometheus.HistogramVec
	deletes        *prometheus.CounterVec
	requests       *prometheus.CounterVec
	requestSeconds *prometheus.HistogramVec
	auditDropped   prometheus.Counter
	lazyFetch      prometheus.Histogram
	createsOK      atomic.Int64 // successful creates (the dashboard's creates/s)
	e2bRequests    *prometheus.CounterVec
	e2bSeconds     *prometheus.HistogramVec
	pauses         *prometheus.CounterVec
	pauseSeconds   *prometheus.HistogramVec
	resumeSeconds  *prometheus.HistogramVec
	reclaimed      *prometheus.CounterVec
	fncalls        *prometheus.CounterVec
	fncallSeconds  *prometheus.HistogramVec
}

// Latency buckets from 1 ms (a pooled create, an exec) to a minute (a cold
// create on a loaded host, a layer build's first byte).
var buckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}

// New returns a Metrics with its own registry, holding the Go runtime's and
// the process's collectors.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		creates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shoal_sandbox_creates_total",
			Help: "Sandbox creates by backend and result (ok, or the error code: invalid_argument, not_found, resource_exhausted, internal, ...).",
		}, []string{"backend", "result"}),
		createSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "shoal_sandbox_create_seconds",
			Help:    "Latency of successful sandbox creates, by backend and whether a warm pool served them.",
			Buckets: buckets,
		}, []string{"backend", "pooled"}),
		deletes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shoal_sandbox_deletes_total",
			Help: "Sandboxes deleted, by backend and why (request, timeout).",
		}, []string{"backend", "reason"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shoal_api_requests_total",
			Help: "API requests by procedure (or route) and code (ok, or the Connect code of the error).",
		}, []string{"procedure", "code"}),
		requestSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "shoal_api_request_seconds",
			Help:    "API request latency by procedure (or route); a stream counts until it ends.",
			Buckets: buckets,
		}, []string{"procedure"}),
		auditDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shoal_audit_dropped_total",
			Help: "Audit log entries dropped because the audit writer's queue was full (or the log was closed or could not be reopened).",
		}),
		lazyFetch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "shoal_layer_lazy_chunk_fetch_seconds",
			Help:    "Latency of chunk fetches from the layer store by the lazy loader (retries included).",
			Buckets: buckets,
		}),
	}
	m.e2bRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "shoal_e2b_requests_total",
		Help: "Requests to the E2B-compatible endpoint by route (an API pattern, \"envd \" and an envd procedure or route, \"port\" for a sandbox's own ports, or \"unmatched\") and HTTP status.",
	}, []string{"route", "code"})
	m.e2bSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "shoal_e2b_request_seconds",
		Help:    "Latency of requests to the E2B-compatible endpoint by route; a stream counts until it ends.",
		Buckets: buckets,
	}, []string{"route"})
	m.pauses = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "shoal_sandbox_pauses_total",
		Help: "Sandboxes paused, by backend and trigger (auto: the idle policy; request).",
	}, []string{"backend", "trigger"})
	m.pauseSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "shoal_sandbox_pause_seconds", Help: "Latency of pauses (freeze and memory reclaim), by backend.", Buckets: buckets,
	}, []string{"backend"})
	m.resumeSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "shoal_sandbox_resume_seconds", Help: "Latency of resumes, by backend (the count is the number of resumes).", Buckets: buckets,
	}, []string{"backend"})
	m.reclaimed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "shoal_sandbox_pause_reclaimed_bytes_total",
		Help: "Memory taken from sandboxes by their pauses (their cgroup's charge before less after), by backend.",
	}, []string{"backend"})
	m.fncalls = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "shoal_fncall_runs_total",
		Help: "Function calls judged, by language and verdict (OK, WA, TLE, MLE, RE, OLE, CE, SE).",
	}, []string{"language", "verdict"})
	m.fncallSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "shoal_fncall_run_seconds", Help: "Latency of function calls, queue included, by language.", Buckets: buckets,
	}, []string{"language"})
	m.reg.MustRegister(m.e2bRequests, m.e2bSeconds, m.pauses, m.pauseSeconds, m.resumeSeconds, m.reclaimed, m.fncalls, m.fncallSeconds)
	m.reg.MustRegister(m.creates, m.createSeconds, m.deletes, m.requests, m.requestSeconds, m.auditDropped, m.lazyFetch,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Handler serves the registry in Prometheus' text (or protobuf) format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// Create records one create: its latency when it succeeded, its result.
// result is "ok" or the error's code.
func (m *Metrics) Create(backend string, pooled bool, took time.Duration, result string) {
	if m == nil {
		return
	}
	m.creates.WithLabelValues(backend, result).Inc()
	if result == "ok" {
		m.createsOK.Add(1)
		m.createSeconds.WithLabelValues(backend, strconv.FormatBool(pooled)).Observe(took.Seconds())
	}
}

// CreatesOK is the number of successful creates recorded.
func (m *Metrics) CreatesOK() int64 {
	if m == nil {
		return 0
	}
	return m.createsOK.Load()
}

// Delete records one delete.
func (m *Metrics) Delete(backend, reason string) {
	if m == nil {
		return
	}
	m.deletes.WithLabelValues(backend, reason).Inc()
}

// Request records one API request.
func (m *Metrics) Request(procedure, code string, took time.Duration) {
	if m == nil {
		return
	}
	m.requests.WithLabelValues(procedure, code).Inc()
	m.requestSeconds.WithLabelValues(procedure).Observe(took.Seconds())
}

// E2BRequest records one request to the E2B endpoint.
func (m *Metrics) E2BRequest(route, code string, took time.Duration) {
	if m == nil {
		return
	}
	m.e2bRequests.WithLabelValues(route, code).Inc()
	m.e2bSeconds.WithLabelValues(route).Observe(took.Seconds())
}

// Pause records one pause and the memory it reclaimed (bytes; ignored
// when not positive: unknown).
func (m *Metrics) Pause(backend string, auto bool, took time.Duration, reclaimed int64) {
	if m == nil {
		return
	}
	trigger := "request"
	if auto {
		trigger = "auto"
	}
	m.pauses.WithLabelValues(backend, trigger).Inc()
	m.pauseSeconds.WithLabelValues(backend).Observe(took.Seconds())
	if reclaimed > 0 {
		m.reclaimed.WithLabelValues(backend).Add(float64(reclaimed))
	}
}

// Resume records one resume.
func (m *Metrics) Resume(backend string, took time.Duration) {
	if m == nil {
		return
	}
	m.resumeSeconds.WithLabelValues(backend).Observe(took.Seconds())
}

// FnCall records one judged function call. language must be one the
// engine knows (a label from a request would be unbounded).
func (m *Metrics) FnCall(language, verdict string, took time.Duration) {
	if m == nil {
		return
	}
	m.fncalls.WithLabelValues(language, verdict).Inc()
	m.fncallSeconds.WithLabelValues(language).Observe(took.Seconds())
}

// AuditDropped counts one dropped audit log entry.
func (m *Metrics) AuditDropped() {
	if m == nil {
		return
	}
	m.auditDropped.Inc()
}

// LazyFetch records one chunk fetched by the lazy layer loader.
func (m *Metrics) LazyFetch(took time.Duration) {
	if m == nil {
		return
	}
	m.lazyFetch.Observe(took.Seconds())
}

// Gauge is one value of a gauge read at scrape time.
type Gauge struct {
	Labels []string // values of the gauge's labels, in order
	Value  float64
}

// Gauges registers a gauge family whose values read() returns at each
// scrape (sandboxes by state, the pool's sizes): no count to keep in step
// with the state it describes.
func (m *Metrics) Gauges(name, help string, labels []string, read func() []Gauge) {
	if m == nil {
		return
	}
	m.reg.MustRegister(&gaugeFunc{desc: prometheus.NewDesc(name, help, labels, nil), typ: prometheus.GaugeValue, read: read})
}

// Counters is Gauges for counts kept elsewhere that only grow (name ends
// in _total).
func (m *Metrics) Counters(name, help string, labels []string, read func() []Gauge) {
	if m == nil {
		return
	}
	m.reg.MustRegister(&gaugeFunc{desc: prometheus.NewDesc(name, help, labels, nil), typ: prometheus.CounterValue, read: read})
}

type gaugeFunc struct {
	desc *prometheus.Desc
	typ  prometheus.ValueType
	read func() []Gauge
}

func (g *gaugeFunc) Describe(ch chan<- *prometheus.Desc) { ch <- g.desc }

func (g *gaugeFunc) Collect(ch chan<- prometheus.Metric) {
	for _, v := range g.read() {
		ch <- prometheus.MustNewConstMetric(g.desc, g.typ, v.Value, v.Labels...)
	}
}
