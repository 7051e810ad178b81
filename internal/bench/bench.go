// Package bench holds Shoal's benchmarks. Each one drives a running `shoal
// serve` through the Go SDK, measures a baseline with the plain OCI runtime
// on the same machine in the same run, and returns a JSON-ready result.
// Benchmarks are programs, not timed test assertions: the machine is noisy.
package bench

import (
	"context"
	"fmt"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// Dist summarizes a set of durations in milliseconds.
type Dist struct {
	N    int     `json:"n"`
	P50  float64 `json:"p50_ms"`
	P90  float64 `json:"p90_ms"`
	P95  float64 `json:"p95_ms"`
	P99  float64 `json:"p99_ms"`
	Mean float64 `json:"mean_ms"`
	Max  float64 `json:"max_ms"`
}

func dist(ds []time.Duration) Dist {
	if len(ds) == 0 {
		return Dist{}
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	ms := func(d time.Duration) float64 { return math.Round(float64(d.Microseconds())) / 1000 }
	q := func(p float64) float64 { return ms(s[int(math.Ceil(p*float64(len(s))))-1]) }
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	return Dist{N: len(s), P50: q(0.5), P90: q(0.9), P95: q(0.95), P99: q(0.99), Mean: ms(sum / time.Duration(len(s))), Max: ms(s[len(s)-1])}
}

// parallel calls fn(i) for i in [0, n) from c goroutines and returns once
// every call has returned.
// ProgressFunc hears how far a benchmark is: done of total steps of a
// stage ("create", "exec", ...). It may be called from several goroutines
// at once.
type ProgressFunc func(stage string, done, total int)

type progressKey struct{}

// WithProgress returns ctx carrying fn: the benchmarks run with it report
// their long loops to it (the CLI draws a bar on stderr).
func WithProgress(ctx context.Context, fn ProgressFunc) context.Context {
	return context.WithValue(ctx, progressKey{}, fn)
}

// progress returns a step counter of stage: each call counts one step
// done and reports it to ctx's ProgressFunc, if any.
func progress(ctx context.Context, stage string, total int) func() {
	fn, _ := ctx.Value(progressKey{}).(ProgressFunc)
	if fn == nil {
		return func() {}
	}
	fn(stage, 0, total)
	var n atomic.Int64
	return func() { fn(stage, int(n.Add(1)), total) }
}

func parallel(n, c int, fn func(i int)) {
	work := make(chan int)
	var wg sync.WaitGroup
	for range c {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				fn(i)
			}
		}()
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
}

// CreateOptions configure the create benchmark.
type CreateOptions struct {
	Base        string // base layer ref
	N           int    // sandboxes to create
	Concurrency int    // creates in flight
	DataDir     string // the server's data dir (for the runc baseline)
	Runtime     string // "runc"
	// AllowOut gives every sandbox network egress to these (CIDR[:PORT]);
	// none: no network.
	AllowOut []string
}

// CreateResult is the JSON printed by `shoal bench create`.
type CreateResult struct {
	Bench            string  `json:"bench"`
	N                int     `json:"n"`
	Concurrency      int     `json:"concurrency"`
	Create           Dist    `json:"create"`
	CreateFirstExec  Dist    `json:"create_to_first_exec"`
	Delete           Dist    `json:"delete"`
	CreatesPerSecond float64 `json:"creates_per_second"`
	Errors           int     `json:"errors"`
	FirstError       string  `json:"first_error,omitempty"`
	// Pooled: creates served from the warm pool (a serve fills it from its
	// start, so the first creates after a start or restart count here
	// once it has filled); Cold: the others.
	Pooled int `json:"pooled"`
	Cold   int `json:"cold"`
	// Baseline: `runc run` of /bin/true on the same base image, mounted
	// read-only (no overlay, no seccomp, no agent), serially.
	BaselineRuncRun Dist `json:"baseline_runc_run_true"`
	// RatioFirstExecP50 is create→first exec p50 over the baseline p50.
	RatioFirstExecP50 float64 `json:"ratio_first_exec_p50_vs_runc_run"`
}

// Create measures sandbox creation through the API.
func Create(ctx context.Context, c *shoal.Client, o CreateOptions) (*CreateResult, error) {
	if o.N <= 0 || o.Concurrency <= 0 {
		return nil, fmt.Errorf("-n and -c must be positive")
	}
	res := &CreateResult{Bench: "create", N: o.N, Concurrency: o.Concurrency}
	base, err := c.Layers.GetLayer(ctx, connectReq(&pb.GetLayerRequest{Ref: o.Base}))
	if err != nil {
		return nil, fmt.Errorf("base layer %s: %w", o.Base, err)
	}
	baseline, err := runcBaseline(ctx, o.DataDir, o.Runtime, base.Msg.Digest, 20)
	if err != nil {
		return nil, fmt.Errorf("runc baseline: %w", err)
	}
	res.BaselineRuncRun = dist(baseline)

	var (
		mu                    sync.Mutex
		creates, firsts, dels []time.Duration
		ids                   []string
	)
	fail := func(err error) {
		mu.Lock()
		res.Errors++
		if res.FirstError == "" {
			res.FirstError = err.Error()
		}
		mu.Unlock()
	}
	start := time.Now()
	step := progress(ctx, "create", o.N)
	parallel(o.N, o.Concurrency, func(int) {
		defer step()
		t0 := time.Now()
		req := &pb.CreateSandboxRequest{Base: o.Base, TimeoutSeconds: 600}
		if len(o.AllowOut) > 0 {
			req.Network = &pb.NetworkPolicy{AllowOut: o.AllowOut}
		}
		sb, err := c.Create(ctx, req)
		if err != nil {
			fail(err)
			return
		}
		t1 := time.Now()
		st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"true"}})
		t2 := time.Now()
		mu.Lock()
		ids = append(ids, sb.Id)
		creates = append(creates, t1.Sub(t0))
		if sb.Runtime["pooled"] == "true" {
			res.Pooled++
		} else {
			res.Cold++
		}
		if err == nil && st.Code == 0 {
			firsts = append(firsts, t2.Sub(t0))
		}
		mu.Unlock()
		if err != nil {
			fail(err)
		} else if st.Code != 0 {
			fail(fmt.Errorf("true exited %d", st.Code))
		}
	})
	elapsed := time.Since(start)
	res.CreatesPerSecond = math.Round(float64(len(creates))/elapsed.Seconds()*10) / 10
	res.Create = dist(creates)
	res.CreateFirstExec = dist(firsts)

	// Clean up with the same concurrency, measuring delete.
	delStep := progress(ctx, "delete", len(ids))
	parallel(len(ids), o.Concurrency, func(i int) {
		defer delStep()
		t0 := time.Now()
		if err := c.Delete(context.Background(), ids[i]); err != nil {
			fail(err)
			return
		}
		mu.Lock()
		dels = append(dels, time.Since(t0))
		mu.Unlock()
	})
	res.Delete = dist(dels)
	if res.BaselineRuncRun.P50 > 0 {
		res.RatioFirstExecP50 = math.Round(res.CreateFirstExec.P50/res.BaselineRuncRun.P50*100) / 100
	}
	return res, nil
}

// runcBaseline mounts the base image read-only and times `runc run` of
// /bin/true on it n times, one at a time.
func runcBaseline(ctx context.Context, dataDir, runtime, digest string, n int) ([]time.Duration, error) {
	lat, _, err := runcBaselineConcurrent(ctx, dataDir, runtime, digest, n, 1)
	return lat, err
}
