package e2e

import (
	"context"
	"errors"
	"os/exec"
	"sync"
	"testing"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// TestBurstUnderCPULoad: a burst of rollouts (create, one command, delete)
// with several in flight, while CPU hogs keep both cores busy, completes:
// every create answers, every command runs, nothing hangs. (About 1 create
// in 400 used to hang forever under such load: see the container backend's
// claim and the agent's lifeline watch.) Timing is not asserted; a create
// not answered within a minute counts as a hang.
func TestBurstUnderCPULoad(t *testing.T) {
	need(t)
	if testing.Short() {
		t.Skip("a burst of 500 rollouts")
	}
	const n, inFlight = 500, 8
	// Two busy loops at normal priority, killed when the test ends.
	for range 2 {
		hog := exec.Command("sh", "-c", "while :; do :; done")
		if err := hog.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { hog.Process.Kill(); hog.Wait() })
	}
	c := sdk(t)
	var (
		mu             sync.Mutex
		errs           []error
		hangs, pooled  int
		wg             sync.WaitGroup
		work           = make(chan int)
		ctx, cancelAll = context.WithTimeout(context.Background(), 10*time.Minute)
	)
	defer cancelAll()
	fail := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}
	for range inFlight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range work {
				cctx, cancel := context.WithTimeout(ctx, time.Minute)
				sb, err := c.Create(cctx, &pb.CreateSandboxRequest{Base: baseRef, TimeoutSeconds: 600})
				cancel()
				if err != nil {
					if errors.Is(cctx.Err(), context.DeadlineExceeded) {
						mu.Lock()
						hangs++
						mu.Unlock()
					}
					fail(err)
					continue
				}
				if sb.Runtime["pooled"] == "true" {
					mu.Lock()
					pooled++
					mu.Unlock()
				}
				st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"true"}})
				if err != nil {
					fail(err)
				} else if st.Code != 0 {
					fail(errors.New("true exited non-zero"))
				}
				if err := c.Delete(context.Background(), sb.Id); err != nil {
					fail(err)
				}
			}
		}()
	}
	start := time.Now()
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	t.Logf("%d rollouts, %d in flight, under 2 CPU hogs: %v, %d from the pool", n, inFlight, time.Since(start).Round(time.Millisecond), pooled)
	if hangs > 0 || len(errs) > 0 {
		t.Fatalf("%d hangs, %d errors; first: %v", hangs, len(errs), errs[0])
	}
}
