package bench

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// QoSOptions configure the CPU classes benchmark.
type QoSOptions struct {
	Base     string
	N        int           // execs of `true` in the latency-sensitive sandbox per phase
	Burners  int           // sandboxes burning CPU (default: 2 per CPU)
	Duration time.Duration // how long the burners burn per phase
}

// QoSResult is the JSON printed by `shoal bench qos`.
type QoSResult struct {
	Bench   string `json:"bench"`
	N       int    `json:"n"`
	Burners int    `json:"burners"`
	CPUs    int    `json:"cpus"`
	// Exec latency in a latency-sensitive sandbox: alone, while best-effort
	// sandboxes burn every CPU, and while the same burners run as
	// latency-sensitive sandboxes (what a node without CPU classes does).
	Unloaded   Dist    `json:"ls_exec_unloaded"`
	BEBurning  Dist    `json:"ls_exec_with_be_burners"`
	LSBurning  Dist    `json:"ls_exec_with_ls_burners"`
	RatioBEP99 float64 `json:"ratio_p99_with_be_vs_unloaded"`
	RatioLSP99 float64 `json:"ratio_p99_with_ls_vs_unloaded"`
	// The burners' work (loop iterations per second, all burners) as
	// best-effort and as latency-sensitive: how much of the spare CPU
	// best-effort work keeps while latency-sensitive commands run.
	BEWorkRate float64 `json:"be_burner_iterations_per_s"`
	LSWorkRate float64 `json:"ls_burner_iterations_per_s"`
	BEWorkKept float64 `json:"be_work_vs_ls_work"`
}

// QoS measures what CPU classes buy: the exec latency of a latency-
// sensitive sandbox while best-effort sandboxes burn every CPU, against
// the same burners as latency-sensitive sandboxes, and the work the
// best-effort burners still get done.
func QoS(ctx context.Context, c *shoal.Client, o QoSOptions) (*QoSResult, error) {
	if o.N <= 0 {
		return nil, fmt.Errorf("-n must be positive")
	}
	if o.Burners <= 0 {
		o.Burners = 2 * runtime.NumCPU()
	}
	if o.Duration <= 0 {
		o.Duration = 10 * time.Second
	}
	res := &QoSResult{Bench: "qos", N: o.N, Burners: o.Burners, CPUs: runtime.NumCPU()}
	ls, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: o.Base, TimeoutSeconds: 600})
	if err != nil {
		return nil, err
	}
	defer c.Delete(context.Background(), ls.Id)
	execs := func() ([]time.Duration, error) {
		var ds []time.Duration
		for i := 0; i < o.N; i++ {
			t0 := time.Now()
			st, err := c.Exec(ctx, ls.Id, shoal.ExecOptions{Args: []string{"true"}})
			if err != nil {
				return nil, err
			}
			if st.Code != 0 {
				return nil, fmt.Errorf("true exited %d", st.Code)
			}
			ds = append(ds, time.Since(t0))
		}
		return ds, nil
	}
	// The burners of both classes are made first, so that no create (nor
	// the warm pool refilling after them) runs during a measurement.
	sets := map[string][]string{}
	defer func() {
		for _, ids := range sets {
			for _, id := range ids {
				c.Delete(context.Background(), id)
			}
		}
	}()
	for _, qos := range []string{"be", "ls"} {
		for range o.Burners {
			sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: o.Base, Qos: qos, TimeoutSeconds: 600})
			if err != nil {
				return nil, err
			}
			sets[qos] = append(sets[qos], sb.Id)
		}
	}
	time.Sleep(15 * time.Second)       // the pool's urgent refill (10 s) is over
	if _, err := execs(); err != nil { // warm-up
		return nil, err
	}
	unloaded, err := execs()
	if err != nil {
		return nil, err
	}
	res.Unloaded = dist(unloaded)
	// burn runs the burners of a class for o.Duration while the
	// latency-sensitive sandbox runs its execs; it returns their latency
	// and the burners' iterations per second.
	burn := func(qos string) ([]time.Duration, float64, error) {
		ids := sets[qos]
		secs := int(math.Ceil(o.Duration.Seconds()))
		script := fmt.Sprintf(`n=0; trap 'echo $n; exit 0' TERM; (sleep %d; kill -TERM $$) & while :; do n=$((n+1)); done`, secs)
		var wg sync.WaitGroup
		counts := make([]int64, len(ids))
		errs := make([]error, len(ids))
		for i, id := range ids {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var out bytes.Buffer
				_, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"sh", "-c", script}, Stdout: &out})
				if err == nil {
					counts[i], err = strconv.ParseInt(strings.TrimSpace(out.String()), 10, 64)
				}
				errs[i] = err
			}()
		}
		time.Sleep(o.Duration / 5) // the burners are burning
		d, err := execs()
		wg.Wait()
		if err != nil {
			return nil, 0, err
		}
		var total int64
		for i := range counts {
			if errs[i] != nil {
				return nil, 0, fmt.Errorf("burner: %w", errs[i])
			}
			total += counts[i]
		}
		return d, float64(total) / float64(secs), nil
	}
	// Alternating rounds (be, ls, ls, be), so that a host whose load
	// drifts during the run favours neither class.
	var beD, lsD []time.Duration
	var beW, lsW float64
	for _, qos := range []string{"be", "ls", "ls", "be"} {
		d, w, err := burn(qos)
		if err != nil {
			return nil, err
		}
		if qos == "be" {
			beD, beW = append(beD, d...), beW+w/2
		} else {
			lsD, lsW = append(lsD, d...), lsW+w/2
		}
	}
	res.BEBurning, res.LSBurning = dist(beD), dist(lsD)
	res.BEWorkRate, res.LSWorkRate = math.Round(beW), math.Round(lsW)
	ratio := func(a, b float64) float64 {
		if b == 0 {
			return 0
		}
		return math.Round(a/b*100) / 100
	}
	res.RatioBEP99 = ratio(res.BEBurning.P99, res.Unloaded.P99)
	res.RatioLSP99 = ratio(res.LSBurning.P99, res.Unloaded.P99)
	res.BEWorkKept = ratio(res.BEWorkRate, res.LSWorkRate)
	return res, nil
}
