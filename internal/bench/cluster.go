package bench

// The cluster simulation (`shoal bench cluster`): the real placement
// engine (internal/placement) in front of SIMULATED nodes. The nodes are
// in-process fakes of the node role's capacity answers, labelled as such
// in the output: each admits a create by the rule of node admission
// (its sandboxes' limits against overcommit × its capacity; refused with
// unavailable "node full") and reports its load to the engine once per
// report interval, as a node's heartbeat does through etcd. Nothing else
// of a node (backends, etcd, the network) is simulated: the numbers are
// placement's own.

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/placement"
)

// ClusterOptions configures the simulation.
type ClusterOptions struct {
	Nodes            int
	CPUs             int     // per node
	MemoryGiB        int     // per node
	CPUOvercommit    float64 // admitted CPU limits: this × CPUs
	MemoryOvercommit float64
	Prefill          int           // sandboxes placed before the measured phases
	Rate             int           // steady creates per second
	Duration         time.Duration // of the steady phase
	Burst            int           // creates submitted at once by one tenant
	Concurrency      int           // placements in flight (prefill, burst)
	Report           time.Duration // node report interval
	Layers           int           // distinct base layers; each node holds a few
	Seed             uint64
}

// ClusterResult is the simulation's JSON.
type ClusterResult struct {
	Simulated string             `json:"simulated"`
	Options   ClusterOptions     `json:"options"`
	Prefill   ClusterPhaseResult `json:"prefill"`
	Steady    ClusterPhaseResult `json:"steady"`
	Burst     ClusterBurstResult `json:"burst"`
	// Balance at the end: max/mean over nodes of the memory and CPU
	// limits admitted, and of the sandbox count.
	ImbalanceMemory float64 `json:"imbalance_memory"`
	ImbalanceCPU    float64 `json:"imbalance_cpu"`
	ImbalanceCount  float64 `json:"imbalance_count"`
	FleetMemoryUsed float64 `json:"fleet_memory_used"` // fraction of admitted memory
	FleetCPUUsed    float64 `json:"fleet_cpu_used"`
	Sandboxes       int     `json:"sandboxes"`
	Stats           placement.Stats
}

// ClusterPhaseResult: one phase's decisions.
type ClusterPhaseResult struct {
	Creates      int     `json:"creates"`
	Failed       int     `json:"failed"`
	Seconds      float64 `json:"seconds"`
	DecisionsSec float64 `json:"decisions_per_second"`
	P50us        float64 `json:"p50_us"`
	P99us        float64 `json:"p99_us"`
	MaxUs        float64 `json:"max_us"`
	Refusals     int64   `json:"refusals"`
	Retries      int64   `json:"retries"`
	LocalityHit  float64 `json:"locality_hit"` // placed on a node holding the base
	// CPUSeconds: the process's CPU time in the phase (user + system),
	// and decisions per CPU-second: what one core of a control replica
	// decides, whatever else the machine runs.
	CPUSeconds      float64 `json:"cpu_seconds"`
	DecisionsPerCPU float64 `json:"decisions_per_cpu_second"`
}

// cpuTime is the process's CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// ClusterBurstResult: a burst from one tenant while another creates steadily.
type ClusterBurstResult struct {
	ClusterPhaseResult
	OtherTenantCreates int     `json:"other_tenant_creates"`
	OtherTenantP50us   float64 `json:"other_tenant_p50_us"`
	OtherTenantP90us   float64 `json:"other_tenant_p90_us"`
	OtherTenantP99us   float64 `json:"other_tenant_p99_us"`
	OtherTenantMaxUs   float64 `json:"other_tenant_max_us"`
}

// simNode is a SIMULATED node: capacity and admission only.
type simNode struct {
	name             string
	milliCPU, memory int64 // admitted in all (after overcommit)
	layers           map[string]bool
	layerList        []string

	mu               sync.Mutex
	usedCPU, usedMem int64
	n                int
}

func (s *simNode) admit(cpu, mem int64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.usedCPU+cpu > s.milliCPU || s.usedMem+mem > s.memory {
		return errdefs.New(errdefs.ErrUnavailable, "node full: %s", s.name)
	}
	s.usedCPU += cpu
	s.usedMem += mem
	s.n++
	return nil
}

func (s *simNode) free(cpu, mem int64) {
	s.mu.Lock()
	s.usedCPU -= cpu
	s.usedMem -= mem
	s.n--
	s.mu.Unlock()
}

func (s *simNode) report() placement.Node {
	s.mu.Lock()
	defer s.mu.Unlock()
	return placement.Node{Name: s.name, MilliCPU: s.milliCPU, Memory: s.memory, UsedMilliCPU: s.usedCPU, UsedMemory: s.usedMem,
		Sandboxes: s.n, Backends: []string{"container"}, Layers: s.layerList}
}

type simSandbox struct {
	node     *simNode
	cpu, mem int64
}

// shapes: the sandboxes' limits (milli-CPUs, MiB) and their shares.
var shapes = []struct {
	cpu, mem int64
	share    float64
}{{1000, 1024, 0.60}, {500, 512, 0.25}, {2000, 2048, 0.10}, {4000, 4096, 0.05}}

// Cluster runs the simulation.
func Cluster(ctx context.Context, o ClusterOptions) (*ClusterResult, error) {
	if o.Nodes < 1 || o.Nodes > 10_000 || o.Rate < 1 || o.Rate > 1_000_000 || o.Prefill < 0 || o.Prefill > 10_000_000 ||
		o.Burst < 0 || o.Burst > 1_000_000 || o.Duration < 0 || o.Duration > time.Hour || o.Concurrency < 1 || o.Concurrency > 10_000 ||
		o.Layers < 1 || o.CPUs < 1 || o.MemoryGiB < 1 || o.Report <= 0 {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "cluster bench options out of range: %+v", o)
	}
	rng := rand.New(rand.NewPCG(o.Seed, 1))
	var rngMu sync.Mutex
	eng := placement.New(placement.Config{MaxAttempts: 3, Concurrency: o.Concurrency, MaxWait: 10 * time.Second})
	nodes := make(map[string]*simNode, o.Nodes)
	all := make([]*simNode, 0, o.Nodes)
	for i := 0; i < o.Nodes; i++ {
		n := &simNode{name: fmt.Sprintf("sim-%03d", i), milliCPU: int64(float64(o.CPUs*1000) * o.CPUOvercommit),
			memory: int64(float64(int64(o.MemoryGiB)<<30) * o.MemoryOvercommit), layers: map[string]bool{}}
		for j := 0; j < min(3, o.Layers); j++ {
			l := fmt.Sprintf("base-%d:1", rng.IntN(o.Layers))
			if !n.layers[l] {
				n.layers[l] = true
				n.layerList = append(n.layerList, l)
			}
		}
		nodes[n.name] = n
		all = append(all, n)
		eng.Update(n.report())
	}
	// Heartbeats: each node reports once per interval, staggered.
	hctx, stopReports := context.WithCancel(ctx)
	defer stopReports()
	go func() {
		tick := time.NewTicker(o.Report / time.Duration(o.Nodes))
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-hctx.Done():
				return
			case <-tick.C:
				eng.Update(all[i%len(all)].report())
			}
		}
	}()

	var liveMu sync.Mutex
	var live []simSandbox
	// create places one sandbox and returns the decision's latency.
	create := func(ctx context.Context, tenant string) (time.Duration, bool, bool) {
		rngMu.Lock()
		x := rng.Float64()
		// Zipf-like: a few bases are most of the creates.
		base := fmt.Sprintf("base-%d:1", int(math.Floor(math.Pow(rng.Float64(), 3)*float64(o.Layers))))
		rngMu.Unlock()
		sh := shapes[0]
		for _, s := range shapes {
			if x < s.share {
				sh = s
				break
			}
			x -= s.share
		}
		req := placement.Request{Tenant: tenant, Backend: "container", MilliCPU: sh.cpu, Memory: sh.mem << 20, Layers: []string{base}}
		start := time.Now()
		name, err := eng.Place(ctx, req, func(_ context.Context, name string) error {
			return nodes[name].admit(req.MilliCPU, req.Memory)
		})
		d := time.Since(start)
		if err != nil {
			return d, false, false
		}
		n := nodes[name]
		liveMu.Lock()
		live = append(live, simSandbox{n, req.MilliCPU, req.Memory})
		liveMu.Unlock()
		return d, true, n.layers[base]
	}
	deleteOne := func() {
		liveMu.Lock()
		defer liveMu.Unlock()
		if len(live) == 0 {
			return
		}
		rngMu.Lock()
		i := rng.IntN(len(live))
		rngMu.Unlock()
		s := live[i]
		live[i] = live[len(live)-1]
		live = live[:len(live)-1]
		s.node.free(s.cpu, s.mem)
	}
	res := &ClusterResult{Simulated: "nodes are in-process fakes of the node role's admission and capacity reports; placement is the real engine", Options: o}

	// Prefill: as fast as the engine goes, o.Concurrency in flight.
	res.Prefill = runParallel(ctx, eng, o.Prefill, o.Concurrency, func(ctx context.Context) (time.Duration, bool, bool) { return create(ctx, "prefill") })

	// Steady: o.Rate creates a second, each with a delete of a random
	// sandbox (churn at a constant population), paced in real time.
	if o.Duration > 0 {
		total := int(float64(o.Rate) * o.Duration.Seconds())
		var lat []time.Duration
		var latMu sync.Mutex
		var failed, hits atomic.Int64
		before := eng.Stats()
		start, cpu0 := time.Now(), cpuTime()
		var wg sync.WaitGroup
		sem := make(chan struct{}, o.Concurrency)
		for i := 0; i < total && ctx.Err() == nil; i++ {
			if wait := time.Until(start.Add(time.Duration(i) * time.Second / time.Duration(o.Rate))); wait > 0 {
				time.Sleep(wait)
			}
			sem <- struct{}{}
			wg.Add(1)
			go func() {
				defer func() { <-sem; wg.Done() }()
				deleteOne()
				d, ok, hit := create(ctx, fmt.Sprintf("steady-%d", i%8))
				latMu.Lock()
				lat = append(lat, d)
				latMu.Unlock()
				if !ok {
					failed.Add(1)
				}
				if hit {
					hits.Add(1)
				}
			}()
		}
		wg.Wait()
		res.Steady = phase(lat, int(failed.Load()), int(hits.Load()), time.Since(start), cpuTime()-cpu0, before, eng.Stats())
	}

	// Burst: one tenant's o.Burst creates at once, while another tenant
	// creates at 100/s; first make room for the burst (deletes).
	if o.Burst > 0 {
		for i := 0; i < o.Burst; i++ {
			deleteOne()
		}
		for _, n := range all {
			eng.Update(n.report())
		}
		bctx, stop := context.WithCancel(ctx)
		var other []time.Duration
		var otherMu sync.Mutex
		var owg sync.WaitGroup
		owg.Add(1)
		go func() {
			defer owg.Done()
			tick := time.NewTicker(10 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-bctx.Done():
					return
				case <-tick.C:
				}
				owg.Add(1)
				go func() {
					defer owg.Done()
					d, _, _ := create(ctx, "other")
					otherMu.Lock()
					other = append(other, d)
					otherMu.Unlock()
				}()
			}
		}()
		// All o.Burst submitted at once: the engine's queue holds them.
		res.Burst.ClusterPhaseResult = runParallel(ctx, eng, o.Burst, o.Burst, func(ctx context.Context) (time.Duration, bool, bool) { return create(ctx, "burst") })
		stop()
		owg.Wait()
		slices.Sort(other)
		res.Burst.OtherTenantCreates = len(other)
		if len(other) > 0 {
			res.Burst.OtherTenantP50us = us(other[len(other)/2])
			res.Burst.OtherTenantP90us = us(other[len(other)*9/10])
			res.Burst.OtherTenantP99us = us(other[len(other)*99/100])
			res.Burst.OtherTenantMaxUs = us(other[len(other)-1])
		}
	}

	var mems, cpus, counts []float64
	var usedMem, capMem, usedCPU, capCPU float64
	for _, n := range all {
		r := n.report()
		mems = append(mems, float64(r.UsedMemory))
		cpus = append(cpus, float64(r.UsedMilliCPU))
		counts = append(counts, float64(r.Sandboxes))
		usedMem += float64(r.UsedMemory)
		capMem += float64(r.Memory)
		usedCPU += float64(r.UsedMilliCPU)
		capCPU += float64(r.MilliCPU)
	}
	res.ImbalanceMemory, res.ImbalanceCPU, res.ImbalanceCount = imbalance(mems), imbalance(cpus), imbalance(counts)
	res.FleetMemoryUsed, res.FleetCPUUsed = usedMem/capMem, usedCPU/capCPU
	res.Sandboxes = len(live)
	res.Stats = eng.Stats()
	return res, nil
}

func runParallel(ctx context.Context, eng *placement.Engine, n, conc int, create func(context.Context) (time.Duration, bool, bool)) ClusterPhaseResult {
	lat := make([]time.Duration, n)
	var failed, hits atomic.Int64
	var next atomic.Int64
	before := eng.Stats()
	start, cpu0 := time.Now(), cpuTime()
	var wg sync.WaitGroup
	for w := 0; w < min(conc, n); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n || ctx.Err() != nil {
					return
				}
				d, ok, hit := create(ctx)
				lat[i] = d
				if !ok {
					failed.Add(1)
				}
				if hit {
					hits.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	return phase(lat, int(failed.Load()), int(hits.Load()), time.Since(start), cpuTime()-cpu0, before, eng.Stats())
}

func phase(lat []time.Duration, failed, hits int, took, cpu time.Duration, before, after placement.Stats) ClusterPhaseResult {
	r := ClusterPhaseResult{Creates: len(lat), Failed: failed, Seconds: took.Seconds(),
		Refusals: after.Refusals - before.Refusals, Retries: after.Retries - before.Retries, CPUSeconds: cpu.Seconds()}
	if cpu > 0 {
		r.DecisionsPerCPU = math.Round(float64(len(lat)) / cpu.Seconds())
	}
	if len(lat) == 0 {
		return r
	}
	slices.Sort(lat)
	r.DecisionsSec = float64(len(lat)) / took.Seconds()
	r.P50us, r.P99us, r.MaxUs = us(lat[len(lat)/2]), us(lat[len(lat)*99/100]), us(lat[len(lat)-1])
	if ok := len(lat) - failed; ok > 0 {
		r.LocalityHit = float64(hits) / float64(ok)
	}
	return r
}

func us(d time.Duration) float64 { return math.Round(float64(d.Nanoseconds())/10) / 100 }

func imbalance(xs []float64) float64 {
	var sum, mx float64
	for _, x := range xs {
		sum += x
		mx = max(mx, x)
	}
	if sum == 0 {
		return 1
	}
	return math.Round(mx/(sum/float64(len(xs)))*1000) / 1000
}
