package metrics

import (
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func scrape(t *testing.T, m *Metrics) string {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	b, _ := io.ReadAll(rec.Body)
	return string(b)
}

func TestMetrics(t *testing.T) {
	m := New()
	m.Create("container", true, 3*time.Millisecond, "ok")
	m.Create("container", false, time.Second, "not_found")
	m.Delete("container", "timeout")
	m.Request("/shoal.v1.SandboxService/CreateSandbox", "ok", time.Millisecond)
	m.E2BRequest("POST /sandboxes", "201", time.Millisecond)
	m.Pause("container", true, 20*time.Millisecond, 100<<20)
	m.Pause("container", false, 20*time.Millisecond, -1)
	m.Resume("container", 3*time.Millisecond)
	n := 2
	m.Gauges("shoal_test_sandboxes", "test", []string{"state"}, func() []Gauge {
		return []Gauge{{Labels: []string{"running"}, Value: float64(n)}}
	})
	out := scrape(t, m)
	for _, want := range []string{
		`shoal_sandbox_creates_total{backend="container",result="ok"} 1`,
		`shoal_sandbox_creates_total{backend="container",result="not_found"} 1`,
		`shoal_sandbox_create_seconds_bucket{backend="container",pooled="true",le="0.005"} 1`,
		`shoal_sandbox_create_seconds_count{backend="container",pooled="true"} 1`,
		`shoal_sandbox_deletes_total{backend="container",reason="timeout"} 1`,
		`shoal_api_requests_total{code="ok",procedure="/shoal.v1.SandboxService/CreateSandbox"} 1`,
		`shoal_test_sandboxes{state="running"} 2`,
		`shoal_e2b_requests_total{code="201",route="POST /sandboxes"} 1`,
		`shoal_e2b_request_seconds_count{route="POST /sandboxes"} 1`,
		`shoal_sandbox_pauses_total{backend="container",trigger="auto"} 1`,
		`shoal_sandbox_pauses_total{backend="container",trigger="request"} 1`,
		`shoal_sandbox_pause_seconds_count{backend="container"} 2`,
		`shoal_sandbox_resume_seconds_count{backend="container"} 1`,
		`shoal_sandbox_pause_reclaimed_bytes_total{backend="container"} 1.048576e+08`,
		"go_goroutines", "process_resident_memory_bytes",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("scrape lacks %q", want)
		}
	}
	if strings.Contains(out, `pooled="false"`) {
		t.Error("a failed create was observed in the latency histogram")
	}
	n = 5 // read at each scrape
	if out := scrape(t, m); !strings.Contains(out, `shoal_test_sandboxes{state="running"} 5`) {
		t.Error("gauge not read at scrape time")
	}
	var nilM *Metrics // tools and tests run without metrics
	nilM.Create("container", false, 0, "ok")
	nilM.Request("x", "ok", 0)
	nilM.E2BRequest("x", "200", 0)
	nilM.Pause("x", false, 0, 0)
	nilM.Resume("x", 0)
	if nilM.CreatesOK() != 0 || m.CreatesOK() != 1 {
		t.Errorf("CreatesOK: %d", m.CreatesOK())
	}
	nilM.Gauges("x", "x", nil, nil)
}
