package bench

import (
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// FnCallOptions configure the fncall benchmark.
type FnCallOptions struct {
	N           int    // latency samples of python print(1) (C++ gets N/4)
	BatchN      int    // calls of the throughput batch
	Concurrency int    // batch calls in flight; 0 = the server's capacity
	Isolation   string // "cgroup", "sandbox" or "both"
	Python      string // host python for the baseline (default /usr/bin/python3)
	Gxx         string // host g++ for the baseline (default /usr/bin/g++)
}

// FnCallResult is the JSON printed by `shoal bench fncall`.
type FnCallResult struct {
	Bench string             `json:"bench"`
	Runs  []*FnCallIsolation `json:"runs"`
	// Baselines, on the host, interleaved with the API calls.
	BarePython Dist   `json:"bare_python3_c_print1"`
	BareCpp    Dist   `json:"bare_gxx_compile_and_run_hello"`
	Note       string `json:"note,omitempty"`
}

// FnCallIsolation holds the numbers of one isolation mode.
type FnCallIsolation struct {
	Isolation string `json:"isolation"`
	// Client-side latency of one call through the API (SDK → serve →
	// pool sandbox → result), serial.
	Python Dist `json:"python_print1"`
	Cpp    Dist `json:"cpp_hello_compile_and_run"`
	// Server-side: the call's total on the server, and the program's own
	// wall time and CPU time (cgroup) inside the sandbox.
	PythonServerTotal Dist    `json:"python_server_total"`
	PythonWall        Dist    `json:"python_program_wall"`
	PythonCPU         Dist    `json:"python_program_cpu"`
	RatioPythonP50    float64 `json:"ratio_python_p50_vs_bare"`
	RatioPythonP99    float64 `json:"ratio_python_p99_vs_bare"`
	RatioCppP50       float64 `json:"ratio_cpp_p50_vs_bare"`
	// The throughput batch: BatchN short python calls in one RunBatch.
	Batch BatchThroughput `json:"batch"`
	// Memory cgroups on the host before and after the batch (/proc/cgroups):
	// per-run cgroups must not pile up.
	MemcgBefore int `json:"memory_cgroups_before"`
	MemcgAfter  int `json:"memory_cgroups_after"`
}

// BatchThroughput is the result of the throughput batch.
type BatchThroughput struct {
	Calls       int            `json:"calls"`
	Concurrency int            `json:"concurrency"`
	Seconds     float64        `json:"seconds"`
	CallsPerSec float64        `json:"calls_per_second"`
	Verdicts    map[string]int `json:"verdicts"`
	FirstError  string         `json:"first_error,omitempty"`
	ServerTotal Dist           `json:"server_total"` // per call, queueing included
}

const cppHello = "#include <iostream>\nint main() { std::cout << \"hello\" << std::endl; }\n"

// FnCall measures call latency against bare runs on the host, and batch
// throughput.
func FnCall(ctx context.Context, c *shoal.Client, o FnCallOptions) (*FnCallResult, error) {
	if o.N <= 0 || o.BatchN < 0 {
		return nil, fmt.Errorf("-n must be positive and --batch not negative")
	}
	if o.Python == "" {
		o.Python = "/usr/bin/python3"
	}
	if o.Gxx == "" {
		o.Gxx = "/usr/bin/g++"
	}
	modes := []string{o.Isolation}
	switch o.Isolation {
	case "", "cgroup":
		modes = []string{"cgroup"}
	case "both":
		modes = []string{"cgroup", "sandbox"}
	case "sandbox":
	default:
		return nil, fmt.Errorf("--isolation %q: want cgroup, sandbox or both", o.Isolation)
	}
	fc := c.FnCall()
	res := &FnCallResult{Bench: "fncall"}
	tmp, err := os.MkdirTemp("", "shoal-bench-fncall")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	if err := os.WriteFile(filepath.Join(tmp, "hello.cpp"), []byte(cppHello), 0o644); err != nil {
		return nil, err
	}
	bare := func(name string, args ...string) (time.Duration, error) {
		t0 := time.Now()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir = tmp
		out, err := cmd.CombinedOutput()
		if err != nil {
			return 0, fmt.Errorf("%s: %v: %s", name, err, out)
		}
		return time.Since(t0), nil
	}
	havePython := fileExists(o.Python)
	haveGxx := fileExists(o.Gxx)
	var notes []string
	if !havePython {
		notes = append(notes, "no "+o.Python+" on this host: no python baseline")
	}
	if !haveGxx {
		notes = append(notes, "no "+o.Gxx+" on this host: no C++ baseline")
	}
	var barePy, bareCpp []time.Duration

	for _, mode := range modes {
		iso := pb.Isolation_ISOLATION_CGROUP
		if mode == "sandbox" {
			iso = pb.Isolation_ISOLATION_SANDBOX
		}
		r := &FnCallIsolation{Isolation: mode}
		py := &pb.RunRequest{Language: "python", Source: "print(1)\n", Isolation: iso}
		cpp := &pb.RunRequest{Language: "cpp", Source: cppHello, Isolation: iso}
		// Warm up: the pools fill, the page cache holds the toolchains.
		for i := 0; i < 5; i++ {
			if _, err := call(ctx, fc, py, "1\n"); err != nil {
				return nil, fmt.Errorf("python call: %w", err)
			}
			if i < 2 {
				if _, err := call(ctx, fc, cpp, "hello\n"); err != nil {
					return nil, fmt.Errorf("cpp call: %w", err)
				}
			}
		}
		var lat, total, wall, cpu, cppLat []time.Duration
		step := progress(ctx, mode, o.N)
		for i := 0; i < o.N; i++ {
			step()
			if havePython && mode == modes[0] {
				d, err := bare(o.Python, "-c", "print(1)")
				if err != nil {
					return nil, err
				}
				barePy = append(barePy, d)
			}
			t0 := time.Now()
			out, err := call(ctx, fc, py, "1\n")
			if err != nil {
				return nil, fmt.Errorf("python call: %w", err)
			}
			lat = append(lat, time.Since(t0))
			total = append(total, msDur(out.TotalMs))
			wall = append(wall, msDur(out.Tests[0].WallMs))
			cpu = append(cpu, msDur(out.Tests[0].CpuMs))
			if i%4 != 0 {
				continue
			}
			if haveGxx && mode == modes[0] {
				d, err := bare("sh", "-c", o.Gxx+" -O2 -o hello hello.cpp && ./hello")
				if err != nil {
					return nil, err
				}
				bareCpp = append(bareCpp, d)
			}
			t0 = time.Now()
			if _, err := call(ctx, fc, cpp, "hello\n"); err != nil {
				return nil, fmt.Errorf("cpp call: %w", err)
			}
			cppLat = append(cppLat, time.Since(t0))
		}
		r.Python, r.Cpp = dist(lat), dist(cppLat)
		r.PythonServerTotal, r.PythonWall, r.PythonCPU = dist(total), dist(wall), dist(cpu)
		res.BarePython, res.BareCpp = dist(barePy), dist(bareCpp)
		r.RatioPythonP50 = ratio(r.Python.P50, res.BarePython.P50)
		r.RatioPythonP99 = ratio(r.Python.P99, res.BarePython.P99)
		r.RatioCppP50 = ratio(r.Cpp.P50, res.BareCpp.P50)

		if o.BatchN > 0 {
			calls := make([]*pb.RunRequest, o.BatchN)
			for i := range calls {
				calls[i] = &pb.RunRequest{Language: "python", Source: fmt.Sprintf("print(%d)\n", i), Isolation: iso}
			}
			b := BatchThroughput{Calls: o.BatchN, Concurrency: o.Concurrency, Verdicts: map[string]int{}}
			var totals []time.Duration
			r.MemcgBefore = memoryCgroups()
			t0 := time.Now()
			err := fc.RunBatch(ctx, calls, o.Concurrency, func(br *pb.RunBatchResult) error {
				v := strings.TrimPrefix(br.Result.Verdict.String(), "VERDICT_")
				b.Verdicts[v]++
				if v != "OK" && b.FirstError == "" {
					b.FirstError = fmt.Sprintf("call %d: %s %s", br.Index, v, br.Result.Error)
				}
				totals = append(totals, msDur(br.Result.TotalMs))
				return nil
			})
			if err != nil {
				return nil, fmt.Errorf("batch: %w", err)
			}
			b.Seconds = math.Round(time.Since(t0).Seconds()*1000) / 1000
			b.CallsPerSec = math.Round(float64(o.BatchN)/time.Since(t0).Seconds()*10) / 10
			b.ServerTotal = dist(totals)
			r.Batch = b
			time.Sleep(2 * time.Second) // dying cgroups go away
			r.MemcgAfter = memoryCgroups()
		}
		res.Runs = append(res.Runs, r)
	}
	res.Note = strings.Join(notes, "; ")
	return res, nil
}

// call runs one call and checks it printed want.
func call(ctx context.Context, fc *shoal.FnCallClient, req *pb.RunRequest, want string) (*pb.RunResult, error) {
	out, err := fc.Run(ctx, req)
	if err != nil {
		return nil, err
	}
	if out.Verdict != pb.Verdict_VERDICT_OK || len(out.Tests) != 1 || string(out.Tests[0].Stdout) != want {
		msg := out.Error
		if out.Compile != nil {
			msg += string(out.Compile.Stderr)
		}
		if len(out.Tests) > 0 {
			msg += out.Tests[0].Message + " " + string(out.Tests[0].Stderr)
		}
		return nil, fmt.Errorf("verdict %s: %s", out.Verdict, msg)
	}
	return out, nil
}

func msDur(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return math.Round(a/b*100) / 100
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// memoryCgroups is the number of memory cgroups on the host (dying ones
// included), from /proc/cgroups; -1 if unknown.
func memoryCgroups() int {
	b, err := os.ReadFile("/proc/cgroups")
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && f[0] == "memory" {
			var n int
			fmt.Sscan(f[2], &n)
			return n
		}
	}
	return -1
}
