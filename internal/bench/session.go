package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// SessionOptions configure the session-layer benchmark.
type SessionOptions struct {
	Base        string
	StreamBytes int64 // output of the streaming throughput run
	Reattaches  int
	Steps       int // trajectory length
}

// SessionResult is the JSON printed by `shoal bench session`.
type SessionResult struct {
	Bench string `json:"bench"`
	// StreamMBps: a command writing StreamBytes to stdout, streamed through
	// the API to the client (agent → node log → API stream).
	StreamBytes int64   `json:"stream_bytes"`
	StreamMBps  float64 `json:"stream_mb_per_s"`
	// Baseline: the same command inside the sandbox writing to /dev/null.
	BaselineMBps float64 `json:"baseline_in_sandbox_mb_per_s"`
	// Reattach: ConnectCommand at a mid offset of a finished command's log
	// until its first event arrives.
	Reattach Dist `json:"reattach_first_event"`
	// Trajectory: running Steps steps, then replaying all of them.
	Steps            int     `json:"trajectory_steps"`
	TrajectoryRunMs  float64 `json:"trajectory_run_ms"`
	FastForwardMs    float64 `json:"trajectory_fast_forward_ms"`
	FastForwardPerMs float64 `json:"fast_forward_per_step_ms"`
}

// Session measures output streaming, re-attach and trajectory replay.
func Session(ctx context.Context, c *shoal.Client, o SessionOptions) (*SessionResult, error) {
	sb, err := c.Create(ctx, &pb.CreateSandboxRequest{Base: o.Base, TimeoutSeconds: 600})
	if err != nil {
		return nil, err
	}
	defer c.Delete(context.Background(), sb.Id)
	res := &SessionResult{Bench: "session", StreamBytes: o.StreamBytes, Steps: o.Steps}
	mb := float64(o.StreamBytes) / 1e6
	gen := fmt.Sprintf("head -c %d /dev/zero", o.StreamBytes)

	t0 := time.Now()
	st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"sh", "-c", gen + " > /dev/null"}})
	if err != nil || st.Code != 0 {
		return nil, fmt.Errorf("baseline: %v %+v", err, st)
	}
	res.BaselineMBps = round1(mb / time.Since(t0).Seconds())

	var cw countWriter
	t0 = time.Now()
	st, err = c.Exec(ctx, sb.Id, shoal.ExecOptions{Args: []string{"sh", "-c", gen}, Stdout: &cw})
	if err != nil || st.Code != 0 || cw.n != o.StreamBytes {
		return nil, fmt.Errorf("stream: got %d bytes: %v %+v", cw.n, err, st)
	}
	res.StreamMBps = round1(mb / time.Since(t0).Seconds())

	// Re-attach in the middle of that (finished) command's log.
	mid := st.Offset / 2
	// Offsets must be event boundaries: find one from the list of events.
	stream, err := c.Commands.ConnectCommand(ctx, connect.NewRequest(&pb.ConnectCommandRequest{SandboxId: sb.Id, CommandId: st.CommandID}))
	if err != nil {
		return nil, err
	}
	var boundary int64
	for stream.Receive() {
		if off := stream.Msg().Offset; off >= mid {
			boundary = off
			break
		}
	}
	stream.Close()
	var ds []time.Duration
	for i := 0; i < o.Reattaches; i++ {
		t0 := time.Now()
		s, err := c.Commands.ConnectCommand(ctx, connect.NewRequest(&pb.ConnectCommandRequest{SandboxId: sb.Id, CommandId: st.CommandID, Offset: boundary}))
		if err != nil {
			return nil, err
		}
		if !s.Receive() {
			s.Close()
			return nil, fmt.Errorf("re-attach: %v", s.Err())
		}
		ds = append(ds, time.Since(t0))
		s.Close()
	}
	res.Reattach = dist(ds)

	step := func(i int) error {
		st, err := c.Exec(ctx, sb.Id, shoal.ExecOptions{
			Args: []string{"sh", "-c", fmt.Sprintf("echo %d >> /tmp/steps", i)}, Trajectory: "bench", Step: int64(i),
		})
		if err == nil && st.Code != 0 {
			err = fmt.Errorf("step %d exited %d", i, st.Code)
		}
		return err
	}
	t0 = time.Now()
	for i := 1; i <= o.Steps; i++ {
		if err := step(i); err != nil {
			return nil, err
		}
	}
	res.TrajectoryRunMs = ms(time.Since(t0))
	t0 = time.Now()
	for i := 1; i <= o.Steps; i++ {
		if err := step(i); err != nil {
			return nil, err
		}
	}
	res.FastForwardMs = ms(time.Since(t0))
	res.FastForwardPerMs = math.Round(res.FastForwardMs/float64(o.Steps)*1000) / 1000
	return res, nil
}

type countWriter struct{ n int64 }

func (w *countWriter) Write(p []byte) (int, error) { w.n += int64(len(p)); return len(p), nil }

var _ io.Writer = (*countWriter)(nil)

func round1(v float64) float64   { return math.Round(v*10) / 10 }
func ms(d time.Duration) float64 { return math.Round(float64(d.Microseconds())) / 1000 }
