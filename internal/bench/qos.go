package bench

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os/exec"
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
	// The same host's floor: the bench process itself (a host process at
	// nice 0, no sandbox, no API) runs `true` the way the agent runs a
	// command (fork and exec from a Go process), interleaved one for one
	// with the sandbox's execs, alone and beside the best-effort burners.
	// What the burners cost a process no CPU class can shield: work
	// the other CPUs do that slows this one (a virtual machine's TLB
	// flushes that wait for a busy vCPU, shared caches and memory).
	HostUnloaded   Dist    `json:"host_exec_unloaded"`
	HostBEBurning  Dist    `json:"host_exec_with_be_burners"`
	RatioHostBEP99 float64 `json:"ratio_p99_host_with_be_vs_unloaded"`
	// The burners' work (loop iterations per second, all burners) as
	// best-effort and as latency-sensitive: how much of the spare CPU
	// best-effort work keeps while latency-sensitive commands run.
	BEWorkRate float64 `json:"be_burner_iterations_per_s"`
	LSWorkRate float64 `json:"ls_burner_iterations_per_s"`
	BEWorkKept float64 `json:"be_work_vs_ls_work"`
	// The spare CPU: the node's CPUs less what its host used (the node's
	// cpu_usec) while only the latency-sensitive execs ran, in CPUs; and
	// what the burners of each class used (their sandboxes' cpu_usec), in
	// CPUs. On a busy host latency-sensitive burners take CPU from the
	// host's other work too, so be_work_vs_ls_work understates what best-
	// effort work keeps of the spare CPU: be_cpu_vs_spare says it.
	SpareCPUs    float64 `json:"spare_cpus_unloaded"`
	BECPUs       float64 `json:"be_burner_cpus"`
	LSCPUs       float64 `json:"ls_burner_cpus"`
	BECPUOfSpare float64 `json:"be_cpu_vs_spare"`
}

// cpuSnap is the node's busy CPU time and its sandboxes' CPU times at one
// moment (GetStatus).
type cpuSnap struct {
	at   time.Time
	host int64            // µs, all CPUs
	sbx  map[string]int64 // µs per sandbox
}

func snapCPU(ctx context.Context, c *shoal.Client) (cpuSnap, error) {
	st, err := c.Status(ctx)
	if err != nil {
		return cpuSnap{}, err
	}
	s := cpuSnap{at: time.Now(), sbx: map[string]int64{}}
	for _, n := range st.Nodes {
		s.host += n.CpuUsec
	}
	for _, u := range st.Sandboxes {
		s.sbx[u.Id] = u.CpuUsec
	}
	return s, nil
}

// cpus is the CPU used between a and b by the sandboxes ids, in CPUs.
func cpusBetween(a, b cpuSnap, ids []string) float64 {
	var us int64
	for _, id := range ids {
		if b.sbx[id] >= 0 && a.sbx[id] >= 0 {
			us += b.sbx[id] - a.sbx[id]
		}
	}
	return float64(us) / float64(b.at.Sub(a.at).Microseconds())
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
	// execs runs o.N execs of `true` in the latency-sensitive sandbox, each
	// followed by one of `true` on the host (the floor; see HostUnloaded),
	// and returns both latencies. With a deadline (the burners' end), an
	// exec that ends after it is an error: it did not run beside them.
	truePath, err := exec.LookPath("true")
	if err != nil {
		return nil, fmt.Errorf("the host baseline needs true(1): %w", err)
	}
	execs := func(deadline time.Time) (sbx, host []time.Duration, err error) {
		for i := 0; i < o.N; i++ {
			t0 := time.Now()
			st, err := c.Exec(ctx, ls.Id, shoal.ExecOptions{Args: []string{"true"}})
			if err != nil {
				return nil, nil, err
			}
			if st.Code != 0 {
				return nil, nil, fmt.Errorf("true exited %d", st.Code)
			}
			sbx = append(sbx, time.Since(t0))
			t0 = time.Now()
			if err := exec.Command(truePath).Run(); err != nil {
				return nil, nil, fmt.Errorf("host true: %w", err)
			}
			host = append(host, time.Since(t0))
		}
		if !deadline.IsZero() && time.Now().After(deadline) {
			return nil, nil, fmt.Errorf("%d execs outlasted the burners' %v: give a longer --duration or a smaller -n", o.N, o.Duration)
		}
		return sbx, host, nil
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
	time.Sleep(15 * time.Second)                     // the pool's urgent refill (10 s) is over
	if _, _, err := execs(time.Time{}); err != nil { // warm-up
		return nil, err
	}
	s0, err := snapCPU(ctx, c)
	if err != nil {
		return nil, err
	}
	unloaded, hostUnloaded, err := execs(time.Time{})
	if err != nil {
		return nil, err
	}
	res.Unloaded, res.HostUnloaded = dist(unloaded), dist(hostUnloaded)
	// The spare CPU over at least 3 s (the execs are done by then or not).
	time.Sleep(time.Until(s0.at.Add(3 * time.Second)))
	s1, err := snapCPU(ctx, c)
	if err != nil {
		return nil, err
	}
	busy := float64(s1.host-s0.host) / float64(s1.at.Sub(s0.at).Microseconds())
	res.SpareCPUs = math.Round(max(float64(res.CPUs)-busy, 0)*100) / 100
	// burn runs the burners of a class for o.Duration while the
	// latency-sensitive sandbox runs its execs (and the host its own); it
	// returns their latencies, the burners' iterations per second and
	// the CPUs they used.
	burn := func(qos string) (sbx, host []time.Duration, work, cpus float64, err error) {
		ids := sets[qos]
		b0, err := snapCPU(ctx, c)
		if err != nil {
			return nil, nil, 0, 0, err
		}
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
		sbx, host, err = execs(b0.at.Add(o.Duration))
		wg.Wait()
		if err != nil {
			return nil, nil, 0, 0, err
		}
		b1, err := snapCPU(ctx, c)
		if err != nil {
			return nil, nil, 0, 0, err
		}
		var total int64
		for i := range counts {
			if errs[i] != nil {
				return nil, nil, 0, 0, fmt.Errorf("burner: %w", errs[i])
			}
			total += counts[i]
		}
		return sbx, host, float64(total) / float64(secs), cpusBetween(b0, b1, ids), nil
	}
	// Alternating rounds (be, ls, ls, be), so that a host whose load
	// drifts during the run favours neither class.
	var beD, beHost, lsD []time.Duration
	var beW, lsW, beC, lsC float64
	for _, qos := range []string{"be", "ls", "ls", "be"} {
		d, host, w, cpus, err := burn(qos)
		if err != nil {
			return nil, err
		}
		if qos == "be" {
			beD, beHost, beW, beC = append(beD, d...), append(beHost, host...), beW+w/2, beC+cpus/2
		} else {
			lsD, lsW, lsC = append(lsD, d...), lsW+w/2, lsC+cpus/2
		}
	}
	res.BECPUs, res.LSCPUs = math.Round(beC*100)/100, math.Round(lsC*100)/100
	res.BEBurning, res.LSBurning, res.HostBEBurning = dist(beD), dist(lsD), dist(beHost)
	res.BEWorkRate, res.LSWorkRate = math.Round(beW), math.Round(lsW)
	ratio := func(a, b float64) float64 {
		if b == 0 {
			return 0
		}
		return math.Round(a/b*100) / 100
	}
	res.RatioBEP99 = ratio(res.BEBurning.P99, res.Unloaded.P99)
	res.RatioLSP99 = ratio(res.LSBurning.P99, res.Unloaded.P99)
	res.RatioHostBEP99 = ratio(res.HostBEBurning.P99, res.HostUnloaded.P99)
	res.BEWorkKept = ratio(res.BEWorkRate, res.LSWorkRate)
	res.BECPUOfSpare = ratio(beC, res.SpareCPUs)
	return res, nil
}
