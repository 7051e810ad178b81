package bench

import (
	"context"
	"fmt"
	"math"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/agent"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// ExecOptions configure the exec benchmark.
type ExecOptions struct {
	Base    string
	N       int
	DataDir string
	Runtime string
}

// ExecResult is the JSON printed by `shoal bench exec`.
type ExecResult struct {
	Bench string `json:"bench"`
	N     int    `json:"n"`
	// API: `true` through the API (SDK → serve → agent → fork/exec → exit).
	API Dist `json:"exec_api"`
	// Agent: the same through the agent's socket directly (no API hop).
	Agent Dist `json:"exec_agent_direct"`
	// Baseline: `runc exec <sandbox> /bin/true` on the same container.
	BaselineRuncExec Dist    `json:"baseline_runc_exec_true"`
	BaselineError    string  `json:"baseline_error,omitempty"`
	RatioAPIP50      float64 `json:"ratio_api_p50_vs_runc_exec"`
}

// Exec measures the round trip of running `true` in one sandbox.
func Exec(ctx context.Context, c *shoal.Client, o ExecOptions) (*ExecResult, error) {
	if o.N <= 0 {
		return nil, fmt.Errorf("-n must be positive")
	}
	if o.Runtime == "" {
		o.Runtime = "runc"
	}
	sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: o.Base, TimeoutSeconds: 600})
	if err != nil {
		return nil, err
	}
	defer c.Delete(context.Background(), sb.Id)
	res := &ExecResult{Bench: "exec", N: o.N}

	var api []time.Duration
	step := progress(ctx, "exec", o.N+5)
	for i := 0; i < o.N+5; i++ {
		step()
		t0 := time.Now()
		st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"true"}})
		if err != nil {
			return nil, err
		}
		if st.Code != 0 {
			return nil, fmt.Errorf("true exited %d", st.Code)
		}
		if i >= 5 { // warm-up
			api = append(api, time.Since(t0))
		}
	}
	res.API = dist(api)

	ag := agent.NewClient(sb.Runtime["agent_socket"])
	var direct []time.Duration
	step = progress(ctx, "agent", o.N)
	for i := 0; i < o.N; i++ {
		step()
		t0 := time.Now()
		p, err := ag.Exec(ctx, agent.ExecRequest{Args: []string{"true"}})
		if err != nil {
			return nil, fmt.Errorf("agent exec (is --data the server's data dir?): %w", err)
		}
		for {
			ev, err := p.Recv()
			if err != nil {
				p.Close()
				return nil, err
			}
			if ev.Kind == agent.EventExit {
				break
			}
		}
		p.Close()
		direct = append(direct, time.Since(t0))
	}
	res.Agent = dist(direct)

	var runc []time.Duration
	step = progress(ctx, "runc", o.N)
	for i := 0; i < o.N; i++ {
		step()
		cmd := exec.CommandContext(ctx, o.Runtime, "--root", filepath.Join(o.DataDir, "runc"), "exec", sb.Runtime["runc_id"], "/bin/true")
		t0 := time.Now()
		if out, err := cmd.CombinedOutput(); err != nil {
			// runc 1.1 cannot exec into a sandbox that came from the warm
			// pool (its root was switched after runc started it): report it
			// rather than fail the benchmark.
			res.BaselineError = fmt.Sprintf("runc exec: %v: %s", err, strings.TrimSpace(string(out)))
			break
		}
		runc = append(runc, time.Since(t0))
	}
	res.BaselineRuncExec = dist(runc)
	if res.BaselineRuncExec.P50 > 0 {
		res.RatioAPIP50 = math.Round(res.API.P50/res.BaselineRuncExec.P50*100) / 100
	}
	return res, nil
}
