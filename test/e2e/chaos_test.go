package e2e

import (
	"context"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/bench"
)

// 2,000 random and malformed requests (SHOAL_CHAOS_N to change) against
// the real serve: no 5xx, no crash, and it still creates and execs
// afterwards. `shoal bench fuzz -n 10000` is the long run.
func TestChaosRequests(t *testing.T) {
	need(t)
	n := 2000
	if v, err := strconv.Atoi(os.Getenv("SHOAL_CHAOS_N")); err == nil && v > 0 {
		n = v
	}
	id := create(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	res, err := bench.Chaos(ctx, bench.ChaosOptions{URL: apiURL, APIKey: apiKey, N: n, Concurrency: 8, SandboxID: id, Seed: uint64(time.Now().UnixNano())})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("seed %d: %d requests in %.1f s, by status %v, %d client timeouts/resets", res.Seed, res.Requests, res.Took, res.ByStatus, res.ClientEnds)
	if res.ServerErrors != 0 {
		t.Errorf("%d server errors (seed %d):\n%s", res.ServerErrors, res.Seed, strings.Join(res.Samples, "\n"))
	}
	if !res.HealthyAfter {
		t.Fatal("serve does not answer /healthz after the run")
	}
	if err := serveCmd.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("serve is gone: %v", err)
	}
	id2 := create(t)
	if out, code := run(nil, "exec", id2, "--", "echo", "still-serving"); code != 0 || strings.TrimSpace(out) != "still-serving" {
		t.Fatalf("exec after the run: %d %q", code, out)
	}
}
