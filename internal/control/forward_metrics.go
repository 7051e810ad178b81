package control

import (
	"net/http"

	"github.com/shoal-sandbox/shoal/internal/metrics"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// SetMetrics makes a control replica count its requests in mt (RPCs by
// procedure and code, as a node does, and its plain routes by pattern),
// its placement decisions and the nodes it knows, and serve mt on GET
// /metrics (admin). A node counts the calls it serves in its own; a
// replica's are what reached the cluster through it. Call it before
// Handler.
func (f *Forwarder) SetMetrics(mt *metrics.Metrics) {
	f.metrics = mt
	mt.Counters("shoal_placement_decisions_total",
		"Placement by this control replica: placed (a node accepted), refused (a node refused, the next was tried), retried, no_capacity (no node could hold it: the create waited), queue_full, timed_out (waited until its deadline).",
		[]string{"result"}, func() []metrics.Gauge {
			st := f.place.Stats()
			return []metrics.Gauge{
				{Labels: []string{"placed"}, Value: float64(st.Placed)},
				{Labels: []string{"refused"}, Value: float64(st.Refusals)},
				{Labels: []string{"retried"}, Value: float64(st.Retries)},
				{Labels: []string{"no_capacity"}, Value: float64(st.NoCapacity)},
				{Labels: []string{"queue_full"}, Value: float64(st.QueueFull)},
				{Labels: []string{"timed_out"}, Value: float64(st.TimedOut)},
			}
		})
	mt.Gauges("shoal_cluster_nodes", "Nodes this control replica knows, by state (live: its lease holds; down: its lease ended).",
		[]string{"state"}, func() []metrics.Gauge {
			return []metrics.Gauge{
				{Labels: []string{"live"}, Value: float64(len(f.dir.Live()))},
				{Labels: []string{"down"}, Value: float64(len(f.dir.Down()))},
			}
		})
}

// serveMetrics is GET /metrics on a replica: the admin's.
func (f *Forwarder) serveMetrics(w http.ResponseWriter, r *http.Request) {
	if err := tenant.FromContext(r.Context()).Require("GET /metrics", adm...); err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	f.metrics.Handler().ServeHTTP(w, r)
}
