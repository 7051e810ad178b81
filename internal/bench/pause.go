package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// PauseOptions configure the pause benchmark.
type PauseOptions struct {
	Base        string // base layer ref (needs sh, head, base64, tr)
	N           int    // sandboxes
	MiB         int    // random bytes each one's resident shell holds (as base64 text, ~1.35x)
	Concurrency int    // creates in flight while setting up
	Pausers     int    // pauses in flight (default 1)
}

// PauseResult is the JSON printed by `shoal bench pause`.
type PauseResult struct {
	Bench string `json:"bench"`
	N     int    `json:"n"`
	MiB   int    `json:"mib_each"`
	// Pause is the PauseSandbox call (freeze + reclaim) per sandbox;
	// Freeze and Reclaim its parts as the node measured them.
	Pause   Dist `json:"pause"`
	Freeze  Dist `json:"freeze"`
	Reclaim Dist `json:"reclaim"`
	// Memory of all the sandboxes' cgroups before and after their pause,
	// and what went to swap.
	MemoryBefore int64  `json:"memory_before_bytes"`
	MemoryAfter  int64  `json:"memory_after_bytes"`
	SwappedOut   int64  `json:"swapped_out_bytes"`
	Method       string `json:"method"` // of the first sandbox
	// PauseSecondsPerGiB: the pause calls' summed time over GiB
	// reclaimed; PauseWallSecondsPerGiB: the wall time of pausing them
	// all (Pausers at a time) over it, the node's throughput.
	PauseSecondsPerGiB     float64 `json:"pause_seconds_per_gib_reclaimed"`
	PauseWallSecondsPerGiB float64 `json:"pause_wall_seconds_per_gib_reclaimed"`
	Pausers                int     `json:"pausers"`
	// ResumeFirstExec: an exec (`true`) sent to a paused sandbox, which
	// resumes it transparently, until its exit came back; one at a time.
	ResumeFirstExec Dist `json:"resume_first_exec"`
	// ResumeBackend: the node's resume alone (thaw, and prefetch if on).
	ResumeBackend Dist `json:"resume_backend"`
	// ExecRunning: the same exec on the running sandbox, for comparison.
	ExecRunning Dist `json:"exec_running"`
	// ResumeTouchAll: a command sent to a paused sandbox that has its
	// shell read all its memory (back from swap), until it is done;
	// TouchAllRunning: the same on the running sandbox (memory resident).
	ResumeTouchAll  Dist `json:"resume_touch_all"`
	TouchAllRunning Dist `json:"touch_all_running"`
}

// Pause measures pause+reclaim time and resume→first exec latency over N
// sandboxes, each with a shell holding MiB of random data.
func Pause(ctx context.Context, c *shoal.Client, o PauseOptions) (*PauseResult, error) {
	if o.N <= 0 || o.MiB <= 0 || o.Concurrency <= 0 {
		return nil, fmt.Errorf("bench pause: -n, --mib and -c must be positive")
	}
	ids := make([]string, o.N)
	var mu sync.Mutex
	var firstErr error
	defer func() {
		parallel(len(ids), 4, func(i int) {
			if ids[i] != "" {
				c.Delete(context.Background(), ids[i])
			}
		})
	}()
	zero := int64(0)
	// The shell holds the data; each line written to /tmp/f makes it read
	// all of it (${#x}) and write its length to /tmp/len.
	script := fmt.Sprintf(`x=$(head -c %d /dev/urandom | base64 | tr -d '\n'); mkfifo /tmp/f; echo ready >/tmp/ready; while :; do read l </tmp/f; echo ${#x} >/tmp/len; done`, o.MiB<<20)
	setup := progress(ctx, "create", o.N)
	parallel(o.N, o.Concurrency, func(i int) {
		defer setup()
		sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: o.Base, TimeoutSeconds: 3600,
			MemoryBytes: int64(4*o.MiB+128) << 20, AutoPauseSeconds: &zero})
		if err == nil {
			mu.Lock()
			ids[i] = sb.Id
			mu.Unlock()
			// In the background, left by a command that ends: the
			// sandbox has no running command.
			_, err = c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"sh", "-c", "(" + script + ") >/dev/null 2>&1 &"}})
		}
		if err == nil {
			err = waitReady(ctx, c, sb.Id)
		}
		if err != nil {
			mu.Lock()
			if firstErr == nil {
				firstErr = err
			}
			mu.Unlock()
		}
	})
	if firstErr != nil {
		return nil, firstErr
	}
	res := &PauseResult{Bench: "pause", N: o.N, MiB: o.MiB}
	var running, pauses, freezes, reclaims, resumes, backend []time.Duration
	for _, id := range ids {
		t := time.Now()
		if _, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"true"}}); err != nil {
			return nil, err
		}
		running = append(running, time.Since(t))
	}
	var total time.Duration
	res.Pausers = max(o.Pausers, 1)
	wall := time.Now()
	parallel(len(ids), res.Pausers, func(i int) {
		t := time.Now()
		sb, _, err := c.Pause(ctx, ids[i])
		d := time.Since(t)
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			return
		}
		total += d
		pauses = append(pauses, d)
		p := sb.Pause
		freezes = append(freezes, time.Duration(p.FreezeSeconds*float64(time.Second)))
		reclaims = append(reclaims, time.Duration(p.ReclaimSeconds*float64(time.Second)))
		res.MemoryBefore += p.MemoryBeforeBytes
		res.MemoryAfter += p.MemoryAfterBytes
		res.SwappedOut += p.SwappedOutBytes
		if res.Method == "" {
			res.Method = p.Method
		}
	})
	if firstErr != nil {
		return nil, firstErr
	}
	if gib := float64(res.MemoryBefore-res.MemoryAfter) / (1 << 30); gib > 0 {
		res.PauseSecondsPerGiB = total.Seconds() / gib
		res.PauseWallSecondsPerGiB = time.Since(wall).Seconds() / gib
	}
	for _, id := range ids {
		t := time.Now()
		if _, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"true"}}); err != nil {
			return nil, err
		}
		resumes = append(resumes, time.Since(t))
		sb, err := c.Get(ctx, id)
		if err != nil {
			return nil, err
		}
		if sb.State != pb.SandboxState_SANDBOX_STATE_RUNNING {
			return nil, fmt.Errorf("sandbox %s is %s after an exec", id, sb.State)
		}
		if sb.Pause != nil {
			backend = append(backend, time.Duration(sb.Pause.ResumeSeconds*float64(time.Second)))
		}
	}
	// Pause them all again, then resume each by a command that makes its
	// shell read all its memory back.
	for _, id := range ids {
		if _, _, err := c.Pause(ctx, id); err != nil {
			return nil, err
		}
	}
	var touches []time.Duration
	touch := []string{"sh", "-c", "rm -f /tmp/len; echo go >/tmp/f; while [ ! -s /tmp/len ]; do :; done"}
	for _, id := range ids {
		t := time.Now()
		if _, err := c.Exec(ctx, id, shoal.ExecOptions{Args: touch}); err != nil {
			return nil, err
		}
		touches = append(touches, time.Since(t))
	}
	// The same on running sandboxes, memory resident.
	var touchesRunning []time.Duration
	for _, id := range ids {
		t := time.Now()
		if _, err := c.Exec(ctx, id, shoal.ExecOptions{Args: touch}); err != nil {
			return nil, err
		}
		touchesRunning = append(touchesRunning, time.Since(t))
	}
	res.ResumeTouchAll, res.TouchAllRunning = dist(touches), dist(touchesRunning)
	res.Pause, res.Freeze, res.Reclaim = dist(pauses), dist(freezes), dist(reclaims)
	res.ResumeFirstExec, res.ResumeBackend, res.ExecRunning = dist(resumes), dist(backend), dist(running)
	return res, nil
}

// waitReady waits for the resident shell to hold its data.
func waitReady(ctx context.Context, c *shoal.Client, id string) error {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		st, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"test", "-e", "/tmp/ready"}})
		if err != nil {
			return err
		}
		if st.Code == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("sandbox %s: its resident shell is not ready after 5 minutes", id)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
