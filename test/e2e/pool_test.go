package e2e

import (
	"io"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// metric reads one sample of /metrics (name with its labels, as printed),
// -1 when it is absent.
func metric(t *testing.T, sample string) float64 {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, apiURL+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer "+apiKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, sample+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("/metrics: %q: %v", line, err)
			}
			return f
		}
	}
	return -1
}

// TestPoolFilledAtStart: a serve fills its warm pool from its start (here
// a restart), not from the first create: the first create after it is
// served from the pool (a claim, no miss, and the sandbox says pooled).
func TestPoolFilledAtStart(t *testing.T) {
	need(t)
	serveCmd.Process.Signal(syscall.SIGTERM)
	serveCmd.Wait()
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "the pool to fill after a restart, with no create", func() bool {
		return metric(t, `shoal_pool_containers{kind="ready"}`) >= 1
	})
	if claims, misses := metric(t, `shoal_pool_events_total{event="claims"}`), metric(t, `shoal_pool_events_total{event="misses"}`); claims != 0 || misses != 0 {
		t.Fatalf("before the first create: %v claims, %v misses", claims, misses)
	}
	id := create(t)
	sb := getSandbox(t, sdk(t), id)
	if sb.Runtime["pooled"] != "true" {
		t.Errorf("the first create after a restart was not served from the pool: runtime %v", sb.Runtime)
	}
	if claims, misses := metric(t, `shoal_pool_events_total{event="claims"}`), metric(t, `shoal_pool_events_total{event="misses"}`); claims != 1 || misses != 0 {
		t.Errorf("after the first create: %v claims, %v misses; want 1 and 0", claims, misses)
	}
}
