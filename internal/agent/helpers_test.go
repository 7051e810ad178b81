package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// One in-process server per test binary: it owns SIGCHLD handling. It does
// not reap all children (ReapAll false), so the tests may still use exec.Cmd.
var (
	srvOnce sync.Once
	testSrv *Server
)

// startAgent serves the in-process server on a fresh socket and returns a
// client for it. Socket paths stay short (sun_path is 108 bytes), hence
// os.MkdirTemp("", "ag") rather than t.TempDir.
func startAgent(t testing.TB) *Client {
	t.Helper()
	srvOnce.Do(func() { testSrv = NewServer(Config{}) })
	return serveOn(t, testSrv)
}

// serveOn serves srv on a fresh socket.
func serveOn(t testing.TB, srv *Server) *Client {
	t.Helper()
	sock := shortSocket(t)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	t.Cleanup(func() { l.Close() })
	return NewClient(sock)
}

func shortSocket(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ag")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "s")
}

type result struct {
	stdout, stderr string
	order          string // kinds and data of output events in arrival order
	exit           ExitStatus
}

// collect receives until io.EOF, checking there is exactly one exit event
// and that it is last.
func collect(t testing.TB, p *Process) result {
	t.Helper()
	var r result
	var out, errb, order bytes.Buffer
	exits := 0
	for {
		ev, err := p.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		if exits > 0 {
			t.Fatalf("event %v after the exit event", ev.Kind)
		}
		switch ev.Kind {
		case EventStdout:
			out.Write(ev.Data)
			order.WriteString("O:" + string(ev.Data))
		case EventStderr:
			errb.Write(ev.Data)
			order.WriteString("E:" + string(ev.Data))
		case EventExit:
			exits++
			r.exit = ev.Exit
		default:
			t.Fatalf("unknown event kind %d", ev.Kind)
		}
	}
	if exits != 1 {
		t.Fatalf("got %d exit events, want 1", exits)
	}
	r.stdout, r.stderr, r.order = out.String(), errb.String(), order.String()
	return r
}

func run(t testing.TB, c *Client, req ExecRequest) result {
	t.Helper()
	p, err := c.Exec(context.Background(), req)
	if err != nil {
		t.Fatalf("Exec %q: %v", req.Args, err)
	}
	defer p.Close()
	return collect(t, p)
}

// alive reports whether pid is a live (not zombie) process.
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// pid (comm) S ...: the state follows the last ')'.
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && i+2 < len(b) && b[i+2] != 'Z' && b[i+2] != 'X'
}

func waitDead(t testing.TB, pid int, what string) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("%s (pid %d) still alive", what, pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// readLine reads stdout events until a full line arrives.
func readLine(t testing.TB, p *Process) string {
	t.Helper()
	var line []byte
	for !bytes.Contains(line, []byte("\n")) {
		ev, err := p.Recv()
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		if ev.Kind != EventStdout {
			t.Fatalf("got %v event %q, want stdout", ev.Kind, ev.Data)
		}
		line = append(line, ev.Data...)
	}
	return strings.TrimSpace(string(line))
}

func atoi(t testing.TB, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("want a number, got %q", s)
	}
	return n
}

// The agent binary, built once per test run for the subprocess tests.
var (
	binOnce sync.Once
	binPath string
	binErr  error
)

func agentBinary(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		if p := os.Getenv("SHOAL_AGENT_BIN"); p != "" { // measure a given build
			binPath = p
			return
		}
		// go test puts its own GOROOT/bin first in PATH.
		goTool, err := exec.LookPath("go")
		if err != nil {
			binErr = errors.New("go tool not found")
			return
		}
		dir, err := os.MkdirTemp("", "agbin")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "shoal-agent")
		cmd := exec.Command(goTool, "build", "-o", binPath, "../../cmd/shoal-agent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = errors.New("go build: " + err.Error() + "\n" + string(out))
		}
	})
	if binErr != nil {
		t.Skipf("cannot build shoal-agent: %v", binErr)
	}
	return binPath
}

// startBinary runs the agent binary with --listen on a fresh socket and waits
// until it answers.
func startBinary(t testing.TB, sys *syscall.SysProcAttr) (*exec.Cmd, *Client) {
	t.Helper()
	bin := agentBinary(t)
	sock := shortSocket(t)
	cmd := exec.Command(bin, "--listen", sock)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = sys
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	c := NewClient(sock)
	waitReady(t, c)
	return cmd, c
}

func waitReady(t testing.TB, c *Client) Info {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		info, err := c.Ping(ctx)
		cancel()
		if err == nil {
			return info
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent not ready: %v", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func procStatus(t testing.TB, pid int, field string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return "" // gone meanwhile
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binPath != "" && os.Getenv("SHOAL_AGENT_BIN") == "" {
		os.RemoveAll(filepath.Dir(binPath))
	}
	os.Exit(code)
}

// waitFor polls cond until it holds or the deadline passes; then the test
// fails with what and why(). Tests wait for the event they assert instead of
// sleeping and hoping it happened.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool, why func() string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s: %s", d, what, why())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// inChildProcess tells whether this test runs in a child process of its
// own (env set to 1). If not, it runs the test alone in one, fails with
// its output if it failed, logs the output, and returns false.
func inChildProcess(t *testing.T, env string) bool {
	t.Helper()
	if os.Getenv(env) == "1" {
		return true
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v")
	cmd.Env = append(os.Environ(), env+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Logf("%s", out)
	return false
}
