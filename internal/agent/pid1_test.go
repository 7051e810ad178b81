package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
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

// nsProcs lists the processes (host pids) in the pid namespace of pid.
func nsProcs(t *testing.T, pid int) []int {
	t.Helper()
	ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid))
	if err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", p)); err == nil && l == ns {
			out = append(out, p)
		}
	}
	return out
}

// The agent as PID 1 of a new pid namespace: orphans of its commands are
// reparented to it and must be reaped, while its own commands still get
// their exit statuses.
func TestPID1ReapsZombies(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for CLONE_NEWPID")
	}
	cmd, c := startBinary(t, &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID})
	info, err := c.Ping(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.Pid != 1 {
		t.Fatalf("agent pid in its namespace = %d, want 1", info.Pid)
	}
	agentPid := cmd.Process.Pid

	// Orphan-makers and plain exits, concurrently.
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			args, want := []string{"sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & exit 0"}, 0
			if i%2 == 1 {
				args, want = []string{"sh", "-c", "exit " + strconv.Itoa(i)}, i
			}
			p, err := c.Exec(context.Background(), ExecRequest{Args: args})
			if err != nil {
				errs <- err
				return
			}
			defer p.Close()
			r := collect(t, p)
			if r.exit.Code != want {
				errs <- fmt.Errorf("%q: exit %+v, want code %d (status stolen?)", args, r.exit, want)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	// The orphaned sleeps now belong to the agent (they outlive the
	// count however slow the host: they end when killed, below).
	orphans := 0
	for _, p := range nsProcs(t, agentPid) {
		if p != agentPid && procStatus(t, p, "PPid") == strconv.Itoa(agentPid) {
			orphans++
			syscall.Kill(p, syscall.SIGKILL)
		}
	}
	if orphans != 20 {
		t.Errorf("%d orphans reparented to the agent, want 20", orphans)
	}

	deadline := time.Now().Add(5 * time.Second)
	for {
		var left []string
		for _, p := range nsProcs(t, agentPid) {
			if p != agentPid {
				left = append(left, fmt.Sprintf("%d(%s)", p, procStatus(t, p, "State")))
			}
		}
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("processes left in the agent's namespace: %s", strings.Join(left, " "))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The agent as PID 1 survives every signal its workload can send it (as
// root of the namespace, with kill(1)), and so do its commands and their
// streams; the commands it starts still die of those signals.
func TestPID1SurvivesSignals(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for CLONE_NEWPID")
	}
	cmd, c := startBinary(t, &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID})
	if info, err := c.Ping(context.Background()); err != nil || info.Pid != 1 {
		t.Fatalf("ping: %+v %v, want pid 1", info, err)
	}
	// A running command's stream: one line per request on its stdin.
	p, err := c.Exec(context.Background(), ExecRequest{Args: []string{"sh", "-c", "while read l; do echo got $l; done"}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, s := range WorkloadSignals() {
		sig := s.(syscall.Signal)
		r := run(t, c, ExecRequest{Args: []string{"sh", "-c", fmt.Sprintf("kill -%d 1", int(sig))}})
		if r.exit.Code != 0 {
			t.Fatalf("kill -%d 1 in the namespace: %+v %s", int(sig), r.exit, r.stderr)
		}
		// Delivered (a handler is installed): the agent had it before it
		// answers the next request, or dies of it meanwhile.
		if _, err := c.Ping(context.Background()); err != nil {
			t.Fatalf("agent after %v: %v", sig, err)
		}
		if err := p.WriteStdin([]byte(sig.String() + "\n")); err != nil {
			t.Fatalf("stream after %v: %v", sig, err)
		}
		if got := readLine(t, p); got != "got "+sig.String() {
			t.Fatalf("stream after %v: %q", sig, got)
		}
	}
	if err := cmd.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("agent process: %v", err)
	}
	// From the host too: SIGTERM does not stop an init.
	cmd.Process.Signal(syscall.SIGTERM)
	if _, err := c.Ping(context.Background()); err != nil {
		t.Fatalf("agent after the host's SIGTERM: %v", err)
	}
	// Its commands get the default actions back.
	if r := run(t, c, ExecRequest{Args: []string{"sh", "-c", "kill -HUP $$; sleep 5"}}); r.exit.Signal != "SIGHUP" {
		t.Errorf("a command that signals itself: %+v, want killed by SIGHUP", r.exit)
	}
}

// The production start-up: SHOAL_AGENT_FD names an inherited listening
// socket; commands inherit neither the fd nor the variable. SIGTERM kills
// running commands and exits 0.
func TestBinaryInheritedSocket(t *testing.T) {
	bin := agentBinary(t)
	sock := shortSocket(t)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	lf, err := l.(*net.UnixListener).File()
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close() // the dup in lf keeps the socket listening
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "SHOAL_AGENT_FD=3")
	cmd.ExtraFiles = []*os.File{lf}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lf.Close()
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	c := NewClient(sock)
	info := waitReady(t, c)
	if info.Pid != cmd.Process.Pid {
		t.Errorf("Ping pid = %d, want %d", info.Pid, cmd.Process.Pid)
	}
	if r := run(t, c, ExecRequest{Args: []string{"env"}}); strings.Contains(r.stdout, "SHOAL_AGENT_FD") {
		t.Errorf("command inherited SHOAL_AGENT_FD:\n%s", r.stdout)
	}
	if r := run(t, c, ExecRequest{Args: []string{"ls", "-l", "/proc/self/fd/"}}); strings.Contains(r.stdout, "socket:") {
		t.Errorf("command inherited a socket:\n%s", r.stdout)
	}

	p, err := c.Exec(context.Background(), ExecRequest{Args: []string{"sh", "-c", "sleep 100 & echo $!; wait"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	grandchild := atoi(t, readLine(t, p))
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Errorf("agent exit after SIGTERM: %v, want status 0", err)
	}
	waitDead(t, p.Pid(), "command after agent SIGTERM")
	waitDead(t, grandchild, "grandchild after agent SIGTERM")
}

// Idle memory of the real binary after it has served some requests.
func TestIdleRSS(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	cmd, c := startBinary(t, nil)
	ctx := context.Background()
	dir := tempDir(t)
	for i := range 20 {
		run(t, c, ExecRequest{Args: []string{"sh", "-c", "echo hi; echo err >&2"}})
		path := filepath.Join(dir, "f"+strconv.Itoa(i))
		if _, err := c.WriteFile(ctx, path, 0, strings.NewReader(strings.Repeat("x", 1<<20))); err != nil {
			t.Fatal(err)
		}
		rc, _, err := c.ReadFile(ctx, path)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 1<<20)
		for {
			if _, err := rc.Read(buf); err != nil {
				break
			}
		}
		rc.Close()
		if _, err := c.ListDir(ctx, dir); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Stat(ctx, "/nonexistent"); !errors.Is(err, fs.ErrNotExist) {
			t.Fatal(err)
		}
	}
	time.Sleep(2 * time.Second)
	pid := cmd.Process.Pid
	rss, anon, file := procStatus(t, pid, "VmRSS"), procStatus(t, pid, "RssAnon"), procStatus(t, pid, "RssFile")
	info, err := c.Ping(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pss := "?"
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid)); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "Pss:"); ok {
				pss = strings.TrimSpace(v)
			}
		}
	}
	t.Logf("idle shoal-agent: VmRSS %s (RssAnon %s, RssFile %s, Pss %s, threads %s); Ping reports %d KiB",
		rss, anon, file, pss, procStatus(t, pid, "Threads"), info.RSSBytes>>10)
	if os.Getenv("SHOAL_AGENT_SMAPS") != "" {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
		t.Logf("smaps:\n%s", b)
	}
	kb, _ := strconv.Atoi(strings.TrimSuffix(rss, " kB"))
	if kb > 8<<10 {
		t.Errorf("idle VmRSS %d KiB, want < 8 MiB (target < 4 MiB)", kb)
	}
}
