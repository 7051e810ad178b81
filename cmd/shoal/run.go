package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// extLanguages guesses --lang from a source file's extension.
var extLanguages = map[string]string{
	".py": "python", ".sh": "bash", ".bash": "bash", ".c": "c",
	".cpp": "cpp", ".cc": "cpp", ".cxx": "cpp", ".go": "go",
}

func runCmd() *cobra.Command {
	var (
		lang, testsFile, stdinFile, batch, compareMode, isolation string
		cpu, wall                                                 time.Duration
		memory, output                                            string
		procs, concurrency                                        int
		tolerance                                                 float64
		copts, files                                              []string
		stopOnFailure, asJSON, languages                          bool
	)
	cmd := &cobra.Command{
		Use:   "run [--lang LANG] FILE [--tests tests.json] [--time 2s --memory 256M] [-- ARGS...] | run --batch calls.jsonl",
		Short: "Judge code in a warm sandbox: compile once, run on tests under limits (FnCall)",
		Long: `Run sends source code to the FnCall backend: it is compiled once (c, cpp,
go) and run on each test case (or once, on --stdin) under CPU time, wall
time, memory, output and process limits, and judged: OK, WA, TLE, MLE, RE,
OLE, or CE for a failed compile.

Without --tests the program's stdout and stderr are printed as they are and
shoal exits with the program's exit code. With --tests a line per test is
printed and shoal exits 0 if every test is OK, else 1.

tests.json is a list of {"name", "stdin", "expected", "compare"} objects, or
{"tests": [...], "compare": "float", "float_tolerance": 1e-6}.

--batch reads one call per line (the JSON of a RunRequest, e.g.
{"language":"python","source":"print(1)","tests":[{"stdin":"","expected":"1"}]})
and prints one JSON result per line as each finishes: {"index": N, ...}.`,
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := client(cmd)
			if err != nil {
				return err
			}
			ctx, cancel := cmdContext()
			defer cancel()
			fc := c.FnCall()
			if languages {
				ls, err := fc.Languages(ctx)
				if err != nil {
					return err
				}
				for _, l := range ls {
					state := "available"
					if !l.Available {
						state = "unavailable: " + l.UnavailableReason
					}
					fmt.Printf("%-8s %-10s %s\n", l.Name, l.SourceFile, state)
				}
				return nil
			}
			if batch != "" {
				if len(args) > 0 {
					return errors.New("--batch takes no FILE: each line of the batch file is a call")
				}
				return runBatch(ctx, fc, batch, concurrency)
			}
			dash := cmd.ArgsLenAtDash()
			var progArgs []string
			if dash >= 0 {
				args, progArgs = args[:dash], args[dash:]
			}
			if len(args) != 1 {
				return errors.New("give one source FILE (or --batch calls.jsonl)")
			}
			src, err := os.ReadFile(args[0])
			if err != nil {
				return err
			}
			if !utf8.Valid(src) {
				return fmt.Errorf("%s is not UTF-8 text", args[0])
			}
			if lang == "" {
				lang = extLanguages[strings.ToLower(filepath.Ext(args[0]))]
				if lang == "" {
					return fmt.Errorf("cannot tell the language of %s from its extension: pass --lang", args[0])
				}
			}
			req := &pb.RunRequest{
				Language: lang, Source: string(src), CompileOptions: copts, Args: progArgs,
				FloatTolerance: tolerance, StopOnFailure: stopOnFailure,
				Limits: &pb.Limits{CpuTimeMs: cpu.Milliseconds(), WallTimeMs: wall.Milliseconds(), Processes: int32(procs)},
			}
			if req.Compare, err = parseCompare(compareMode); err != nil {
				return err
			}
			switch isolation {
			case "":
			case "cgroup":
				req.Isolation = pb.Isolation_ISOLATION_CGROUP
			case "sandbox":
				req.Isolation = pb.Isolation_ISOLATION_SANDBOX
			default:
				return fmt.Errorf("--isolation %q: want cgroup or sandbox", isolation)
			}
			if memory != "" {
				if req.Limits.MemoryBytes, err = parseBytes(memory); err != nil {
					return err
				}
			}
			if output != "" {
				if req.Limits.OutputBytes, err = parseBytes(output); err != nil {
					return err
				}
			}
			for _, f := range files {
				name, local, ok := strings.Cut(f, "=")
				if !ok {
					local, name = f, filepath.Base(f)
				}
				b, err := os.ReadFile(local)
				if err != nil {
					return err
				}
				mode := uint32(0o644)
				if fi, err := os.Stat(local); err == nil {
					mode = uint32(fi.Mode().Perm())
				}
				req.Files = append(req.Files, &pb.File{Path: name, Content: b, Mode: mode})
			}
			if stdinFile != "" {
				var b []byte
				if stdinFile == "-" {
					b, err = io.ReadAll(os.Stdin)
				} else {
					b, err = os.ReadFile(stdinFile)
				}
				if err != nil {
					return err
				}
				req.Stdin = string(b)
			}
			if testsFile != "" {
				if err := readTests(testsFile, req); err != nil {
					return err
				}
			}
			res, err := fc.Run(ctx, req)
			if err != nil {
				return err
			}
			if asJSON {
				b, _ := json.MarshalIndent(resultJSON(res), "", "  ")
				fmt.Println(string(b))
				if res.Verdict != pb.Verdict_VERDICT_OK {
					return exitCode(1)
				}
				return nil
			}
			if testsFile == "" {
				return printPlainRun(res)
			}
			return printTests(res)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&lang, "lang", "l", "", "language (python, bash, c, cpp, go ...; default: from the file's extension)")
	f.StringVar(&testsFile, "tests", "", "JSON file of test cases (see above)")
	f.StringVar(&stdinFile, "stdin", "", "file given as stdin of a plain run (- for shoal's stdin)")
	f.DurationVar(&cpu, "time", 0, "CPU time limit per test (default: the server's, 2s)")
	f.DurationVar(&wall, "wall", 0, "wall time limit per test (default 2 x --time + 1s)")
	f.StringVar(&memory, "memory", "", "memory limit per test, e.g. 256M (default: the server's, 256M)")
	f.StringVar(&output, "output", "", "output limit per stream, e.g. 1M (default: the server's, 1M)")
	f.IntVar(&procs, "procs", 0, "process (and thread) limit (default: the server's, 64)")
	f.StringVar(&compareMode, "compare", "", "how output is compared: whitespace (default), exact, lines, float")
	f.Float64Var(&tolerance, "tolerance", 0, "float comparison tolerance, absolute or relative (default 1e-6)")
	f.StringArrayVar(&copts, "copt", nil, "compile option (repeatable), e.g. --copt=-DLOCAL")
	f.StringArrayVar(&files, "file", nil, "extra file: LOCAL or NAME=LOCAL, put in the working directory (repeatable)")
	f.StringVar(&isolation, "isolation", "", "cgroup (a warm reused sandbox; default) or sandbox (a sandbox of its own)")
	f.BoolVar(&stopOnFailure, "stop-on-failure", false, "skip the tests after the first failed one")
	f.BoolVar(&asJSON, "json", false, "print the whole result as JSON")
	f.StringVar(&batch, "batch", "", "JSONL file of calls (- for stdin); prints JSONL results as they finish")
	f.IntVar(&concurrency, "concurrency", 0, "--batch: calls in flight (default: the server's capacity)")
	f.BoolVar(&languages, "languages", false, "list the server's languages")
	return cmd
}

func parseCompare(s string) (pb.Compare, error) {
	switch strings.ToLower(s) {
	case "":
		return pb.Compare_COMPARE_UNSPECIFIED, nil
	case "exact":
		return pb.Compare_COMPARE_EXACT, nil
	case "whitespace", "ws":
		return pb.Compare_COMPARE_WHITESPACE, nil
	case "float":
		return pb.Compare_COMPARE_FLOAT, nil
	case "lines":
		return pb.Compare_COMPARE_LINES, nil
	}
	return 0, fmt.Errorf("compare mode %q: want exact, whitespace, lines or float", s)
}

// testFile is the CLI's tests.json.
type testFile struct {
	Compare        string     `json:"compare"`
	FloatTolerance float64    `json:"float_tolerance"`
	Tests          []testCase `json:"tests"`
}

type testCase struct {
	Name     string  `json:"name"`
	Stdin    string  `json:"stdin"`
	Expected *string `json:"expected"`
	Compare  string  `json:"compare"`
}

func readTests(path string, req *pb.RunRequest) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var tf testFile
	if t := bytes.TrimSpace(b); len(t) > 0 && t[0] == '[' {
		err = json.Unmarshal(t, &tf.Tests)
	} else {
		err = json.Unmarshal(t, &tf)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if len(tf.Tests) == 0 {
		return fmt.Errorf("%s: no test cases", path)
	}
	if tf.Compare != "" {
		if req.Compare, err = parseCompare(tf.Compare); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	if tf.FloatTolerance != 0 && req.FloatTolerance == 0 {
		req.FloatTolerance = tf.FloatTolerance
	}
	for _, t := range tf.Tests {
		mode, err := parseCompare(t.Compare)
		if err != nil {
			return fmt.Errorf("%s: test %q: %w", path, t.Name, err)
		}
		req.Tests = append(req.Tests, &pb.TestCase{Name: t.Name, Stdin: t.Stdin, Expected: t.Expected, Compare: mode})
	}
	return nil
}

func verdictString(v pb.Verdict) string { return strings.TrimPrefix(v.String(), "VERDICT_") }

func execLine(x *pb.Execution) string {
	s := fmt.Sprintf("%-8s %-4s cpu %s  wall %s  mem %s", x.Name, verdictString(x.Verdict),
		fmtMs(x.CpuMs), fmtMs(x.WallMs), humanBytes(x.MemoryBytes))
	if x.Message != "" {
		s += "  " + x.Message
	}
	return s
}

func fmtMs(ms float64) string {
	if ms >= 1000 {
		return fmt.Sprintf("%.2fs", ms/1000)
	}
	return fmt.Sprintf("%.1fms", ms)
}

// printPlainRun prints the program's output as is, the verdict to stderr,
// and exits like the program (or 1 for a verdict that is not its own).
func printPlainRun(res *pb.RunResult) error {
	if res.Compile != nil && res.Verdict == pb.Verdict_VERDICT_CE {
		os.Stderr.Write(res.Compile.Stdout)
		os.Stderr.Write(res.Compile.Stderr)
		fmt.Fprintln(os.Stderr, "shoal run: "+execLine(res.Compile))
		return exitCode(1)
	}
	if len(res.Tests) == 0 {
		return fmt.Errorf("no result (verdict %s): %s", verdictString(res.Verdict), res.Error)
	}
	x := res.Tests[0]
	os.Stdout.Write(x.Stdout)
	os.Stderr.Write(x.Stderr)
	if x.StdoutTruncated || x.StderrTruncated {
		fmt.Fprintln(os.Stderr, "shoal run: output truncated at the output limit")
	}
	fmt.Fprintln(os.Stderr, "shoal run: "+execLine(x))
	switch {
	case x.Verdict == pb.Verdict_VERDICT_OK:
		return nil
	case x.Verdict == pb.Verdict_VERDICT_RE && x.ExitCode > 0 && x.ExitCode < 256:
		return exitCode(x.ExitCode)
	}
	return exitCode(1)
}

func printTests(res *pb.RunResult) error {
	if res.Compile != nil {
		fmt.Println(execLine(res.Compile))
		if res.Verdict == pb.Verdict_VERDICT_CE {
			os.Stdout.Write(res.Compile.Stderr)
		}
	}
	passed := 0
	for _, x := range res.Tests {
		fmt.Println(execLine(x))
		if x.Verdict == pb.Verdict_VERDICT_OK {
			passed++
		}
	}
	fmt.Printf("verdict: %s (%d/%d tests passed)\n", verdictString(res.Verdict), passed, len(res.Tests))
	if res.Verdict != pb.Verdict_VERDICT_OK {
		return exitCode(1)
	}
	return nil
}

// runBatch sends every call of a JSONL file in one RunBatch and prints the
// results as JSONL as they arrive.
func runBatch(ctx context.Context, fc *shoal.FnCallClient, path string, concurrency int) error {
	in := os.Stdin
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		in = f
	}
	var calls []*pb.RunRequest
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 256<<20)
	for line := 1; sc.Scan(); line++ {
		t := bytes.TrimSpace(sc.Bytes())
		if len(t) == 0 {
			continue
		}
		var r pb.RunRequest
		if err := protojson.Unmarshal(t, &r); err != nil {
			return fmt.Errorf("%s line %d: %w", path, line, err)
		}
		calls = append(calls, &r)
	}
	if err := sc.Err(); err != nil {
		return err
	}
	if len(calls) == 0 {
		return fmt.Errorf("%s: no calls", path)
	}
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	enc := json.NewEncoder(out)
	failed := 0
	err := fc.RunBatch(ctx, calls, concurrency, func(r *pb.RunBatchResult) error {
		if r.Result.GetVerdict() != pb.Verdict_VERDICT_OK {
			failed++
		}
		v := resultJSON(r.Result)
		v.Index = new(int)
		*v.Index = int(r.Index)
		if err := enc.Encode(v); err != nil {
			return err
		}
		return out.Flush()
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "shoal run: %d calls, %d OK, %d not OK\n", len(calls), len(calls)-failed, failed)
	return nil
}

// jsonResult is the CLI's JSON form of a RunResult: output as text when it
// is UTF-8 (else base64 in *_base64), durations in milliseconds.
type jsonResult struct {
	Index   *int        `json:"index,omitempty"`
	Verdict string      `json:"verdict"`
	Error   string      `json:"error,omitempty"`
	Compile *jsonExec   `json:"compile,omitempty"`
	Tests   []*jsonExec `json:"tests"`
	QueueMs float64     `json:"queue_ms"`
	TotalMs float64     `json:"total_ms"`
	Sandbox string      `json:"sandbox_id,omitempty"`
}

type jsonExec struct {
	Name            string  `json:"name"`
	Verdict         string  `json:"verdict"`
	Message         string  `json:"message,omitempty"`
	Stdout          *string `json:"stdout,omitempty"`
	StdoutBase64    []byte  `json:"stdout_base64,omitempty"`
	Stderr          *string `json:"stderr,omitempty"`
	StderrBase64    []byte  `json:"stderr_base64,omitempty"`
	StdoutTruncated bool    `json:"stdout_truncated,omitempty"`
	StderrTruncated bool    `json:"stderr_truncated,omitempty"`
	ExitCode        int32   `json:"exit_code"`
	Signal          string  `json:"signal,omitempty"`
	CPUMs           float64 `json:"cpu_ms"`
	WallMs          float64 `json:"wall_ms"`
	MemoryBytes     int64   `json:"memory_bytes"`
}

func execJSON(x *pb.Execution) *jsonExec {
	j := &jsonExec{
		Name: x.Name, Verdict: verdictString(x.Verdict), Message: x.Message,
		StdoutTruncated: x.StdoutTruncated, StderrTruncated: x.StderrTruncated, ExitCode: x.ExitCode,
		Signal: x.Signal, CPUMs: x.CpuMs, WallMs: x.WallMs, MemoryBytes: x.MemoryBytes,
	}
	text := func(b []byte, s **string, raw *[]byte) {
		if utf8.Valid(b) {
			t := string(b)
			*s = &t
		} else {
			*raw = b
		}
	}
	text(x.Stdout, &j.Stdout, &j.StdoutBase64)
	text(x.Stderr, &j.Stderr, &j.StderrBase64)
	return j
}

func resultJSON(r *pb.RunResult) *jsonResult {
	j := &jsonResult{Verdict: verdictString(r.Verdict), Error: r.Error, QueueMs: r.QueueMs, TotalMs: r.TotalMs, Sandbox: r.SandboxId, Tests: []*jsonExec{}}
	if r.Compile != nil {
		j.Compile = execJSON(r.Compile)
	}
	for _, x := range r.Tests {
		j.Tests = append(j.Tests, execJSON(x))
	}
	return j
}
