package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// BurstOptions configure the burst benchmark.
type BurstOptions struct {
	Base        string        // base layer ref
	N           int           // rollouts: create, one command, delete
	Concurrency int           // rollouts in flight
	HangAfter   time.Duration // a create not answered by then counts as a hang
	DataDir     string        // the server's data dir (for the runc baseline)
	Runtime     string        // "runc"
	BaselineN   int           // `runc run` in the baseline (0: min(N, 200))
	// PythonBench, if set, is the Python SDK's bench.py: it runs the same
	// burst from the asyncio SDK and its JSON is included.
	PythonBench string
	// Progress, if set, is called as each of the Go SDK's rollouts ends
	// (done of N), from the rollouts' goroutines, one call at a time.
	Progress func(done, total int)
}

// BurstSide is one client's burst.
type BurstSide struct {
	Failures         int     `json:"failures"`
	Hangs            int     `json:"hangs"`
	FirstError       string  `json:"first_error,omitempty"`
	CreateFirstExec  Dist    `json:"create_to_first_exec"`
	CreatesPerSecond float64 `json:"creates_per_second"`
	Pooled           int     `json:"pooled"` // creates served from the warm pool
	Cold             int     `json:"cold"`   // creates that ran runc
}

// BurstResult is the JSON printed by `shoal bench burst`.
type BurstResult struct {
	Bench       string          `json:"bench"`
	N           int             `json:"n"`
	Concurrency int             `json:"concurrency"`
	Go          BurstSide       `json:"go"`
	Python      json.RawMessage `json:"python,omitempty"`
	// Baseline: `runc run` of /bin/true on the base image with the same
	// concurrency, in the same run.
	BaselineRuncRun          Dist    `json:"baseline_runc_run_true"`
	BaselineRunsPerSecond    float64 `json:"baseline_runc_runs_per_second"`
	RatioFirstExecP50        float64 `json:"ratio_first_exec_p50_vs_runc_run"`
	RatioCreatesPerSecondVsR float64 `json:"ratio_creates_per_second_vs_runc_run"`
}

// burstSettle separates the baseline from the burst.
const burstSettle = 3 * time.Second

// Burst runs `runc run` with C in flight for comparison, then N rollouts
// (create, run `true`, delete) with C in flight through the Go SDK, then
// (optionally) through the Python SDK.
func Burst(ctx context.Context, c *shoal.Client, o BurstOptions) (*BurstResult, error) {
	if o.N <= 0 || o.Concurrency <= 0 {
		return nil, fmt.Errorf("-n and -c must be positive")
	}
	if o.HangAfter <= 0 {
		o.HangAfter = 60 * time.Second
	}
	res := &BurstResult{Bench: "burst", N: o.N, Concurrency: o.Concurrency}
	base, err := c.Layers.GetLayer(ctx, connectReq(&pb.GetLayerRequest{Ref: o.Base}))
	if err != nil {
		return nil, fmt.Errorf("base layer %s: %w", o.Base, err)
	}
	// `runc run` first, on a host the burst has not loaded yet: after it,
	// the node tears down the burst's deleted sandboxes and refills its
	// pool, work a baseline run then would compete with.
	bn := o.BaselineN
	if bn <= 0 {
		bn = min(o.N, 200)
	}
	lat, rate, err := runcBaselineConcurrent(ctx, o.DataDir, o.Runtime, base.Msg.Digest, bn, o.Concurrency)
	if err != nil {
		return nil, fmt.Errorf("runc baseline: %w", err)
	}
	res.BaselineRuncRun, res.BaselineRunsPerSecond = dist(lat), rate
	// The kernel goes on tearing down the baseline's containers
	// (namespaces are freed by workers) after runc returns.
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(burstSettle):
	}
	res.Go = burstGo(ctx, c, o)
	if o.PythonBench != "" {
		cmd := exec.CommandContext(ctx, "/usr/bin/python3", o.PythonBench, "--burst", "-n", fmt.Sprint(o.N), "-c", fmt.Sprint(o.Concurrency), "--base", o.Base)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return nil, fmt.Errorf("python bench: %w: %s", err, stderr.Bytes())
		}
		res.Python = json.RawMessage(bytes.TrimSpace(out))
	}
	if res.BaselineRuncRun.P50 > 0 {
		res.RatioFirstExecP50 = math.Round(res.Go.CreateFirstExec.P50/res.BaselineRuncRun.P50*1000) / 1000
	}
	if rate > 0 {
		res.RatioCreatesPerSecondVsR = math.Round(res.Go.CreatesPerSecond/rate*100) / 100
	}
	return res, nil
}

func burstGo(ctx context.Context, c *shoal.Client, o BurstOptions) BurstSide {
	var (
		mu     sync.Mutex
		side   BurstSide
		firsts []time.Duration
	)
	fail := func(err error, hang bool) {
		mu.Lock()
		defer mu.Unlock()
		if hang {
			side.Hangs++
		} else {
			side.Failures++
		}
		if side.FirstError == "" {
			side.FirstError = err.Error()
		}
	}
	start := time.Now()
	var ended int
	parallel(o.N, o.Concurrency, func(int) {
		if o.Progress != nil {
			defer func() {
				mu.Lock()
				defer mu.Unlock()
				ended++
				o.Progress(ended, o.N)
			}()
		}
		t0 := time.Now()
		cctx, cancel := context.WithTimeout(ctx, o.HangAfter)
		sb, err := c.Create(cctx, &pb.CreateSandboxRequest{Base: o.Base, TimeoutSeconds: 600})
		cancel()
		if err != nil {
			fail(fmt.Errorf("create: %w", err), errors.Is(err, context.DeadlineExceeded) || cctx.Err() != nil)
			return
		}
		st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"true"}})
		d := time.Since(t0)
		mu.Lock()
		if sb.Runtime["pooled"] == "true" {
			side.Pooled++
		} else {
			side.Cold++
		}
		if err == nil && st.Code == 0 {
			firsts = append(firsts, d)
		}
		mu.Unlock()
		if err != nil {
			fail(fmt.Errorf("exec: %w", err), false)
		} else if st.Code != 0 {
			fail(fmt.Errorf("true exited %d", st.Code), false)
		}
		if err := c.Delete(context.Background(), sb.Id); err != nil {
			fail(fmt.Errorf("delete: %w", err), false)
		}
	})
	side.CreatesPerSecond = math.Round(float64(len(firsts))/time.Since(start).Seconds()*10) / 10
	side.CreateFirstExec = dist(firsts)
	return side
}

// runcBaselineConcurrent times n `runc run` of /bin/true on the base image
// (mounted read-only) with c in flight; it returns their latencies and the
// runs per second.
func runcBaselineConcurrent(ctx context.Context, dataDir, runtime, digest string, n, c int) ([]time.Duration, float64, error) {
	if runtime == "" {
		runtime = "runc"
	}
	hex := digest[len("sha256:"):]
	image := filepath.Join(dataDir, "layers", "blobs", "sha256", hex+".erofs")
	tmp, err := os.MkdirTemp("", "shoal-bench-")
	if err != nil {
		return nil, 0, err
	}
	defer os.RemoveAll(tmp)
	rootfs := filepath.Join(tmp, "rootfs")
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		return nil, 0, err
	}
	if err := unix.Mount(image, rootfs, "erofs", unix.MS_RDONLY, ""); err != nil {
		return nil, 0, fmt.Errorf("mount %s (is --data the server's data dir?): %w", image, err)
	}
	defer unix.Unmount(rootfs, unix.MNT_DETACH)
	spec := exec.CommandContext(ctx, runtime, "spec", "--bundle", tmp)
	if out, err := spec.CombinedOutput(); err != nil {
		return nil, 0, fmt.Errorf("runc spec: %v: %s", err, out)
	}
	if err := patchSpec(filepath.Join(tmp, "config.json")); err != nil {
		return nil, 0, err
	}
	state := filepath.Join(tmp, "state")
	var (
		mu    sync.Mutex
		out   []time.Duration
		first error
	)
	start := time.Now()
	parallel(n, c, func(i int) {
		id := fmt.Sprintf("shoal-burst-%d-%d", os.Getpid(), i)
		cmd := exec.CommandContext(ctx, runtime, "--root", state, "run", "--bundle", tmp, id)
		t0 := time.Now()
		b, err := cmd.CombinedOutput()
		d := time.Since(t0)
		mu.Lock()
		if err != nil && first == nil {
			first = fmt.Errorf("runc run: %v: %s", err, b)
		} else if err == nil {
			out = append(out, d)
		}
		mu.Unlock()
	})
	if first != nil {
		return nil, 0, first
	}
	return out, math.Round(float64(len(out))/time.Since(start).Seconds()*10) / 10, nil
}
