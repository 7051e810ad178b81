package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// agentLogPath is the host file the node keeps a sandbox's agent log in.
func agentLogPath(id string) string {
	if pooled(id) {
		return filepath.Join(dataDir, "pool", "claimed", id, "agent.log")
	}
	return filepath.Join(dataDir, "sandboxes", id, "agent.log")
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// agentPid is the host pid of a sandbox's agent (its init).
func agentPid(t *testing.T, id string) int {
	t.Helper()
	state := readInitState(t, runcID(t, id))
	var st struct {
		Pid int `json:"init_process_pid"`
	}
	if err := json.Unmarshal(state, &st); err != nil || st.Pid <= 0 {
		t.Fatalf("runc state: %v %d", err, st.Pid)
	}
	return st.Pid
}

// readInitState reads the state the launcher recorded of a container: runc's
// state.json, or the native launcher's record (of the same form).
func readInitState(t *testing.T, runcID string) []byte {
	t.Helper()
	state, err := os.ReadFile(filepath.Join(dataDir, "runc", runcID, "state.json"))
	if errors.Is(err, os.ErrNotExist) {
		state, err = os.ReadFile(filepath.Join(dataDir, "pool", "native", runcID+".json"))
	}
	if err != nil {
		t.Fatal(err)
	}
	return state
}

// TestWorkloadCannotReachAgent: a command cannot trace the sandbox's agent
// (PID 1), open its memory, environment or descriptors, read or write its
// memory without /proc, nor trace a process of its own (seccomp), nor queue
// the agent a signal with a forged siginfo (a fault, seccomp); writing
// to the agent's stdout and stderr fails and costs the host's disk nothing;
// and the command holds no descriptor but its own stdio.
func TestWorkloadCannotReachAgent(t *testing.T) {
	need(t)
	id := create(t)
	logPath := agentLogPath(id)
	before := fileSize(logPath)
	const tried = 1 << 20
	stdout, stderr, code := run3(nil, "exec", id, "--", "/bin/escape", "1048576")
	if code != 0 {
		t.Fatalf("escape: exit %d: %s %s", code, stdout, stderr)
	}
	res := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(stdout), "\n") {
		name, rest, _ := strings.Cut(line, " ")
		res[name] = rest
	}
	t.Logf("pooled %v:\n%s", pooled(id), stdout)
	for _, name := range []string{
		"ptrace-attach-pid1", "ptrace-seize-pid1",
		"open-mem-rw", "open-mem-ro", "open-environ", "open-cwd",
		"readlink-exe", "readlink-fd2", "readlink-fd3",
		"write-fd1", "write-fd2",
		"process_vm_readv-pid1", "process_vm_writev-pid1", "kcmp-pid1", "pidfd_getfd-pid1",
		"ptrace-seize-child", "process_vm_readv-child",
		"rt_sigqueueinfo-pid1", "rt_sigqueueinfo-pid1-high", "rt_tgsigqueueinfo-pid1", "pidfd_send_signal-info-pid1",
	} {
		if r, ok := res[name]; !ok || !strings.HasPrefix(r, "denied ") {
			t.Errorf("%s: %q, want denied", name, r)
		}
	}
	for _, name := range []string{"rt_sigqueueinfo-self", "pidfd_send_signal-self"} {
		if r := res[name]; strings.HasPrefix(r, "denied ") || r == "" {
			t.Errorf("%s: %q, want allowed", name, r)
		}
	}
	for _, name := range []string{"ptrace-seize-child", "process_vm_readv-child"} {
		if r := res[name]; r != "denied operation not permitted" {
			t.Errorf("%s: %q, want EPERM from the seccomp filter", name, r)
		}
	}
	fds := strings.Fields(res["fds"])
	if len(fds) != 3 {
		t.Errorf("command descriptors %v: want 0, 1 and 2 only", fds)
	}
	for _, fd := range fds {
		n, target, _ := strings.Cut(fd, "=")
		if (n != "0" && n != "1" && n != "2") || (target != "/dev/null" && !strings.HasPrefix(target, "pipe:")) {
			t.Errorf("command descriptor %s: want its own stdio (a pipe or /dev/null)", fd)
		}
	}
	if grown := fileSize(logPath) - before; grown >= tried || grown > 4096 {
		t.Errorf("the host's agent log grew by %d bytes", grown)
	}
	// And the sandbox still works, its agent untouched.
	if out, code := run(nil, "exec", id, "--", "echo", "fine"); code != 0 || out != "fine\n" {
		t.Fatalf("after: %d %q", code, out)
	}
}

// TestWedgedAgentDoesNotDelayRestart: a sandbox whose agent is stopped
// (SIGSTOP; a ptrace freeze looks the same) while `shoal serve` restarts
// does not keep the API from serving: health and lists answer at once, the
// wedged sandbox is shown in error while its agent does not answer, the
// others work, and it is running again once its agent is.
func TestWedgedAgentDoesNotDelayRestart(t *testing.T) {
	need(t)
	wedged := create(t)
	other := create(t)
	c := sdk(t)
	ctx := context.Background()
	// A running command in it: the session layer re-attaches to it on the
	// restart, and looks for orphans in its agent.
	if _, err := c.Start(ctx, &pb.ExecRequest{SandboxId: wedged, Args: []string{"sleep", "1000"}}); err != nil {
		t.Fatal(err)
	}
	pid := agentPid(t, wedged)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGCONT) })

	killServe()
	start := time.Now()
	if err := startServe(); err != nil {
		t.Fatal(err)
	}
	// The old serve never listened (minutes, until the agent answered):
	// a bound far above a loaded host's start-up time tells the two apart.
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("serve took %s to answer health checks", d)
	}
	c = sdk(t) // serve listens on a new port
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	sbs, err := c.List(lctx)
	cancel()
	if err != nil {
		t.Fatalf("list after the restart: %v", err)
	}
	var seen int
	for _, sb := range sbs {
		if sb.Id == wedged || sb.Id == other {
			seen++
		}
	}
	if seen != 2 {
		t.Fatalf("list after the restart lacks a sandbox: %v", sbs)
	}
	if res, err := http.Get(apiURL + "/healthz"); err != nil || res.StatusCode != http.StatusOK {
		t.Fatalf("health: %v", err)
	}

	// The wedged one is reported as such, soon.
	deadline := time.Now().Add(15 * time.Second)
	var sb *pb.Sandbox
	for {
		sb, err = c.Get(ctx, wedged)
		if err == nil && sb.State == pb.SandboxState_SANDBOX_STATE_ERROR {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("wedged sandbox after 15s: %v %v", sb, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !strings.Contains(sb.Error, "has not answered") {
		t.Errorf("wedged sandbox's error: %q", sb.Error)
	}
	if out, code := run(nil, "exec", wedged, "--", "true"); code == 0 || !strings.Contains(out, "failed_precondition") {
		t.Errorf("exec in the wedged sandbox: %d %s", code, out)
	}
	// The others work.
	if out, code := run(nil, "exec", other, "--", "echo", "fine"); code != 0 || out != "fine\n" {
		t.Fatalf("exec in the other sandbox: %d %q", code, out)
	}

	// Back.
	syscall.Kill(pid, syscall.SIGCONT)
	deadline = time.Now().Add(40 * time.Second)
	for {
		sb, err = c.Get(ctx, wedged)
		if err == nil && sb.State == pb.SandboxState_SANDBOX_STATE_RUNNING {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox after SIGCONT: %v %v", sb, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if out, code := run(nil, "exec", wedged, "--", "echo", "back"); code != 0 || out != "back\n" {
		t.Fatalf("exec after SIGCONT: %d %q", code, out)
	}
}

// TestNothingInsideNamesHostPaths: what a command reads of its sandbox's
// mounts and of its own and the agent's mappings names no host path: not
// the data directory, not where the binaries are (the agent's bind comes
// from a private tmpfs).
func TestNothingInsideNamesHostPaths(t *testing.T) {
	need(t)
	id := create(t)
	for _, f := range []string{"/proc/self/mountinfo", "/proc/1/mountinfo", "/proc/self/maps", "/proc/self/mounts"} {
		out, code := run(nil, "exec", id, "--", "cat", f)
		if code != 0 || out == "" {
			t.Fatalf("cat %s: %d %s", f, code, out)
		}
		for _, host := range []string{dataDir, binDir} {
			if strings.Contains(out, host) {
				t.Errorf("%s names the host path %s:\n%s", f, host, out)
			}
		}
		if strings.Contains(f, "mountinfo") && !strings.Contains(out, " /.shoal/agent ") {
			t.Errorf("%s: no agent bind:\n%s", f, out)
		}
	}
}

// TestAgentSurvivesWorkloadSignals: the sandbox's root sends its agent
// (PID 1) every signal that would end a process by default; the sandbox,
// a command streaming meanwhile and its stream survive.
func TestAgentSurvivesWorkloadSignals(t *testing.T) {
	need(t)
	id := create(t)
	type result struct {
		out  string
		code int
	}
	done := make(chan result, 1)
	go func() {
		out, code := run(nil, "exec", id, "--", "sh", "-c", "echo start; touch /tmp/started; while [ ! -e /tmp/stop ]; do echo tick; sleep 0.1; done; echo end")
		done <- result{out, code}
	}()
	// The stream runs before the signals.
	waitFor(t, time.Minute, "the streaming command", func() bool {
		_, code := run(nil, "exec", id, "--", "test", "-e", "/tmp/started")
		return code == 0
	})
	for _, sig := range []syscall.Signal{syscall.SIGHUP, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGILL, syscall.SIGTRAP,
		syscall.SIGABRT, syscall.SIGBUS, syscall.SIGFPE, syscall.SIGUSR1, syscall.SIGSEGV, syscall.SIGUSR2, syscall.SIGPIPE,
		syscall.SIGALRM, syscall.SIGTERM, syscall.SIGSTKFLT, syscall.SIGXCPU, syscall.SIGXFSZ, syscall.SIGVTALRM,
		syscall.SIGIO, syscall.SIGPWR, syscall.SIGSYS} {
		if out, code := run(nil, "exec", id, "--", "kill", "-"+strconv.Itoa(int(sig)), "1"); code != 0 {
			t.Fatalf("kill -%d 1: %d %s", int(sig), code, out)
		}
		if out, code := run(nil, "exec", id, "--", "echo", "alive"); code != 0 || out != "alive\n" {
			t.Fatalf("after %v: %d %q", sig, code, out)
		}
	}
	if out, code := run(nil, "exec", id, "--", "touch", "/tmp/stop"); code != 0 {
		t.Fatalf("touch: %s", out)
	}
	r := <-done
	if r.code != 0 || !strings.HasPrefix(r.out, "start\ntick\n") || !strings.HasSuffix(r.out, "tick\nend\n") {
		t.Fatalf("the streaming command: exit %d, output %q", r.code, r.out)
	}
}
