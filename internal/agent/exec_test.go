package agent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestExec(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t) // not t.TempDir: keep paths short and readable
	bindir := filepath.Join(dir, "bin")
	os.Mkdir(bindir, 0o755)
	if err := os.WriteFile(filepath.Join(bindir, "myprog"), []byte("#!/bin/sh\necho myprog \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name   string
		req    ExecRequest
		stdout string
		stderr string
		order  string // if set, the exact interleaving of output events
		exit   ExitStatus
	}{
		{name: "stdout", req: ExecRequest{Args: []string{"echo", "hello"}}, stdout: "hello\n"},
		{
			name: "stdout and stderr separate",
			req: ExecRequest{Args: []string{"sh", "-c",
				"echo out1; echo err1 >&2; echo out2; echo err2 >&2"}},
			stdout: "out1\nout2\n", stderr: "err1\nerr2\n",
		},
		{name: "exit code", req: ExecRequest{Args: []string{"sh", "-c", "exit 3"}}, exit: ExitStatus{Code: 3}},
		{name: "exit code with output", req: ExecRequest{Args: []string{"sh", "-c", "echo x; exit 255"}}, stdout: "x\n", exit: ExitStatus{Code: 255}},
		{name: "killed by SIGKILL", req: ExecRequest{Args: []string{"sh", "-c", "kill -KILL $$"}}, exit: ExitStatus{Code: 137, Signal: "SIGKILL"}},
		{name: "killed by SIGTERM", req: ExecRequest{Args: []string{"sh", "-c", "kill -TERM $$"}}, exit: ExitStatus{Code: 143, Signal: "SIGTERM"}},
		{name: "env added", req: ExecRequest{Args: []string{"sh", "-c", "echo $SHOAL_T1"}, Env: []string{"SHOAL_T1=bar"}}, stdout: "bar\n"},
		{name: "env overrides", req: ExecRequest{Args: []string{"sh", "-c", "echo $HOME"}, Env: []string{"HOME=/over"}}, stdout: "/over\n"},
		{name: "env inherited", req: ExecRequest{Args: []string{"sh", "-c", "test -n \"$PATH\" && echo ok"}}, stdout: "ok\n"},
		{name: "default cwd is /", req: ExecRequest{Args: []string{"pwd"}}, stdout: "/\n"},
		{name: "cwd", req: ExecRequest{Args: []string{"pwd"}, Cwd: dir}, stdout: dir + "\n"},
		{name: "PATH of merged env", req: ExecRequest{Args: []string{"myprog", "a"}, Env: []string{"PATH=" + bindir + ":/usr/bin:/bin"}}, stdout: "myprog a\n"},
		{name: "argv0 kept", req: ExecRequest{Args: []string{"sh", "-c", "echo $0", "zero"}}, stdout: "zero\n"},
		{name: "large output", req: ExecRequest{Args: []string{"sh", "-c", "head -c 1000000 /dev/zero | tr '\\0' a"}}, stdout: strings.Repeat("a", 1000000)},
		{name: "timeout", req: ExecRequest{Args: []string{"sleep", "10"}, Timeout: 200 * time.Millisecond}, exit: ExitStatus{Code: 137, Signal: "SIGKILL", TimedOut: true}},
		{name: "timeout not reached", req: ExecRequest{Args: []string{"true"}, Timeout: 10 * time.Second}},
		{name: "stdin is /dev/null", req: ExecRequest{Args: []string{"sh", "-c", "wc -c; readlink /proc/self/fd/0"}}, stdout: "0\n/dev/null\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := run(t, c, tt.req)
			if r.stdout != tt.stdout {
				t.Errorf("stdout = %.200q, want %.200q", r.stdout, tt.stdout)
			}
			if r.stderr != tt.stderr {
				t.Errorf("stderr = %q, want %q", r.stderr, tt.stderr)
			}
			if tt.order != "" && r.order != tt.order {
				t.Errorf("event order = %q, want %q", r.order, tt.order)
			}
			if r.exit != tt.exit {
				t.Errorf("exit = %+v, want %+v", r.exit, tt.exit)
			}
		})
	}
}

func TestExecStartErrors(t *testing.T) {
	c := startAgent(t)
	dir := tempDir(t)
	noexec := filepath.Join(dir, "noexec")
	os.WriteFile(noexec, []byte("#!/bin/sh\n"), 0o644)

	tests := []struct {
		name string
		req  ExecRequest
		is   error
		msg  string
	}{
		{"missing executable", ExecRequest{Args: []string{"no-such-prog-shoal"}}, fs.ErrNotExist, "agent exec no-such-prog-shoal: executable file not found in $PATH"},
		{"missing absolute path", ExecRequest{Args: []string{"/no/such/prog"}}, fs.ErrNotExist, "no such file or directory"},
		{"missing cwd", ExecRequest{Args: []string{"true"}, Cwd: "/no/such/dir"}, fs.ErrNotExist, "cwd /no/such/dir: no such file or directory"},
		{"cwd is a file", ExecRequest{Args: []string{"true"}, Cwd: noexec}, fs.ErrInvalid, "not a directory"},
		{"relative cwd", ExecRequest{Args: []string{"true"}, Cwd: "tmp"}, fs.ErrInvalid, "must be an absolute path"},
		{"not executable", ExecRequest{Args: []string{noexec}}, fs.ErrPermission, "permission denied"},
		{"empty argv", ExecRequest{}, fs.ErrInvalid, "empty command line"},
		{"bad env", ExecRequest{Args: []string{"true"}, Env: []string{"NOEQUALS"}}, fs.ErrInvalid, "want KEY=VALUE"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := c.Exec(context.Background(), tt.req)
			if err == nil {
				p.Close()
				t.Fatal("Exec succeeded, want an error")
			}
			if !errors.Is(err, tt.is) {
				t.Errorf("err = %v, want one wrapping %v", err, tt.is)
			}
			var ae *Error
			if !errors.As(err, &ae) || ae.Op != "exec" {
				t.Errorf("err = %#v, want *Error with Op exec", err)
			}
			if !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("err = %q, want it to contain %q", err, tt.msg)
			}
		})
	}
}

func TestExecStdin(t *testing.T) {
	c := startAgent(t)
	tests := []struct {
		name string
		size int
	}{
		{"empty", 0},
		{"small", 5},
		{"larger than pipe and frame", 3<<20 + 17},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			input := make([]byte, tt.size)
			rand.NewChaCha8([32]byte{1}).Read(input)
			p, err := c.Exec(context.Background(), ExecRequest{Args: []string{"cat"}, Stdin: true})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			werr := make(chan error, 1)
			go func() { // concurrently with Recv: cat echoes as it reads
				for b := input; len(b) > 0; {
					n := min(len(b), 100_000)
					if err := p.WriteStdin(b[:n]); err != nil {
						werr <- err
						return
					}
					b = b[n:]
				}
				werr <- p.CloseStdin()
			}()
			r := collect(t, p)
			if err := <-werr; err != nil {
				t.Fatal(err)
			}
			if r.stdout != string(input) {
				t.Errorf("stdout: %d bytes, sha256 %x; want %d bytes, sha256 %x",
					len(r.stdout), sha256.Sum256([]byte(r.stdout)), len(input), sha256.Sum256(input))
			}
			if r.exit != (ExitStatus{}) {
				t.Errorf("exit = %+v", r.exit)
			}
		})
	}
}

// A command that never reads its stdin: the client fills the pipe, then
// closes; the agent must notice the hang-up and kill the command.
func TestExecCloseWhileStdinBlocked(t *testing.T) {
	c := startAgent(t)
	p, err := c.Exec(context.Background(), ExecRequest{Args: []string{"sleep", "100"}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	pid := p.Pid()
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.WriteStdin(make([]byte, 4<<20)) // blocks: pipe and socket buffers fill up
	}()
	time.Sleep(200 * time.Millisecond)
	p.Close()
	<-done
	waitDead(t, pid, "command with blocked stdin")
}

// Output of the two streams arrives in the order it was written when each
// write is read before the next is made: the command waits for the test to
// have seen each event (two pipes promise no order otherwise; a 50 ms pause
// between writes did not hold at load 88).
func TestExecOrderAcrossStreams(t *testing.T) {
	c := startAgent(t)
	p, err := c.Exec(context.Background(), ExecRequest{Stdin: true, Args: []string{"sh", "-c",
		"echo out1; read x; echo err1 >&2; read x; echo out2; read x; echo err2 >&2"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var order strings.Builder
	for {
		ev, err := p.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		switch ev.Kind {
		case EventStdout:
			order.WriteString("O:" + string(ev.Data))
		case EventStderr:
			order.WriteString("E:" + string(ev.Data))
		}
		if (ev.Kind == EventStdout || ev.Kind == EventStderr) && strings.Count(order.String(), "\n") < 4 {
			if err := p.WriteStdin([]byte("\n")); err != nil {
				t.Fatal(err)
			}
		}
	}
	if want := "O:out1\nE:err1\nO:out2\nE:err2\n"; order.String() != want {
		t.Fatalf("event order = %q, want %q", order.String(), want)
	}
}

func TestExecTimeoutKillsProcessGroup(t *testing.T) {
	c := startAgent(t)
	p, err := c.Exec(context.Background(), ExecRequest{
		Args:    []string{"sh", "-c", "sleep 100 & echo $!; sleep 100"},
		Timeout: 300 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	grandchild := atoi(t, readLine(t, p))
	start := time.Now()
	r := collect(t, p)
	if want := (ExitStatus{Code: 137, Signal: "SIGKILL", TimedOut: true}); r.exit != want {
		t.Errorf("exit = %+v, want %+v", r.exit, want)
	}
	// About 300 ms; the bound only tells a kill from waiting for the sleep
	// (100 s) on however loaded a host.
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("exit came %v after start, want about 300ms", d)
	}
	waitDead(t, grandchild, "backgrounded grandchild")
}

func TestExecCloseKills(t *testing.T) {
	c := startAgent(t)
	tests := []struct {
		name string
		args []string
	}{
		{"leader", []string{"sleep", "100"}},
		{"leader and grandchild", []string{"sh", "-c", "sleep 100 & echo $!; wait"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := c.Exec(context.Background(), ExecRequest{Args: tt.args})
			if err != nil {
				t.Fatal(err)
			}
			pids := []int{p.Pid()}
			if tt.args[0] == "sh" {
				pids = append(pids, atoi(t, readLine(t, p)))
			}
			if !alive(pids[0]) {
				t.Fatal("not running before Close")
			}
			p.Close()
			for _, pid := range pids {
				waitDead(t, pid, "process after Close")
			}
			if _, err := p.Recv(); err == nil {
				t.Error("Recv after Close succeeded")
			}
		})
	}
}

func TestExecContextCancel(t *testing.T) {
	c := startAgent(t)
	ctx, cancel := context.WithCancel(context.Background())
	p, err := c.Exec(ctx, ExecRequest{Args: []string{"sleep", "100"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	time.AfterFunc(100*time.Millisecond, cancel)
	_, err = p.Recv()
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Recv err = %v, want context.Canceled", err)
	}
	waitDead(t, p.Pid(), "command after ctx cancel")
}

func TestExecSignal(t *testing.T) {
	c := startAgent(t)
	p, err := c.Exec(context.Background(), ExecRequest{Args: []string{"sh", "-c", "sleep 100 & echo $!; wait"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	grandchild := atoi(t, readLine(t, p))
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	r := collect(t, p)
	if want := (ExitStatus{Code: 143, Signal: "SIGTERM"}); r.exit != want {
		t.Errorf("exit = %+v, want %+v", r.exit, want)
	}
	waitDead(t, grandchild, "grandchild after group SIGTERM")
	if err := p.Signal(syscall.SIGTERM); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Signal after exit: err = %v, want fs.ErrNotExist", err)
	}
}

// A command that leaves a background process holding stdout must still
// report its exit promptly (after OutputGrace).
func TestExecBackgroundHoldsOutput(t *testing.T) {
	c := startAgent(t)
	start := time.Now()
	p, err := c.Exec(context.Background(), ExecRequest{Args: []string{"sh", "-c", "sleep 30 & echo $!"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	bg := atoi(t, readLine(t, p))
	defer syscall.Kill(bg, syscall.SIGKILL)
	r := collect(t, p)
	if r.exit != (ExitStatus{}) {
		t.Errorf("exit = %+v", r.exit)
	}
	// Not held by the background sleep (30 s), however loaded the host.
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("exit took %v", d)
	}
}

func TestExecConcurrent(t *testing.T) {
	c := startAgent(t)
	const n = 50
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, err := c.Exec(context.Background(), ExecRequest{
				Args: []string{"sh", "-c", `echo out$1; echo err$1 >&2; exit $(($1 % 7))`, "sh", fmt.Sprint(i)},
			})
			if err != nil {
				errs <- err
				return
			}
			defer p.Close()
			var out, errb bytes.Buffer
			var exit *ExitStatus
			for {
				ev, err := p.Recv()
				if err == io.EOF {
					break
				}
				if err != nil {
					errs <- err
					return
				}
				switch ev.Kind {
				case EventStdout:
					out.Write(ev.Data)
				case EventStderr:
					errb.Write(ev.Data)
				case EventExit:
					exit = &ev.Exit
				}
			}
			if out.String() != fmt.Sprintf("out%d\n", i) || errb.String() != fmt.Sprintf("err%d\n", i) ||
				exit == nil || exit.Code != i%7 {
				errs <- fmt.Errorf("exec %d: stdout %q stderr %q exit %+v", i, out.String(), errb.String(), exit)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestPing(t *testing.T) {
	c := startAgent(t)
	info, err := c.Ping(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.Version != Version || info.Pid != os.Getpid() || info.RSSBytes <= 0 {
		t.Errorf("Ping = %+v", info)
	}
}

func TestUnsupportedOp(t *testing.T) {
	c := startAgent(t)
	err := c.unary(context.Background(), Op(255), "", struct{}{}, nil) // no such op
	var ae *Error
	if !errors.As(err, &ae) || ae.Code != CodeUnsupported {
		t.Errorf("err = %v, want code %s", err, CodeUnsupported)
	}
}

func TestDialError(t *testing.T) {
	c := NewClient("/nonexistent/agent.sock")
	if _, err := c.Ping(context.Background()); err == nil || !strings.Contains(err.Error(), "agent ping") {
		t.Errorf("err = %v", err)
	}
}

// A client that reads slowly still gets all of a command's output: what
// the pipe holds when the command exits (its pump waiting for the client,
// or for a CPU) is read after the exit's grace, not dropped (it was, under
// load: the "large output" case above lost its last 64 KiB). A grace of a
// millisecond stands for a pump held up that long.
func TestExecSlowReaderGetsAllOutput(t *testing.T) {
	c := serveOn(t, NewServer(Config{OutputGrace: time.Millisecond}))
	const size = 1 << 20
	for i := range 4 {
		p, err := c.Exec(context.Background(), ExecRequest{Args: []string{"sh", "-c", fmt.Sprintf("head -c %d /dev/zero | tr '\\0' a", size)}})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for {
			time.Sleep(2 * time.Millisecond) // behind the pump
			ev, err := p.Recv()
			if err != nil {
				t.Fatalf("run %d, after %d bytes: %v", i, n, err)
			}
			if ev.Kind == EventExit {
				break
			}
			n += len(ev.Data)
		}
		p.Close()
		if n != size {
			t.Errorf("run %d: %d bytes of output, want %d", i, n, size)
		}
	}
}
