package bench

import (
	"context"
	"fmt"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// ResetOptions configures `shoal bench reset`.
type ResetOptions struct {
	Base string // base layer ref (needs sh)
	N    int    // rounds of each
	// DirtyMiB: bytes each round writes into the sandbox (files in /work,
	// /tmp and /dev/shm) before it is reset or replaced.
	DirtyMiB int
}

// ResetResult is the JSON printed by `shoal bench reset`: an in-place
// reset and a delete + (pooled) create, each followed by the first exec
// of the sandbox it leaves, in the same run on the same node.
type ResetResult struct {
	Bench    string `json:"bench"`
	N        int    `json:"n"`
	DirtyMiB int    `json:"dirty_mib"`
	// ResetFirstExec: ResetSandbox + the first exec after it, as a client
	// sees it; Reset the ResetSandbox call alone; ResetBackend the
	// backend's part as the node measured it.
	ResetFirstExec Dist `json:"reset_first_exec"`
	Reset          Dist `json:"reset"`
	ResetBackend   Dist `json:"reset_backend"`
	// RecreateFirstExec: DeleteSandbox + CreateSandbox (from the warm pool
	// where the node has one) + the first exec.
	RecreateFirstExec Dist `json:"recreate_first_exec"`
	Pooled            int  `json:"recreates_pooled"`
	// Ratio: p50 of ResetFirstExec over p50 of RecreateFirstExec.
	Ratio float64 `json:"ratio_p50"`
}

// Reset measures reset → first exec against delete + create → first exec,
// interleaved so that both see the same load.
func Reset(ctx context.Context, c *shoal.Client, o ResetOptions) (*ResetResult, error) {
	if o.N <= 0 || o.DirtyMiB < 0 {
		return nil, fmt.Errorf("bench reset: -n must be positive and --dirty-mib not negative")
	}
	req := func() *pb.CreateSandboxRequest {
		return &pb.CreateSandboxRequest{Base: o.Base, TimeoutSeconds: 600}
	}
	dirty := []string{"sh", "-c", fmt.Sprintf("head -c %d /dev/zero > /work/f; echo t > /tmp/t; echo s > /dev/shm/s", o.DirtyMiB<<20)}
	first := shoal.ExecOptions{Args: []string{"true"}}
	sb, err := c.Create(ctx, req())
	if err != nil {
		return nil, err
	}
	keep := sb.Id
	var other string
	defer func() {
		c.Delete(context.Background(), keep)
		if other != "" {
			c.Delete(context.Background(), other)
		}
	}()
	if sb, err = c.Create(ctx, req()); err != nil {
		return nil, err
	}
	other = sb.Id
	res := &ResetResult{Bench: "reset", N: o.N, DirtyMiB: o.DirtyMiB}
	var resets, calls, backend, recreates []time.Duration
	step := progress(ctx, "rounds", o.N)
	for i := 0; i < o.N; i++ {
		// In place.
		if _, err := c.Exec(ctx, keep, shoal.ExecOptions{Args: dirty}); err != nil {
			return nil, err
		}
		t := time.Now()
		_, took, err := c.Reset(ctx, keep)
		if err != nil {
			return nil, err
		}
		calls = append(calls, time.Since(t))
		if _, err := c.Exec(ctx, keep, first); err != nil {
			return nil, err
		}
		resets = append(resets, time.Since(t))
		backend = append(backend, took)
		// Replaced.
		if _, err := c.Exec(ctx, other, shoal.ExecOptions{Args: dirty}); err != nil {
			return nil, err
		}
		t = time.Now()
		if err := c.Delete(ctx, other); err != nil {
			return nil, err
		}
		other = ""
		sb, err := c.Create(ctx, req())
		if err != nil {
			return nil, err
		}
		other = sb.Id
		if _, err := c.Exec(ctx, other, first); err != nil {
			return nil, err
		}
		recreates = append(recreates, time.Since(t))
		if sb.Runtime["pooled"] == "true" {
			res.Pooled++
		}
		step()
	}
	res.ResetFirstExec, res.Reset, res.ResetBackend = dist(resets), dist(calls), dist(backend)
	res.RecreateFirstExec = dist(recreates)
	if res.RecreateFirstExec.P50 > 0 {
		res.Ratio = res.ResetFirstExec.P50 / res.RecreateFirstExec.P50
	}
	return res, nil
}
