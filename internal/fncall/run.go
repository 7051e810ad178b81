package fncall

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/limits"
)

// Verdict is the judgement of a run or a call.
type Verdict string

const (
	OK      Verdict = "OK"
	WA      Verdict = "WA"
	TLE     Verdict = "TLE"
	MLE     Verdict = "MLE"
	RE      Verdict = "RE"
	OLE     Verdict = "OLE"
	CE      Verdict = "CE"
	SE      Verdict = "SE" // system error: the call could not be judged
	Skipped Verdict = "SKIPPED"
)

// Request is one call.
type Request struct {
	Language       string
	Source         string
	Files          []File
	Stdin          string // when Tests is empty: one run with this stdin
	Tests          []Test
	Compare        Compare
	FloatTolerance float64
	CompileOptions []string
	Args           []string
	Limits         Limits // per test
	StopOnFailure  bool
	Isolation      Isolation
}

// File is an extra file in the call's box.
type File struct {
	Path string // relative to the box
	Data []byte
	Mode fs.FileMode // permission bits; 0 = 0644
}

// Test is one test case.
type Test struct {
	Name     string
	Stdin    string
	Expected *string // nil: the output is not checked
	Compare  Compare // CompareDefault: the call's
}

// Execution is the result of one run (the compile step or a test).
type Execution struct {
	Name            string
	Verdict         Verdict
	Stdout, Stderr  []byte
	StdoutTruncated bool
	StderrTruncated bool
	ExitCode        int
	Signal          string
	CPU, Wall       time.Duration
	Memory          int64 // peak, bytes
	Message         string
}

// Result is the result of a call.
type Result struct {
	Verdict Verdict
	Compile *Execution // nil for interpreted languages
	Tests   []Execution
	Error   string // SE: why
	Queue   time.Duration
	Total   time.Duration
	Sandbox string // the ID of the sandbox that ran the call
}

// plan is a validated call.
type plan struct {
	lang    *Language
	iso     Isolation
	files   []agent.FnFile
	compile []string
	run     []string
	env     []string
	tests   []Test
	limits  Limits
	climits Limits
	req     *Request
}

const (
	maxFiles     = 256
	maxFileBytes = 64 << 20 // source and files together
	maxTests     = 10000
)

// check validates a request against the configuration.
func (e *Engine) check(req *Request) (*plan, error) {
	l, ok := e.langs[req.Language]
	if !ok {
		names := make([]string, 0, len(e.langs))
		for _, x := range e.cfg.Languages {
			names = append(names, x.Name)
		}
		return nil, invalid("unknown language %q (this server runs: %s)", req.Language, strings.Join(names, ", "))
	}
	p := &plan{lang: l, req: req, iso: req.Isolation}
	if p.iso == IsolationDefault {
		p.iso = e.cfg.Isolation
	}
	if p.iso != IsolationCgroup && p.iso != IsolationSandbox {
		return nil, invalid("unknown isolation %d", int(p.iso))
	}
	if len(req.Files) > maxFiles {
		return nil, invalid("%d files: at most %d", len(req.Files), maxFiles)
	}
	total := len(req.Source)
	seen := map[string]bool{l.Source: true}
	p.files = append(p.files, agent.FnFile{Path: l.Source, Data: []byte(req.Source)})
	for _, f := range req.Files {
		if !validBoxPath(f.Path) {
			return nil, invalid("file path %q: must be relative, without \"..\", \".\" or empty elements", f.Path)
		}
		if seen[f.Path] {
			return nil, invalid("file %q given twice (or it is the source file)", f.Path)
		}
		if f.Mode&^fs.ModePerm != 0 {
			return nil, invalid("file %q: mode %o has more than permission bits", f.Path, uint32(f.Mode))
		}
		seen[f.Path] = true
		total += len(f.Data)
		p.files = append(p.files, agent.FnFile{Path: f.Path, Mode: f.Mode, Data: f.Data})
	}
	if total > maxFileBytes {
		return nil, invalid("source and files are %d bytes: at most %d", total, maxFileBytes)
	}
	if len(req.Tests) > maxTests {
		return nil, invalid("%d tests: at most %d", len(req.Tests), maxTests)
	}
	if len(req.Tests) > 0 && req.Stdin != "" {
		return nil, invalid("stdin and tests are exclusive: give each test its stdin")
	}
	if req.Compare < CompareDefault || req.Compare > CompareLines {
		return nil, invalid("unknown compare mode %d", int(req.Compare))
	}
	if req.FloatTolerance < 0 {
		return nil, invalid("float tolerance must not be negative")
	}
	if err := limits.Argv(append(append([]string{}, req.CompileOptions...), req.Args...), nil); err != nil {
		return nil, fmt.Errorf("arguments and compile options: %w", err)
	}
	if len(req.CompileOptions) > 0 && len(l.Compile) == 0 {
		return nil, invalid("language %s is not compiled: compile options make no sense", l.Name)
	}
	p.tests = req.Tests
	if len(p.tests) == 0 {
		p.tests = []Test{{Name: "run", Stdin: req.Stdin}}
	}
	for i := range p.tests {
		t := &p.tests[i]
		if t.Name == "" {
			t.Name = fmt.Sprint(i + 1)
		}
		if t.Compare < CompareDefault || t.Compare > CompareLines {
			return nil, invalid("test %s: unknown compare mode %d", t.Name, int(t.Compare))
		}
	}
	lim, err := e.limits(req.Limits, e.cfg.DefaultLimits)
	if err != nil {
		return nil, err
	}
	p.limits = lim
	p.climits, _ = e.limits(l.CompileLimits.limits(), e.cfg.CompileLimits)
	if len(l.Compile) > 0 {
		p.compile = expand(l.Compile, l.Source, req.CompileOptions, nil)
	}
	p.run = expand(l.Run, l.Source, nil, req.Args)
	p.env = e.runEnv(l.Env)
	return p, nil
}

// limits fills a run's limits from defaults and checks them against the
// maxima.
func (e *Engine) limits(l, def Limits) (Limits, error) {
	if l.CPUTime < 0 || l.WallTime < 0 || l.Memory < 0 || l.Output < 0 || l.Processes < 0 {
		return l, invalid("limits must not be negative")
	}
	l = l.or(def)
	if l.WallTime == 0 {
		l.WallTime = 2*l.CPUTime + time.Second
	}
	m := e.cfg.MaxLimits
	switch {
	case l.CPUTime > m.CPUTime:
		return l, invalid("cpu time limit %s is over this server's maximum %s", l.CPUTime, m.CPUTime)
	case l.WallTime > m.WallTime:
		return l, invalid("wall time limit %s is over this server's maximum %s", l.WallTime, m.WallTime)
	case l.Memory > m.Memory:
		return l, invalid("memory limit %d is over this server's maximum %d bytes", l.Memory, m.Memory)
	case l.Memory < 1<<20:
		return l, invalid("memory limit %d bytes is below the minimum of 1 MiB", l.Memory)
	case l.Output > m.Output:
		return l, invalid("output limit %d is over this server's maximum %d bytes", l.Output, m.Output)
	case l.Processes > m.Processes:
		return l, invalid("process limit %d is over this server's maximum %d", l.Processes, m.Processes)
	case l.CPUTime < time.Millisecond || l.WallTime < time.Millisecond:
		return l, invalid("time limits must be at least 1 ms")
	}
	return l, nil
}

// runEnv is the environment of a call's processes.
func (e *Engine) runEnv(extra map[string]string) []string {
	env := []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=" + e.cfg.Box, "TMPDIR=/tmp", "LANG=C.UTF-8",
	}
	for k, v := range extra {
		env = append(env, k+"="+strings.ReplaceAll(v, "{box}", e.cfg.Box))
	}
	return env
}

// Run judges one call. A malformed request is an error marked
// errdefs.ErrInvalidArgument; a language whose layers are missing,
// errdefs.ErrFailedPrecondition; a call that could not be judged (no
// sandbox, a lost agent) returns the error (RunBatch turns it into an SE
// result).
func (e *Engine) Run(ctx context.Context, req *Request) (*Result, error) {
	start := time.Now()
	p, err := e.check(req)
	if err != nil {
		return nil, err
	}
	if e.hErr != nil {
		return nil, errdefs.Mark(errdefs.ErrFailedPrecondition, e.hErr)
	}
	env, err := e.resolve(p.lang)
	if err != nil {
		return nil, errdefs.Mark(errdefs.ErrFailedPrecondition, err)
	}
	select {
	case e.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-e.slots }()
	pl := e.pool(env, p.lang, p.iso)
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		s, err := pl.get(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			lastErr = err
			continue
		}
		queue := time.Since(start)
		res, healthy, err := e.judge(ctx, s, p)
		pl.put(s, healthy)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			// The sandbox failed us (its agent is gone, say): another try
			// in another sandbox, unless a run had started.
			lastErr = err
			if res != nil {
				break
			}
			e.log.Warn("fncall sandbox failed, retrying in another", "sandbox_id", s.id, "err", err)
			continue
		}
		res.Queue, res.Total, res.Sandbox = queue, time.Since(start), s.id
		return res, nil
	}
	return nil, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("fncall: %w", lastErr))
}

// judge runs a call in sandbox s. healthy says whether s may be reused. A
// non-nil result with an error means runs had started when s failed.
func (e *Engine) judge(ctx context.Context, s *sbx, p *plan) (res *Result, healthy bool, err error) {
	// A sandbox reset after its last call only needs its files (the
	// agent still checks the box is empty).
	s.uid = s.callUID()
	prep, err := s.agent.FnPrepare(ctx, agent.FnPrepareRequest{Box: e.cfg.Box, Wipe: wipeDirs, UID: s.uid, GID: s.gid(), Files: p.files, Quick: s.clean})
	if err != nil {
		return nil, false, fmt.Errorf("prepare sandbox %s: %w", s.id, err)
	}
	if len(prep.Dirty) > 0 {
		return nil, false, fmt.Errorf("sandbox %s was not clean: %v", s.id, prep.Dirty)
	}
	res = &Result{}
	healthy = true
	if p.compile != nil {
		x, ok, err := e.execute(ctx, s, "compile", p.compile, p.env, "", p.climits, true)
		healthy = healthy && ok
		if err != nil {
			return res, false, err
		}
		if x.Verdict != OK {
			if x.Verdict == RE {
				x.Message = "compilation failed: " + x.Message
			} else {
				x.Message = "compilation: " + x.Message
			}
			x.Verdict = CE
		}
		res.Compile = x
		if x.Verdict != OK {
			res.Verdict = CE
			return res, healthy, nil
		}
	}
	res.Verdict = OK
	for i, t := range p.tests {
		if p.req.StopOnFailure && res.Verdict != OK {
			res.Tests = append(res.Tests, Execution{Name: t.Name, Verdict: Skipped})
			continue
		}
		x, ok, err := e.execute(ctx, s, t.Name, p.run, p.env, t.Stdin, p.limits, i < len(p.tests)-1)
		healthy = healthy && ok
		if err != nil {
			return res, false, err
		}
		if x.Verdict == OK && t.Expected != nil {
			mode := t.Compare
			if mode == CompareDefault {
				mode = p.req.Compare
			}
			if mode == CompareDefault {
				mode = CompareWhitespace
			}
			if same, why := compare(mode, p.req.FloatTolerance, x.Stdout, []byte(*t.Expected)); !same {
				x.Verdict, x.Message = WA, why
			}
		}
		res.Tests = append(res.Tests, *x)
		if res.Verdict == OK && x.Verdict != OK {
			res.Verdict = x.Verdict
		}
	}
	return res, healthy, nil
}

// cpuPoll bounds how long a run may overrun its CPU time limit unnoticed
// (the watchdog reads the run's cpuacct.usage at most this far apart once
// the limit is near).
const cpuPoll = 5 * time.Millisecond

// execute runs one process in fresh cgroups and judges its limits (not its
// output). ok=false means the sandbox must not be reused. With more, the
// next run's cgroups are made while this one runs.
func (e *Engine) execute(ctx context.Context, s *sbx, name string, argv, env []string, stdin string, lim Limits, more bool) (x *Execution, ok bool, err error) {
	cg, err := s.takeCgroup()
	if err != nil {
		return nil, false, err
	}
	// Removed after the call, off its critical path (pool.put), where
	// what the agent left in it, if anything, is killed from the host.
	s.spent = append(s.spent, cg)
	// The agent's thread that forks the process is in the cgroups for an
	// instant: one more task until the process exists; then the agent
	// sets the run's own limit (PidsMaxFD).
	if err := cg.setLimits(lim.Memory, lim.Processes+1); err != nil {
		return nil, false, err
	}
	ok = true
	var in []byte
	if stdin != "" {
		in = []byte(stdin)
	}
	proc, err := s.agent.FnStart(ctx, agent.FnRunRequest{
		Args: argv, Env: env, Cwd: e.cfg.Box, UID: s.uid, GID: s.gid(), Stdin: in,
		Timeout: lim.WallTime, OutputLimit: lim.Output, StackBytes: lim.Memory, CgroupFDs: cg.tasks,
		PidsMaxFD: cg.pidsMax, Pids: lim.Processes,
	})
	cg.closeTasks()
	if more {
		s.making.Add(1)
		go func() { defer s.making.Done(); s.makeNextCgroup() }()
	}
	x = &Execution{Name: name}
	if err != nil {
		var ae *agent.Error
		if errors.As(err, &ae) && ae.Code != agent.CodeProtocol && ae.Code != agent.CodeIO {
			// The program could not start (not found, not executable).
			x.Verdict, x.ExitCode, x.Message = RE, 127, ae.Msg
			return x, ok, nil
		}
		return nil, false, err
	}
	// CPU watchdog: the run's processes may be any number of threads on
	// any number of cores; check cpuacct as the limit comes near.
	// The agent enforces the wall time; should it not answer well past
	// it, the run is killed from here and the sandbox thrown away.
	cpuKilled := false
	stuck := time.Now().Add(lim.WallTime + 10*time.Second)
	for done := false; !done; {
		used, _ := cg.cpuTime()
		left := lim.CPUTime - used
		if left <= 0 {
			cpuKilled = true
			cg.kill(5 * time.Second)
			break
		}
		if time.Now().After(stuck) {
			cg.kill(5 * time.Second)
			proc.Kill()
			break
		}
		wait := max(min(left/time.Duration(runtime.NumCPU()), time.Until(stuck)), cpuPoll)
		t := time.NewTimer(wait)
		select {
		case <-proc.Done():
			done = true
		case <-t.C:
		case <-ctx.Done():
			proc.Kill()
			done = true
		}
		t.Stop()
	}
	r, err := proc.Wait()
	if err != nil {
		return nil, false, err
	}
	cpu, _ := cg.cpuTime()
	peak, failcnt, oomKills, _ := cg.memStats()
	x.Stdout, x.Stderr = r.Stdout, r.Stderr
	x.StdoutTruncated, x.StderrTruncated = r.StdoutOver, r.StderrOver
	x.ExitCode, x.Signal = r.Code, r.Signal
	x.CPU, x.Wall, x.Memory = cpu, r.Wall, peak
	switch {
	case r.StdoutOver:
		x.Verdict, x.Message = OLE, fmt.Sprintf("output limit exceeded: more than %d bytes of stdout", lim.Output)
	case oomKills > 0 && !cpuKilled && !r.TimedOut && r.Signal == "SIGKILL":
		// The kernel killed it for memory (its CPU time may be over the
		// limit too by then: reclaim near the limit burns CPU).
		x.Verdict, x.Message = MLE, fmt.Sprintf("memory limit %s exceeded", mib(lim.Memory))
	case cpuKilled || cpu > lim.CPUTime:
		x.Verdict, x.Message = TLE, fmt.Sprintf("cpu time %s > limit %s", round(cpu), lim.CPUTime)
	case r.TimedOut:
		x.Verdict, x.Message = TLE, fmt.Sprintf("wall time limit %s exceeded (cpu time %s)", lim.WallTime, round(cpu))
	case oomKills > 0 || (failcnt > 0 && (r.Code != 0 || r.Signal != "") && peak >= lim.Memory-lim.Memory/32):
		x.Verdict, x.Message = MLE, fmt.Sprintf("memory limit %s exceeded", mib(lim.Memory))
	case r.Signal != "":
		x.Verdict, x.Message = RE, "killed by "+r.Signal
	case r.Code != 0:
		x.Verdict, x.Message = RE, fmt.Sprintf("exit code %d", r.Code)
	default:
		x.Verdict = OK
	}
	if r.StderrOver {
		x.Message = strings.TrimPrefix(x.Message+"; stderr truncated", "; ")
	}
	return x, ok, nil
}

func round(d time.Duration) time.Duration { return d.Round(time.Millisecond) }

func mib(b int64) string {
	if b%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", b>>20)
	}
	return fmt.Sprintf("%d bytes", b)
}

// BatchResult is one result of RunBatch.
type BatchResult struct {
	Index  int
	Result *Result
}

// RunBatch judges reqs with at most concurrency calls in flight (0 or more
// than the engine's capacity: its capacity) and calls emit with each
// result as it is done (never concurrently). A call that fails gets an SE
// result with the reason; the batch goes on. It returns when every call
// is done or ctx is.
func (e *Engine) RunBatch(ctx context.Context, reqs []*Request, concurrency int, emit func(BatchResult) error) error {
	if concurrency <= 0 || concurrency > e.cfg.MaxConcurrent {
		concurrency = e.cfg.MaxConcurrent
	}
	concurrency = min(concurrency, len(reqs))
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		mu      sync.Mutex
		next    int
		emitErr error
		wg      sync.WaitGroup
	)
	for range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				mu.Unlock()
				if i >= len(reqs) || ctx.Err() != nil {
					return
				}
				res, err := e.Run(ctx, reqs[i])
				if err != nil {
					if ctx.Err() != nil {
						return
					}
					res = &Result{Verdict: SE, Error: err.Error()}
				}
				mu.Lock()
				if emitErr == nil {
					if emitErr = emit(BatchResult{Index: i, Result: res}); emitErr != nil {
						cancel()
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if emitErr != nil {
		return emitErr
	}
	return ctx.Err()
}

// validBoxPath accepts a clean relative path.
func validBoxPath(p string) bool {
	if p == "" || strings.HasPrefix(p, "/") || strings.IndexByte(p, 0) >= 0 || len(p) > 1024 {
		return false
	}
	for _, el := range strings.Split(p, "/") {
		if el == "" || el == "." || el == ".." {
			return false
		}
	}
	return true
}
