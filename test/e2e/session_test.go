package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	shoal "github.com/shoal-sandbox/shoal/sdk/go"
)

// slowOutput prints 400 numbered lines to stdout and stderr over ~2 s.
const slowOutput = `i=0; while [ $i -lt 400 ]; do echo "out $i"; echo "err $i" >&2; i=$((i+1)); [ $((i % 20)) = 0 ] && sleep 0.1; done; exit 5`

func expectedSlow() (string, string) {
	var out, errb strings.Builder
	for i := 0; i < 400; i++ {
		fmt.Fprintf(&out, "out %d\n", i)
		fmt.Fprintf(&errb, "err %d\n", i)
	}
	return out.String(), errb.String()
}

func TestReattachAfterClientDiesLosesNothing(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	cm, err := c.Start(ctx, &pb.ExecRequest{SandboxId: id, Args: []string{"sh", "-c", slowOutput}})
	if err != nil {
		t.Fatal(err)
	}
	// A client reads part of the stream and dies (its connection is cut).
	var out1, err1 bytes.Buffer
	cctx, cancel := context.WithCancel(ctx)
	stream, err := c.Commands.ConnectCommand(cctx, connect.NewRequest(&pb.ConnectCommandRequest{SandboxId: id, CommandId: cm.Id}))
	if err != nil {
		t.Fatal(err)
	}
	var last int64
	for stream.Receive() && out1.Len() < 1000 {
		switch ev := stream.Msg().Event.(type) {
		case *pb.CommandEvent_Stdout:
			out1.Write(ev.Stdout)
		case *pb.CommandEvent_Stderr:
			err1.Write(ev.Stderr)
		}
		last = stream.Msg().Offset
	}
	cancel()
	stream.Close()
	// Another client picks up from the last offset the first one saw.
	var out2, err2 bytes.Buffer
	st, err := c.Attach(ctx, id, cm.Id, last, &out2, &err2)
	if err != nil {
		t.Fatal(err)
	}
	wantOut, wantErr := expectedSlow()
	if out1.String()+out2.String() != wantOut || err1.String()+err2.String() != wantErr || st.Code != 5 {
		t.Fatalf("joined output differs: %d+%d stdout bytes (want %d), %d+%d stderr, exit %d",
			out1.Len(), out2.Len(), len(wantOut), err1.Len(), err2.Len(), st.Code)
	}
	// A bad offset is refused clearly.
	if _, err := c.Attach(ctx, id, cm.Id, last+1, nil, nil); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("misaligned offset: %v", err)
	}
}

func TestKilledCLIClientCommandGoesOn(t *testing.T) {
	need(t)
	id := create(t)
	// `shoal exec` streams; kill -9 it mid-stream.
	cmd := exec.Command(filepath.Join(binDir, "shoal"), "exec", id, "--", "sh", "-c", slowOutput)
	cmd.Env = append(cmd.Environ(), "SHOAL_URL="+apiURL, "SHOAL_API_KEY="+apiKey)
	var partial bytes.Buffer
	pipe, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Kill it once some output arrived (not after a fixed time: a loaded
	// host may not have streamed anything yet).
	buf := make([]byte, 64)
	n, err := pipe.Read(buf)
	if n == 0 {
		t.Fatalf("no output before the kill: %v", err)
	}
	partial.Write(buf[:n])
	cmd.Process.Signal(syscall.SIGKILL)
	// What the client had in its pipe when it died is output it saw.
	rest, _ := io.ReadAll(pipe)
	partial.Write(rest)
	cmd.Wait()
	// The command is still there and finishes; its whole output is intact.
	out, _ := run(nil, "ps", id)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) < 2 {
		t.Fatalf("ps: %s", out)
	}
	cmdID := strings.Fields(lines[len(lines)-1])[0]
	stdout, stderr, code := run3(nil, "attach", id, cmdID)
	wantOut, wantErr := expectedSlow()
	if stdout != wantOut || stderr != wantErr || code != 5 {
		t.Fatalf("attach after the client died: %d stdout bytes (want %d), %d stderr, code %d", len(stdout), len(wantOut), len(stderr), code)
	}
	if !strings.HasPrefix(wantOut, partial.String()) {
		t.Fatalf("the killed client saw output that is not a prefix")
	}
}

func TestCommandsSurviveServeRestart(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	cm, err := c.Start(ctx, &pb.ExecRequest{SandboxId: id, Args: []string{"sh", "-c", slowOutput}})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	killServe()
	time.Sleep(500 * time.Millisecond) // the command goes on without serve (until its buffer fills)
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	c = sdk(t) // the server listens on a new port
	var out, errb bytes.Buffer
	st, err := c.Attach(ctx, id, cm.Id, 0, &out, &errb)
	if err != nil {
		t.Fatal(err)
	}
	wantOut, wantErr := expectedSlow()
	if out.String() != wantOut || errb.String() != wantErr || st.Code != 5 {
		t.Fatalf("after restart: %d stdout bytes (want %d), %d stderr (want %d), exit %d", out.Len(), len(wantOut), errb.Len(), len(wantErr), st.Code)
	}
	res, err := c.Commands.ListCommands(ctx, connect.NewRequest(&pb.ListCommandsRequest{SandboxId: id}))
	if err != nil || len(res.Msg.Commands) != 1 || res.Msg.Commands[0].State != pb.CommandState_COMMAND_STATE_EXITED {
		t.Fatalf("list after restart: %v %v", res, err)
	}
}

func TestTrajectoryReplayRunsNothingTwice(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	step := func(i int64) (shoal.ExitStatus, string, error) {
		var out bytes.Buffer
		st, err := c.Exec(ctx, id, shoal.ExecOptions{
			Args:       []string{"sh", "-c", fmt.Sprintf("echo step %d >> /work/log; wc -l < /work/log", i)},
			Stdout:     &out,
			Trajectory: "rollout-17",
			Step:       i,
		})
		return st, out.String(), err
	}
	want := make([]string, 101)
	for i := int64(1); i <= 100; i++ {
		st, out, err := step(i)
		if err != nil || st.Replayed {
			t.Fatalf("step %d: %+v %v", i, st, err)
		}
		want[i] = out
	}
	// A trainer restarts and replays its loop: every step comes back
	// recorded, with the same output, and nothing runs again.
	t0 := time.Now()
	for i := int64(1); i <= 100; i++ {
		st, out, err := step(i)
		if err != nil || !st.Replayed || out != want[i] {
			t.Fatalf("replay of step %d: %+v %q (want %q) %v", i, st, out, want[i], err)
		}
	}
	t.Logf("fast-forward of 100 steps: %s", time.Since(t0))
	stdout, _, _ := run3(nil, "exec", id, "--", "wc", "-l", "/work/log")
	if !strings.HasPrefix(strings.TrimSpace(stdout), "100") {
		t.Fatalf("the log has %q lines: steps ran twice", stdout)
	}
	// A different request at a recorded step is refused as a divergence.
	_, err := c.Exec(ctx, id, shoal.ExecOptions{Args: []string{"sh", "-c", "rm -rf /work"}, Trajectory: "rollout-17", Step: 3})
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "diverged") {
		t.Fatalf("divergence: %v", err)
	}
	tr, err := c.Commands.GetTrajectory(ctx, connect.NewRequest(&pb.GetTrajectoryRequest{SandboxId: id, TrajectoryId: "rollout-17"}))
	if err != nil || len(tr.Msg.Steps) != 100 || tr.Msg.Steps[99].Step != 100 || tr.Msg.Steps[0].Command.Exit.Code != 0 {
		t.Fatalf("get trajectory: %v", err)
	}
	// A step still running is re-attached, not started twice.
	slow := shoal.ExecOptions{Args: []string{"sh", "-c", "echo run >> /work/slow; sleep 1; echo done"}, Trajectory: "t2", Step: 1}
	results := make(chan string, 2)
	for i := 0; i < 2; i++ {
		go func() {
			var out bytes.Buffer
			o := slow
			o.Stdout = &out
			c.Exec(ctx, id, o)
			results <- out.String()
		}()
	}
	if a, b := <-results, <-results; a != "done\n" || b != "done\n" {
		t.Fatalf("concurrent same step: %q %q", a, b)
	}
	stdout, _, _ = run3(nil, "exec", id, "--", "cat", "/work/slow")
	if stdout != "run\n" {
		t.Fatalf("the running step was started twice: %q", stdout)
	}
}

func TestPTYResizeSeenInside(t *testing.T) {
	need(t)
	id := create(t)
	c := sdk(t)
	ctx := context.Background()
	cm, err := c.Start(ctx, &pb.ExecRequest{SandboxId: id, Args: []string{"sh", "-c", "stty size; read x; stty size; tty"},
		Pty: &pb.Pty{Rows: 24, Cols: 80}, StdinOpen: true})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(out.String(), "24 80") && time.Now().Before(deadline) {
		out.Reset()
		actx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		c.Attach(actx, id, cm.Id, 0, &out, &out)
		cancel()
	}
	if _, err := c.Commands.ResizePty(ctx, connect.NewRequest(&pb.ResizePtyRequest{SandboxId: id, CommandId: cm.Id, Size: &pb.Pty{Rows: 40, Cols: 120}})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Commands.SendStdin(ctx, connect.NewRequest(&pb.SendStdinRequest{SandboxId: id, CommandId: cm.Id, Data: []byte("\n")})); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	st, err := c.Attach(ctx, id, cm.Id, 0, &out, &out)
	if err != nil || st.Code != 0 {
		t.Fatal(st, err)
	}
	if !strings.Contains(out.String(), "24 80") || !strings.Contains(out.String(), "40 120") || !strings.Contains(out.String(), "/dev/pts/") {
		t.Fatalf("pty output %q", out.String())
	}
}

func TestIdempotentCreateByClientKey(t *testing.T) {
	need(t)
	a, _, code := run3(nil, "create", "--base", baseRef, "--client-key", "rollout-17/env-3")
	b, _, code2 := run3(nil, "create", "--base", baseRef, "--client-key", "rollout-17/env-3")
	if code != 0 || code2 != 0 || a != b {
		t.Fatalf("two creates with one key: %q %q", a, b)
	}
	id := strings.TrimSpace(a)
	run(nil, "rm", id)
	c, _, _ := run3(nil, "create", "--base", baseRef, "--client-key", "rollout-17/env-3")
	if strings.TrimSpace(c) == id || strings.TrimSpace(c) == "" {
		t.Fatalf("create after the keyed sandbox was deleted: %q", c)
	}
	run(nil, "rm", strings.TrimSpace(c))
}

func TestShellSessionKeepsStateAndSurvivesTimeout(t *testing.T) {
	need(t)
	id := create(t)
	if out, code := run(nil, "shell", "create", id, "main"); code != 0 {
		t.Fatalf("shell create: %s", out)
	}
	steps := []struct {
		line, want string
		code       int
	}{
		{"cd /tmp && X=5 && export Y=6", "", 0},
		{"pwd; echo $X $Y", "/tmp\n5 6\n", 0},
		{"echo no newline at end | tr -d '\\n'", "no newline at end", 0},
		{"ls /nonexistent", "", 1},
		{"f() { echo in f $1; }; f 7", "in f 7\n", 0},
		{"false", "", 1},
	}
	for _, s := range steps {
		stdout, stderr, code := run3(nil, "shell", "run", id, "main", "--", s.line)
		if code != s.code || (s.want != "" && stdout != s.want) {
			t.Fatalf("%q: stdout %q stderr %q code %d (want %q, %d)", s.line, stdout, stderr, code, s.want, s.code)
		}
	}
	// A timeout interrupts the command, not the shell.
	_, stderr, code := run3(nil, "shell", "run", "--timeout", "500ms", id, "main", "--", "sleep 30")
	if code == 0 || !strings.Contains(stderr, "interrupted") {
		t.Fatalf("timeout: code %d %q", code, stderr)
	}
	stdout, _, code := run3(nil, "shell", "run", id, "main", "--", "pwd; echo $X")
	if stdout != "/tmp\n5\n" || code != 0 {
		t.Fatalf("after the timeout: %q %d", stdout, code)
	}
	if out, _ := run(nil, "shell", "ls", id); !strings.HasPrefix(out, "main\t") {
		t.Fatalf("shell ls: %q", out)
	}
	if out, code := run(nil, "shell", "create", id, "main"); code == 0 || !strings.Contains(out, "already_exists") {
		t.Fatalf("duplicate shell: %d %s", code, out)
	}
	if out, code := run(nil, "shell", "rm", id, "main"); code != 0 {
		t.Fatal(out)
	}
	if out, code := run(nil, "shell", "run", id, "main", "--", "true"); code == 0 || !strings.Contains(out, "not_found") {
		t.Fatalf("run in a deleted shell: %d %s", code, out)
	}
}
