package container

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// escapeResults runs the escape helper (test/e2e/testdata/escape, in the
// test root as /bin/escape) in a sandbox: attempt name → "denied ERR" or
// "ALLOWED ...", and its descriptors ("fds").
func escapeResults(t *testing.T, h sandbox.Handle) map[string]string {
	t.Helper()
	out, code := run(t, h, "/bin/escape 65536")
	if code != 0 {
		t.Fatalf("escape: exit %d: %s", code, out)
	}
	res := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		name, rest, _ := strings.Cut(line, " ")
		res[name] = rest
	}
	return res
}

// checkOutOfReach checks what escapeResults reports: nothing of PID 1 is
// reachable, and the system calls only the seccomp filter stops (on a
// child of the command's own) fail with EPERM.
func checkOutOfReach(t *testing.T, res map[string]string) {
	t.Helper()
	for _, name := range []string{
		"ptrace-attach-pid1", "ptrace-seize-pid1",
		"open-mem-rw", "open-mem-ro", "open-environ", "open-cwd",
		"readlink-exe", "readlink-fd2", "readlink-fd3",
		"write-fd1", "write-fd2",
		"process_vm_readv-pid1", "process_vm_writev-pid1", "kcmp-pid1", "pidfd_getfd-pid1",
	} {
		if r, ok := res[name]; !ok || !strings.HasPrefix(r, "denied ") {
			t.Errorf("%s: %q, want denied", name, r)
		}
	}
	// Only seccomp stops these: the child is the command's own.
	for _, name := range []string{"ptrace-seize-child", "process_vm_readv-child"} {
		if r := res[name]; r != "denied operation not permitted" {
			t.Errorf("%s: %q, want denied with EPERM (the seccomp filter)", name, r)
		}
	}
	// A command has its own stdio and nothing else of the agent's.
	fds := strings.Fields(res["fds"])
	if len(fds) != 3 {
		t.Errorf("command descriptors %v: want 0, 1 and 2 only", fds)
	}
	for _, fd := range fds {
		n, target, _ := strings.Cut(fd, "=")
		if (n != "0" && n != "1" && n != "2") || (target != "/dev/null" && !strings.HasPrefix(target, "pipe:")) {
			t.Errorf("command descriptor %s: want 0, 1 or 2, a pipe or /dev/null", fd)
		}
	}
}

// agentFDs lists the descriptors of a process, seen from the host: their
// targets, and whether they are close-on-exec.
func agentFDs(t *testing.T, pid int) (targets map[string]string, cloexec map[string]bool) {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	targets, cloexec = map[string]string{}, map[string]bool{}
	for _, e := range ents {
		// The agent opens and closes descriptors all the time (a
		// connection per request): one gone by the time it is read was
		// transient, not held.
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		info, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, e.Name()))
		if err != nil {
			continue
		}
		targets[e.Name()] = target
		for _, l := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(l, "flags:"); ok {
				fl, _ := strconv.ParseUint(strings.TrimSpace(v), 8, 64)
				cloexec[e.Name()] = fl&unix.O_CLOEXEC != 0
			}
		}
	}
	return targets, cloexec
}

// TestAgentOutOfReach: a command in a sandbox, cold or pooled, can neither
// trace the agent nor reach into it through /proc or the cross-process
// memory calls, cannot trace anything at all (seccomp), inherits none of
// the agent's descriptors, and the agent holds no host file.
func TestAgentOutOfReach(t *testing.T) {
	requireRoot(t)
	for _, mode := range []string{"cold", "pooled"} {
		t.Run(mode, func(t *testing.T) {
			var b *Backend
			if mode == "cold" {
				b = newBackend(t)
			} else {
				b = newPoolBackend(t, t.TempDir(), 1)
				waitPool(t, b, 1)
			}
			spec := poolSpec(t) // the real agent
			h := create(t, b, spec)
			if pooled := h.Data["pooled"] == "true"; pooled != (mode == "pooled") {
				t.Fatalf("pooled %v, want %s", pooled, mode)
			}
			logPath := b.agentLogPath(h, h.Data["runc_id"])
			before := fileSize(logPath)
			checkOutOfReach(t, escapeResults(t, h))
			if grown := fileSize(logPath) - before; grown != 0 {
				t.Errorf("agent log grew by %d bytes", grown)
			}
			// The agent's own: no host file but /dev/null (the Go runtime
			// reads the container's cgroup files for GOMAXPROCS), and
			// nothing but 0, 1 and 2 that a command could inherit.
			fds, cloexec := agentFDs(t, initPidOf(t, b, h))
			for n, target := range fds {
				if strings.HasPrefix(target, "/") && target != "/dev/null" && !strings.HasPrefix(target, "/sys/fs/cgroup/") {
					t.Errorf("agent fd %s is %s: want no file", n, target)
				}
				if n != "0" && n != "1" && n != "2" && !cloexec[n] {
					t.Errorf("agent fd %s (%s) is not close-on-exec", n, target)
				}
			}
			if fds["0"] != "/dev/null" || fds["1"] != "/dev/null" || !strings.HasPrefix(fds["2"], "pipe:") {
				t.Errorf("agent stdio %q %q %q: want /dev/null, /dev/null and a pipe", fds["0"], fds["1"], fds["2"])
			}
		})
	}
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// scriptAgent writes a shell script to stand in for the agent.
func scriptAgent(t *testing.T, script string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "agent.sh")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+script+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestCreateOutOfTime: a create that runs out of time says so, as
// unavailable (retryable), and leaves nothing behind; its steps alone would
// report "signal: killed" (runc killed by the context) as an internal error.
func TestCreateOutOfTime(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	checked := 0
	for _, d := range []time.Duration{5 * time.Millisecond, 20 * time.Millisecond, 60 * time.Millisecond, 150 * time.Millisecond} {
		spec := newSpec(t)
		ctx, cancel := context.WithTimeout(context.Background(), d)
		h, err := b.Create(ctx, spec)
		cancel()
		if err == nil {
			if err := b.Delete(context.Background(), h); err != nil {
				t.Fatal(err)
			}
			continue
		}
		checked++
		if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "ran out of time") {
			t.Fatalf("Create within %s: %v; want unavailable, saying it ran out of time", d, err)
		}
		if left := leftovers(t, b, spec); len(left) > 0 {
			t.Errorf("left after a create out of time (%s): %v", d, left)
		}
	}
	if checked == 0 {
		t.Skip("every create finished within its time: nothing to check")
	}
}

// TestAgentStartupErrorReported: what an agent that dies at start-up wrote
// on its stderr is in Create's error (through the log pipe and the node's
// drain), and stays in the agent log.
func TestAgentStartupErrorReported(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	spec := newSpec(t)
	spec.AgentBinary = scriptAgent(t, "echo agent-boom >&2; exit 3")
	_, err := b.Create(createCtx(t), spec)
	if err == nil || !strings.Contains(err.Error(), "exited before it was ready") || !strings.Contains(err.Error(), "agent-boom") {
		t.Fatalf("Create: %v; want the agent's exit and its message", err)
	}
	if left := leftovers(t, b, spec); len(left) > 0 {
		t.Errorf("left after a failed Create: %v", left)
	}
}

// TestAgentLogCapped: an agent that writes more than the cap on its stderr
// costs the host the cap, and is not stalled by it (its writes fail).
func TestAgentLogCapped(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	spec := newSpec(t)
	spec.AgentBinary = scriptAgent(t, "head -c 4194304 /dev/zero >&2; echo after-the-cap >&2; exit 3")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, err := b.Create(ctx, spec)
	if err == nil {
		t.Fatal("Create succeeded")
	}
	// Its exit, not a start-up timeout: a stalled writer never gets there.
	if !strings.Contains(err.Error(), "exited before it was ready") {
		t.Errorf("Create: %v; want the agent's exit (was it stalled by its log?)", err)
	}
	data, rerr := os.ReadFile(filepath.Join(spec.Dir, agentLogName))
	if rerr != nil {
		t.Fatal(rerr)
	}
	if len(data) > agentLogCap+200 || len(data) < agentLogCap {
		t.Errorf("agent log of %d bytes, want the cap (%d) and a note", len(data), agentLogCap)
	}
	if !bytes.Contains(data, []byte("reached its cap")) || bytes.Contains(data, []byte("after-the-cap")) {
		t.Errorf("agent log ends with %q", data[max(0, len(data)-200):])
	}
}

// TestDrainAgentLogCap: the drain stops at the cap, notes it, and closes
// the pipe: a writer gets EPIPE, never blocks. A second drain (a node
// restart) starts at the size of the file and keeps within the cap.
func TestDrainAgentLogCap(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.log")
	os.WriteFile(path, bytes.Repeat([]byte("a"), agentLogCap-100), 0o640)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	d, err := drainAgentLog(r, path)
	if err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Repeat([]byte("b"), 1000)
	w.SetWriteDeadline(time.Now().Add(10 * time.Second))
	var werr error
	for range 1000 {
		if _, werr = w.Write(chunk); werr != nil {
			break
		}
	}
	if !errors.Is(werr, syscall.EPIPE) {
		t.Fatalf("writer: %v, want EPIPE once the cap is reached", werr)
	}
	d.settle(10 * time.Second)
	select {
	case <-d.done:
	default:
		t.Fatal("the drain did not stop at the cap")
	}
	data, _ := os.ReadFile(path)
	if n := len(data); n < agentLogCap || n > agentLogCap+200 || !bytes.Contains(data, []byte("reached its cap")) {
		t.Errorf("log of %d bytes (%q at the end)", n, data[max(0, n-120):])
	}
}

// TestAgentLogAfterRestart: the agent survives a node that stops reading
// its log (a restart), and a new Backend's Recover collects it again.
func TestAgentLogAfterRestart(t *testing.T) {
	requireRoot(t)
	state := t.TempDir()
	b, err := New(Config{StateDir: state, CgroupParent: testCgroupParent, PoolSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.agents.close) // the agent binary's tmpfs (agentcopy.go)
	spec := newSpec(t)
	h := create(t, b, spec)
	a := dial(t, h.AgentSocket)
	a.ask(t, "log before-the-restart")
	logPath := filepath.Join(spec.Dir, agentLogName)
	waitFileContains(t, logPath, "before-the-restart")

	// The node goes away: nobody reads the pipe any more.
	b.drains.mu.Lock()
	d := b.drains.m[spec.ID]
	b.drains.mu.Unlock()
	if d == nil {
		t.Fatal("no drain for the sandbox")
	}
	d.stop()
	for i := range 100 {
		a.ask(t, "log while-nobody-reads-"+strconv.Itoa(i)+"-"+strings.Repeat("x", 900))
	}
	if got := a.ask(t, "pid"); got != "1" {
		t.Fatalf("agent after logging into a closed pipe: pid %q", got)
	}

	b2, err := New(Config{StateDir: state, CgroupParent: testCgroupParent, PoolSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b2.agents.close) // the agent binary's tmpfs (agentcopy.go)
	if st, err := b2.Recover(context.Background(), h); err != nil || st != sandbox.StatusRunning {
		t.Fatalf("Recover: %v %v", st, err)
	}
	// Twice: one drain only.
	if _, err := b2.Recover(context.Background(), h); err != nil {
		t.Fatal(err)
	}
	a.ask(t, "log after-the-restart")
	waitFileContains(t, logPath, "after-the-restart")
	if data, _ := os.ReadFile(logPath); bytes.Count(data, []byte("after-the-restart")) != 1 {
		t.Errorf("log has the line %d times", bytes.Count(data, []byte("after-the-restart")))
	}
}

func waitFileContains(t *testing.T, path, s string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		data, _ := os.ReadFile(path)
		if bytes.Contains(data, []byte(s)) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s lacks %q after 10s:\n%s", path, s, data)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
