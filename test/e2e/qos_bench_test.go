package e2e

import (
	"encoding/json"
	"testing"
)

// TestBenchQoS runs `shoal bench qos` at a small scale through the CLI:
// every phase has its execs, in the sandbox and on the host (the floor the
// ratio is read against), and the best-effort burners did work. The
// numbers are the README's, from full runs on a quiet host.
func TestBenchQoS(t *testing.T) {
	need(t)
	out, stderr, code := run3(nil, "bench", "qos", "-n", "10", "--burners", "2", "--duration", "6s", "--base", baseRef)
	if code != 0 {
		t.Fatalf("bench qos exited %d: %s\n%s", code, stderr, out)
	}
	type dist struct {
		N   int     `json:"n"`
		P99 float64 `json:"p99_ms"`
	}
	var res struct {
		Unloaded  dist    `json:"ls_exec_unloaded"`
		BE        dist    `json:"ls_exec_with_be_burners"`
		LS        dist    `json:"ls_exec_with_ls_burners"`
		Host      dist    `json:"host_exec_unloaded"`
		HostBE    dist    `json:"host_exec_with_be_burners"`
		HostRatio float64 `json:"ratio_p99_host_with_be_vs_unloaded"`
		BEWork    float64 `json:"be_burner_iterations_per_s"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("bench qos output: %v\n%s", err, out)
	}
	for name, d := range map[string]dist{"unloaded": res.Unloaded, "host unloaded": res.Host} {
		if d.N != 10 || d.P99 <= 0 {
			t.Errorf("%s: %+v, want 10 execs", name, d)
		}
	}
	for name, d := range map[string]dist{"with BE burners": res.BE, "with LS burners": res.LS, "host with BE burners": res.HostBE} {
		if d.N != 20 || d.P99 <= 0 {
			t.Errorf("%s: %+v, want 20 execs (two rounds)", name, d)
		}
	}
	if res.HostRatio <= 0 || res.BEWork <= 0 {
		t.Errorf("host ratio %v, best-effort work %v/s: want both measured\n%s", res.HostRatio, res.BEWork, out)
	}
	t.Logf("LS exec p99 %.1f ms alone, %.1f ms beside best-effort burners; the host's fork+exec ratio %.2f", res.Unloaded.P99, res.BE.P99, res.HostRatio)
}
