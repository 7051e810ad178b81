package control

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
	"github.com/shoal-sandbox/shoal/internal/fncall"
	"github.com/shoal-sandbox/shoal/internal/limits"
	"github.com/shoal-sandbox/shoal/internal/metrics"
)

// FnCallConfigEnv names the JSON file (fncall.ConfigFile) that configures
// the FnCall engine of `shoal serve`: languages, pool sizes, limits.
const FnCallConfigEnv = "SHOAL_FNCALL_CONFIG"

// fncallService serves FnCallService over the node's FnCall engine.
type fncallService struct {
	shoalv1connect.UnimplementedFnCallServiceHandler
	eng *fncall.Engine // nil when the engine could not start (err says why)
	err error
	mt  *metrics.Metrics // nil: not counted
}

// count records a judged call in the metrics, under its language if the
// engine knows it ("other" otherwise: the label stays bounded).
func (f *fncallService) count(lang string, r *fncall.Result) {
	if f.mt == nil || r == nil {
		return
	}
	known := "other"
	for _, l := range f.eng.Languages() {
		if l.Name == lang {
			known = lang
			break
		}
	}
	f.mt.FnCall(known, strings.TrimPrefix(verdictPB[r.Verdict].String(), "VERDICT_"), r.Total)
}

// fncallRoutes starts the FnCall engine and registers FnCallService, and
// CreateSandbox with backend "fncall" (see createFnCallSandbox).
func (s *Server) fncallRoutes(mux *http.ServeMux) {
	svc := &fncallService{mt: s.metrics}
	cfg := fncall.Config{}
	if path := os.Getenv(FnCallConfigEnv); path != "" {
		cfg, svc.err = fncall.LoadConfig(path)
	}
	if svc.err == nil {
		cfg.Log = s.log
		svc.eng, svc.err = fncall.New(cfg, s.node)
	}
	if svc.err != nil {
		s.log.Error("fncall engine", "err", svc.err)
	}
	s.fncall = svc
	mux.Handle(shoalv1connect.NewFnCallServiceHandler(svc, s.handlerOptions()...))
	path, h := shoalv1connect.NewSandboxServiceHandler(&fncallSandboxes{Server: s, fn: svc}, s.handlerOptions()...)
	mux.Handle(path+"CreateSandbox", h)
}

// Close stops what Handler started that outlives requests: the FnCall
// engine's pools, whose idle sandboxes it deletes (sandboxes of users keep
// running). After the HTTP server's shutdown.
func (s *Server) Close(ctx context.Context) error {
	if s.fncall == nil || s.fncall.eng == nil {
		return nil
	}
	return s.fncall.eng.Close(ctx)
}

func (f *fncallService) engine() (*fncall.Engine, error) {
	if f.err != nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("fncall is not available on this server: %w", f.err))
	}
	return f.eng, nil
}

func (f *fncallService) Run(ctx context.Context, req *connect.Request[pb.RunRequest]) (*connect.Response[pb.RunResult], error) {
	eng, err := f.engine()
	if err != nil {
		return nil, err
	}
	r, err := runRequest(req.Msg)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	res, err := eng.Run(ctx, r)
	if err != nil {
		return nil, toConnect(err)
	}
	f.count(r.Language, res)
	return connect.NewResponse(runResultPB(res)), nil
}

func (f *fncallService) RunBatch(ctx context.Context, req *connect.Request[pb.RunBatchRequest], stream *connect.ServerStream[pb.RunBatchResult]) error {
	eng, err := f.engine()
	if err != nil {
		return err
	}
	if req.Msg.Concurrency < 0 {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("concurrency must not be negative"))
	}
	// Malformed calls get their SE result at once; the rest are judged.
	reqs := make([]*fncall.Request, 0, len(req.Msg.Calls))
	index := make([]int, 0, len(req.Msg.Calls))
	for i, c := range req.Msg.Calls {
		r, err := runRequest(c)
		if err != nil {
			if err := stream.Send(&pb.RunBatchResult{Index: int32(i), Result: &pb.RunResult{Verdict: pb.Verdict_VERDICT_SE, Error: err.Error()}}); err != nil {
				return err
			}
			continue
		}
		reqs = append(reqs, r)
		index = append(index, i)
	}
	return eng.RunBatch(ctx, reqs, int(req.Msg.Concurrency), func(br fncall.BatchResult) error {
		f.count(reqs[br.Index].Language, br.Result)
		return stream.Send(&pb.RunBatchResult{Index: int32(index[br.Index]), Result: runResultPB(br.Result)})
	})
}

func (f *fncallService) ListLanguages(ctx context.Context, req *connect.Request[pb.ListLanguagesRequest]) (*connect.Response[pb.ListLanguagesResponse], error) {
	eng, err := f.engine()
	if err != nil {
		return nil, err
	}
	out := &pb.ListLanguagesResponse{}
	for _, l := range eng.Languages() {
		out.Languages = append(out.Languages, &pb.Language{
			Name: l.Name, SourceFile: l.Source, Compile: l.Compile, Run: l.Run, Template: l.Template,
			Base: l.Base, Toolkits: l.Toolkits, Available: l.Available, UnavailableReason: l.Reason,
		})
	}
	return connect.NewResponse(out), nil
}

// fncallSandboxes answers CreateSandbox: backend "fncall" is refused with
// what to use instead; every other create goes to the Server.
type fncallSandboxes struct {
	*Server
	fn *fncallService
}

func (f *fncallSandboxes) CreateSandbox(ctx context.Context, req *connect.Request[pb.CreateSandboxRequest]) (*connect.Response[pb.Sandbox], error) {
	if req.Msg.Backend != fncall.Backend {
		return f.Server.CreateSandbox(ctx, req)
	}
	var stacks []string
	if eng, err := f.fn.engine(); err == nil {
		for _, l := range eng.Languages() {
			st := "--template " + l.Template
			if l.Template == "" {
				st = "--base " + l.Base
				for _, t := range l.Toolkits {
					st += " --toolkit " + t
				}
			}
			stacks = append(stacks, l.Name+": "+st)
		}
	}
	msg := "the fncall backend runs one-shot judged calls, not sessions: use FnCallService.Run or RunBatch " +
		"(CLI: shoal run --lang LANG FILE; Go SDK: client.FnCall().Run). For an interactive sandbox with a " +
		"language's toolchain, create a container sandbox from its layers"
	if len(stacks) > 0 {
		msg += " (" + strings.Join(stacks, "; ") + ")"
	}
	return nil, connect.NewError(connect.CodeInvalidArgument, errors.New(msg))
}

// runRequest converts and checks the wire form of a call (the engine
// checks the rest).
func runRequest(r *pb.RunRequest) (*fncall.Request, error) {
	if r == nil {
		return nil, errors.New("empty call")
	}
	if r.Language == "" {
		return nil, errors.New("language is required")
	}
	out := &fncall.Request{
		Language: r.Language, Source: r.Source, Stdin: r.Stdin, Compare: fncall.Compare(r.Compare),
		FloatTolerance: r.FloatTolerance, CompileOptions: r.CompileOptions, Args: r.Args,
		StopOnFailure: r.StopOnFailure, Isolation: fncall.Isolation(r.Isolation),
	}
	for _, f := range r.Files {
		if f.Mode&^0o777 != 0 {
			return nil, fmt.Errorf("file %q: mode %o: only permission bits (0-0777)", f.Path, f.Mode)
		}
		out.Files = append(out.Files, fncall.File{Path: f.Path, Data: f.Content, Mode: fs.FileMode(f.Mode)})
	}
	for _, t := range r.Tests {
		if t == nil {
			return nil, errors.New("empty test case")
		}
		out.Tests = append(out.Tests, fncall.Test{Name: t.Name, Stdin: t.Stdin, Expected: t.Expected, Compare: fncall.Compare(t.Compare)})
	}
	if l := r.Limits; l != nil {
		if l.CpuTimeMs < 0 || l.WallTimeMs < 0 || l.MemoryBytes < 0 || l.OutputBytes < 0 || l.Processes < 0 {
			return nil, errors.New("limits must not be negative")
		}
		out.Limits = fncall.Limits{
			CPUTime: limits.Millis(l.CpuTimeMs), WallTime: limits.Millis(l.WallTimeMs),
			Memory: l.MemoryBytes, Output: l.OutputBytes, Processes: int(l.Processes),
		}
	}
	return out, nil
}

var verdictPB = map[fncall.Verdict]pb.Verdict{
	fncall.OK: pb.Verdict_VERDICT_OK, fncall.WA: pb.Verdict_VERDICT_WA, fncall.TLE: pb.Verdict_VERDICT_TLE,
	fncall.MLE: pb.Verdict_VERDICT_MLE, fncall.RE: pb.Verdict_VERDICT_RE, fncall.OLE: pb.Verdict_VERDICT_OLE,
	fncall.CE: pb.Verdict_VERDICT_CE, fncall.SE: pb.Verdict_VERDICT_SE, fncall.Skipped: pb.Verdict_VERDICT_SKIPPED,
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func executionPB(x *fncall.Execution) *pb.Execution {
	return &pb.Execution{
		Name: x.Name, Verdict: verdictPB[x.Verdict], Stdout: x.Stdout, Stderr: x.Stderr,
		StdoutTruncated: x.StdoutTruncated, StderrTruncated: x.StderrTruncated, ExitCode: int32(x.ExitCode),
		Signal: x.Signal, CpuMs: ms(x.CPU), WallMs: ms(x.Wall), MemoryBytes: x.Memory, Message: x.Message,
	}
}

func runResultPB(r *fncall.Result) *pb.RunResult {
	out := &pb.RunResult{Verdict: verdictPB[r.Verdict], Error: r.Error, QueueMs: ms(r.Queue), TotalMs: ms(r.Total), SandboxId: r.Sandbox}
	if r.Compile != nil {
		out.Compile = executionPB(r.Compile)
	}
	for i := range r.Tests {
		out.Tests = append(out.Tests, executionPB(&r.Tests[i]))
	}
	return out
}
