package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"sync"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/zram"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// DensityOptions configure the density benchmark.
type DensityOptions struct {
	Base        string // base layer ref (needs sh and mkfifo)
	N           int    // sandboxes
	Concurrency int    // creates (and deletes) in flight
	Pausers     int    // pauses in flight
	Sample      int    // sandboxes resumed by a first exec, chosen at random
	MiB         int    // extra MiB each resident shell holds (0: a bare shell)
	Memory      int64  // each sandbox's memory limit (0: the node's default)
	Disk        int64  // each sandbox's disk (0: the node's default)
	// CgroupParent is the node's --cgroup-parent: the sandboxes' memory
	// cgroups are read under it ("" = shoal).
	CgroupParent string
	// Restart, if set, is a shell command that restarts the server (kill it
	// and start it again, detached); the benchmark times its recovery.
	Restart string
	Keep    bool // leave the sandboxes (else they are deleted at the end)
	// StopCreating, when closed, ends the creates: the benchmark goes on
	// with the sandboxes it has (`shoal bench density` closes it on
	// SIGUSR1: a host too loaded to reach N in time still gets measured).
	StopCreating <-chan struct{}
	URL          string
	Log          func(format string, args ...any) // progress; nil: none
}

// DensityResult is the JSON printed by `shoal bench density`.
type DensityResult struct {
	Bench       string `json:"bench"`
	N           int    `json:"n"`
	Created     int    `json:"created"`
	Errors      int    `json:"errors"`
	FirstError  string `json:"first_error,omitempty"`
	Base        string `json:"base"`
	MiB         int    `json:"mib_each"`
	HostMemory  int64  `json:"host_memory_bytes"`
	CPUs        int    `json:"cpus"`
	ServeFound  bool   `json:"serve_process_found"`
	Concurrency int    `json:"concurrency"`
	// CreateAll: the wall time to create every sandbox and start its
	// resident shell; Create the create calls alone.
	CreateAllSeconds float64 `json:"create_all_seconds"`
	Create           Dist    `json:"create"`
	// Host memory per sandbox, running and paused (frozen and reclaimed),
	// against the host before the first create; and the raw readings.
	Running DensityMem `json:"per_sandbox_running"`
	Paused  DensityMem `json:"per_sandbox_paused"`
	// PauseAll: pausing every sandbox (Pausers in flight).
	PauseAllSeconds float64 `json:"pause_all_seconds"`
	Pause           Dist    `json:"pause"`
	ReclaimedBytes  int64   `json:"reclaimed_bytes"`
	SwappedOutBytes int64   `json:"swapped_out_bytes"`
	// PauseSecondsPerGiB: the pause calls' summed time over GiB reclaimed;
	// PauseWallSecondsPerGiB: the wall time of pausing all over it.
	PauseSecondsPerGiB     float64 `json:"pause_seconds_per_gib"`
	PauseWallSecondsPerGiB float64 `json:"pause_wall_seconds_per_gib"`
	PauseMethod            string  `json:"pause_method"`
	// ResumeFirstExec: `true` sent to a paused sandbox (resumed
	// transparently) until its exit came back, one at a time, over Sample
	// sandboxes chosen at random.
	ResumeFirstExec Dist `json:"resume_first_exec"`
	// Restart: the Restart command until the API answered, and until every
	// sandbox was listed running or paused again; then a first exec on a
	// sample of paused ones.
	RestartListenSeconds    float64 `json:"restart_api_seconds,omitempty"`
	RestartRecoveredSeconds float64 `json:"restart_all_recovered_seconds,omitempty"`
	RestartNotRecovered     int     `json:"restart_not_recovered,omitempty"`
	AfterRestartFirstExec   *Dist   `json:"after_restart_first_exec,omitempty"`
	DeleteAllSeconds        float64 `json:"delete_all_seconds,omitempty"`

	Readings map[string]memSnapshot `json:"readings"`
}

// DensityMem is host memory per sandbox in one phase, by part. Host
// fields are differences of /proc/meminfo against the reading before the
// first create (the whole host: other work on it moves them too).
type DensityMem struct {
	MemAvailable int64 `json:"host_memavailable_drop"`
	// Kernel parts (host-wide differences).
	Slab        int64 `json:"kernel_slab"`
	SlabUnrecl  int64 `json:"kernel_slab_unreclaimable"`
	KernelStack int64 `json:"kernel_stacks"`
	PageTables  int64 `json:"page_tables"`
	PageCache   int64 `json:"page_cache_and_buffers"` // overlay, loop, ext4 metadata, layer pages
	Zram        int64 `json:"zram_compressed"`
	Serve       int64 `json:"serve_rss"`
	// The sandboxes' own: their cgroups' charge, the kernel memory in it,
	// what went to swap (uncompressed), the agents' and the shells'
	// proportional and private memory, threads.
	CgroupCharged int64   `json:"cgroup_charged"`
	CgroupKmem    int64   `json:"cgroup_kmem"`
	CgroupSwap    int64   `json:"cgroup_swapped_out"`
	AgentPSS      int64   `json:"agent_pss"`
	AgentPrivate  int64   `json:"agent_private"`
	AgentThreads  float64 `json:"agent_threads"`
	ShellPSS      int64   `json:"shell_pss"`
	ShellPrivate  int64   `json:"shell_private"`
	// TopSlabs: the kernel's slab caches that grew most, per sandbox.
	TopSlabs []slabDelta `json:"top_slab_caches"`
}

type slabDelta struct {
	Cache string `json:"cache"`
	Bytes int64  `json:"bytes"`
}

func topSlabs(before, now map[string]int64, n int) []slabDelta {
	var out []slabDelta
	for k, v := range now {
		if d := (v - before[k]) / int64(n); d >= 1024 {
			out = append(out, slabDelta{k, d})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Bytes > out[j].Bytes })
	return out[:min(len(out), 15)]
}

type memSnapshot struct {
	At        time.Time        `json:"at"`
	Meminfo   map[string]int64 `json:"meminfo"`
	Zram      int64            `json:"zram_used_bytes"`
	Serve     procMem          `json:"serve"`
	Sandboxes sandboxMem       `json:"sandboxes"`
	slabs     map[string]int64
}

func (o DensityOptions) snapshot(pid int) memSnapshot {
	s := memSnapshot{At: time.Now().UTC(), Zram: zram.MemUsed(), Sandboxes: readSandboxMem(o.CgroupParent), slabs: slabs()}
	mi := meminfo()
	s.Meminfo = map[string]int64{}
	for _, k := range []string{"MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached", "Shmem", "AnonPages",
		"Slab", "SReclaimable", "SUnreclaim", "KernelStack", "PageTables", "SwapTotal", "SwapFree"} {
		s.Meminfo[k] = mi[k]
	}
	if pid > 0 {
		s.Serve, _ = readProcMem(pid)
	}
	return s
}

func perSandbox(before, now memSnapshot, n int) DensityMem {
	if n <= 0 {
		return DensityMem{}
	}
	d := func(k string) int64 { return (now.Meminfo[k] - before.Meminfo[k]) / int64(n) }
	div := func(v int64) int64 { return v / int64(n) }
	sb := now.Sandboxes
	return DensityMem{
		MemAvailable:  -d("MemAvailable"),
		Slab:          d("Slab"),
		SlabUnrecl:    d("SUnreclaim"),
		KernelStack:   d("KernelStack"),
		PageTables:    d("PageTables"),
		PageCache:     d("Cached") + d("Buffers"),
		Zram:          div(now.Zram - before.Zram),
		Serve:         div(now.Serve.RSS - before.Serve.RSS),
		CgroupCharged: div(sb.Charged - before.Sandboxes.Charged),
		CgroupKmem:    div(sb.Kmem - before.Sandboxes.Kmem),
		CgroupSwap:    div(sb.Swap - before.Sandboxes.Swap),
		AgentPSS:      div(sb.AgentMem.PSS - before.Sandboxes.AgentMem.PSS),
		AgentPrivate:  div(sb.AgentMem.Private - before.Sandboxes.AgentMem.Private),
		AgentThreads:  math.Round(float64(sb.AgentMem.Threads)/float64(max(sb.Agents, 1))*10) / 10,
		ShellPSS:      div(sb.OtherMem.PSS - before.Sandboxes.OtherMem.PSS),
		ShellPrivate:  div(sb.OtherMem.Private - before.Sandboxes.OtherMem.Private),
		TopSlabs:      topSlabs(before.slabs, now.slabs, n),
	}
}

// Density creates N sandboxes, each with a resident shell, and measures the
// host memory they take running and paused, the time to create and pause
// them all, resume→first exec on a random sample, the server's recovery
// after a restart (with Restart), and deletes them.
func Density(ctx context.Context, c *shoal.Client, o DensityOptions) (*DensityResult, error) {
	if o.N <= 0 || o.Concurrency <= 0 || o.Pausers <= 0 || o.Sample < 0 || o.MiB < 0 {
		return nil, fmt.Errorf("bench density: -n, -c and --pausers must be positive, --sample and --mib not negative")
	}
	if o.CgroupParent == "" {
		o.CgroupParent = "shoal"
	}
	logf := o.Log
	if logf == nil {
		logf = func(string, ...any) {}
	}
	pid := servePID(o.URL)
	res := &DensityResult{Bench: "density", N: o.N, Base: o.Base, MiB: o.MiB, CPUs: runtime.NumCPU(),
		ServeFound: pid > 0, Concurrency: o.Concurrency, Readings: map[string]memSnapshot{}}
	before := o.snapshot(pid)
	res.HostMemory = before.Meminfo["MemTotal"]
	res.Readings["before"] = before

	var (
		mu          sync.Mutex
		ids         []string
		creates     []time.Duration
		consecutive int
		done        int // sandboxes with their shell started
	)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		res.Errors++
		consecutive++
		if res.FirstError == "" {
			res.FirstError = err.Error()
		}
	}
	defer func() {
		if o.Keep {
			return
		}
		logf("deleting %d sandboxes", len(ids))
		t := time.Now()
		parallel(len(ids), o.Concurrency, func(i int) {
			dctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if err := c.Delete(dctx, ids[i]); err != nil {
				logf("delete %s: %v", ids[i], err)
			}
		})
		res.DeleteAllSeconds = round3(time.Since(t).Seconds())
	}()
	zero := int64(0)
	resident := `mkfifo /tmp/.density 2>/dev/null; (sh -c 'read x </tmp/.density' >/dev/null 2>&1 </dev/null &)`
	if o.MiB > 0 {
		resident = fmt.Sprintf(`mkfifo /tmp/.density 2>/dev/null; (sh -c 'x=$(head -c %d /dev/urandom | base64 | tr -d "\n"); read y </tmp/.density' >/dev/null 2>&1 </dev/null &)`, o.MiB<<20)
	}
	start := time.Now()
	parallel(o.N, o.Concurrency, func(i int) {
		mu.Lock()
		stop := consecutive >= 50 || ctx.Err() != nil
		mu.Unlock()
		select {
		case <-o.StopCreating:
			stop = true
		default:
		}
		if stop {
			return // the node is full or broken: say so, do not hammer it
		}
		t := time.Now()
		req := &pb.CreateSandboxRequest{Base: o.Base, TimeoutSeconds: 6 * 3600, AutoPauseSeconds: &zero,
			MemoryBytes: o.Memory, DiskBytes: o.Disk}
		sb, err := c.Create(ctx, req)
		if err != nil {
			fail(fmt.Errorf("create #%d: %w", i, err))
			return
		}
		d := time.Since(t)
		mu.Lock()
		ids = append(ids, sb.Id)
		creates = append(creates, d)
		mu.Unlock()
		st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"sh", "-c", resident}})
		if err == nil && st.Code != 0 {
			err = fmt.Errorf("exited %d", st.Code)
		}
		if err != nil {
			fail(fmt.Errorf("start the resident shell of %s: %w", sb.Id, err))
			return
		}
		mu.Lock()
		consecutive = 0
		if done++; done%100 == 0 {
			logf("%d sandboxes in %.0f s", done, time.Since(start).Seconds())
		}
		mu.Unlock()
	})
	res.CreateAllSeconds = round3(time.Since(start).Seconds())
	res.Created = len(ids)
	res.Create = dist(creates)
	if len(ids) == 0 {
		return res, fmt.Errorf("no sandbox was created: %s", res.FirstError)
	}
	if o.MiB > 0 {
		// Let the shells fill their memory (head | base64 of MiB each).
		if err := waitSettled(ctx, 2*time.Minute); err != nil {
			return res, err
		}
	}
	// The agents give their free memory back one second after their last
	// connection closed (agent.Config.IdleRelease).
	time.Sleep(3 * time.Second)
	running := o.snapshot(pid)
	res.Readings["running"] = running
	res.Running = perSandbox(before, running, len(ids))
	logf("running: %d sandboxes, MemAvailable %d MiB lower", len(ids), (before.Meminfo["MemAvailable"]-running.Meminfo["MemAvailable"])>>20)

	pauseAll := func(list []string) ([]time.Duration, error) {
		var pauses []time.Duration
		var firstErr error
		parallel(len(list), o.Pausers, func(i int) {
			t := time.Now()
			sb, _, err := c.Pause(ctx, list[i])
			d := time.Since(t)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if firstErr == nil {
					firstErr = err
				}
				return
			}
			pauses = append(pauses, d)
			if p := sb.Pause; p != nil {
				if p.MemoryBeforeBytes > 0 && p.MemoryAfterBytes >= 0 {
					res.ReclaimedBytes += p.MemoryBeforeBytes - p.MemoryAfterBytes
				}
				if p.SwappedOutBytes > 0 {
					res.SwappedOutBytes += p.SwappedOutBytes
				}
				if res.PauseMethod == "" {
					res.PauseMethod = p.Method
				}
			}
		})
		return pauses, firstErr
	}
	t := time.Now()
	pauses, err := pauseAll(ids)
	res.PauseAllSeconds = round3(time.Since(t).Seconds())
	res.Pause = dist(pauses)
	if err != nil {
		return res, fmt.Errorf("pause: %w", err)
	}
	if gib := float64(res.ReclaimedBytes) / (1 << 30); gib > 0 {
		var sum time.Duration
		for _, d := range pauses {
			sum += d
		}
		res.PauseSecondsPerGiB = round3(sum.Seconds() / gib)
		res.PauseWallSecondsPerGiB = round3(res.PauseAllSeconds / gib)
	}
	time.Sleep(time.Second)
	paused := o.snapshot(pid)
	res.Readings["paused"] = paused
	res.Paused = perSandbox(before, paused, len(ids))
	logf("paused in %.1f s: MemAvailable %d MiB lower than before", res.PauseAllSeconds, (before.Meminfo["MemAvailable"]-paused.Meminfo["MemAvailable"])>>20)

	sample := func(k int) []string {
		perm := rand.Perm(len(ids))
		out := make([]string, 0, k)
		for _, i := range perm[:min(k, len(ids))] {
			out = append(out, ids[i])
		}
		return out
	}
	firstExecs := func(list []string) (Dist, error) {
		var ds []time.Duration
		for _, id := range list {
			t := time.Now()
			st, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"true"}})
			if err != nil {
				return Dist{}, fmt.Errorf("first exec in paused sandbox %s: %w", id, err)
			}
			if st.Code != 0 {
				return Dist{}, fmt.Errorf("first exec in paused sandbox %s: exited %d", id, st.Code)
			}
			ds = append(ds, time.Since(t))
		}
		return dist(ds), nil
	}
	resumed := sample(o.Sample)
	if res.ResumeFirstExec, err = firstExecs(resumed); err != nil {
		return res, err
	}
	logf("resume→first exec over %d: p50 %.1f ms, p99 %.1f ms", len(resumed), res.ResumeFirstExec.P50, res.ResumeFirstExec.P99)
	if _, err := pauseAll(resumed); err != nil {
		return res, fmt.Errorf("pause again: %w", err)
	}

	if o.Restart != "" {
		if err := densityRestart(ctx, c, o, ids, res, logf); err != nil {
			return res, err
		}
		d, err := firstExecs(sample(min(o.Sample, 50)))
		if err != nil {
			return res, fmt.Errorf("after the restart: %w", err)
		}
		res.AfterRestartFirstExec = &d
	}
	return res, nil
}

// densityRestart runs the restart command and waits for the server to
// list every sandbox running or paused again.
func densityRestart(ctx context.Context, c *shoal.Client, o DensityOptions, ids []string, res *DensityResult, logf func(string, ...any)) error {
	logf("restarting the server: %s", o.Restart)
	t := time.Now()
	cmd := exec.CommandContext(ctx, "sh", "-c", o.Restart)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("restart command: %w", err)
	}
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	deadline := time.Now().Add(30 * time.Minute)
	listening := false
	for {
		lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		list, err := c.List(lctx)
		cancel()
		if err == nil {
			if !listening {
				listening = true
				res.RestartListenSeconds = round3(time.Since(t).Seconds())
				logf("the API answers after %.1f s", res.RestartListenSeconds)
			}
			bad := len(want)
			for _, sb := range list {
				if want[sb.Id] && (sb.State == pb.SandboxState_SANDBOX_STATE_RUNNING || sb.State == pb.SandboxState_SANDBOX_STATE_PAUSED) {
					bad--
				}
			}
			res.RestartNotRecovered = bad
			if bad == 0 {
				res.RestartRecoveredSeconds = round3(time.Since(t).Seconds())
				logf("all %d sandboxes recovered after %.1f s", len(ids), res.RestartRecoveredSeconds)
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after a restart, %d sandboxes are not running or paused after 30 minutes", res.RestartNotRecovered)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// waitSettled waits until the host's available memory stops falling (the
// resident shells have filled theirs): two readings 2 s apart within 1%.
func waitSettled(ctx context.Context, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	last := meminfo()["MemAvailable"]
	for time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Second):
		}
		now := meminfo()["MemAvailable"]
		if math.Abs(float64(now-last)) < 0.01*float64(last) {
			return nil
		}
		last = now
	}
	return errors.New("bench density: host memory still moving after the resident shells started")
}

func round3(f float64) float64 { return math.Round(f*1000) / 1000 }
