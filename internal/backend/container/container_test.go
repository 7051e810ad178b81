package container

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/netpolicy"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Set by TestMain when the backend tests can run.
var (
	skipReason  string // why root-only tests skip; "" when they run
	agentBinary string // testdata/testagent, built static
	realAgent   string // cmd/shoal-agent, built static (for pooled sandboxes)
	lowerDir    string // a busybox root, the single lower layer
)

const testCgroupParent = "shoal-test"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		helperMain()
		return
	}
	tmp, err := os.MkdirTemp("", "shoal-container-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := setup(tmp); err != nil {
		skipReason = err.Error()
	}
	code := m.Run()
	if skipReason == "" {
		// The per-sandbox cgroups are gone; remove their shared parent.
		if mounts, err := cgroupMounts(); err == nil {
			for _, mnt := range mounts {
				os.Remove(filepath.Join(mnt.dir, testCgroupParent))
			}
		}
	}
	os.RemoveAll(tmp)
	os.Exit(code)
}

// setup builds the test agent and the busybox root, or says why it cannot.
func setup(tmp string) error {
	if os.Geteuid() != 0 {
		return errors.New("needs root")
	}
	if _, err := exec.LookPath("runc"); err != nil {
		return errors.New("needs runc in PATH")
	}
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		return errors.New("needs a static busybox in PATH")
	}
	agentBinary = filepath.Join(tmp, "testagent")
	build := exec.Command("go", "build", "-o", agentBinary, "./testdata/testagent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("build test agent: %v: %s", err, out)
	}
	realAgent = filepath.Join(tmp, "shoal-agent")
	build = exec.Command("go", "build", "-o", realAgent, "github.com/shoal-sandbox/shoal/cmd/shoal-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("build shoal-agent: %v: %s", err, out)
	}
	escape := filepath.Join(tmp, "escape")
	build = exec.Command("go", "build", "-o", escape, "../../../test/e2e/testdata/escape")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("build escape: %v: %s", err, out)
	}
	lowerDir = filepath.Join(tmp, "busybox-root")
	for _, d := range []string{"bin", "etc", "root", "tmp", "proc", "sys", "dev"} {
		if err := os.MkdirAll(filepath.Join(lowerDir, d), 0o755); err != nil {
			return err
		}
	}
	os.Chmod(filepath.Join(lowerDir, "tmp"), 0o777|os.ModeSticky)
	data, err := os.ReadFile(busybox)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(lowerDir, "bin", "busybox"), data, 0o755); err != nil {
		return err
	}
	if data, err = os.ReadFile(escape); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(lowerDir, "bin", "escape"), data, 0o755); err != nil {
		return err
	}
	// A setuid-root copy, as sudo is, and a user to run it as.
	suid := filepath.Join(lowerDir, "bin", "escape-suid")
	if err := os.WriteFile(suid, data, 0o755); err != nil {
		return err
	}
	if err := os.Chmod(suid, os.ModeSetuid|0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(lowerDir, "etc", "passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/tmp:/bin/sh\n"), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(lowerDir, "etc", "group"), []byte("root:x:0:\nuser:x:1000:\n"), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(lowerDir, "etc", "hosts"), []byte("127.0.0.1\tlocalhost # the layer's\n"), 0o644); err != nil {
		return err
	}
	for _, app := range []string{"sh", "cat", "echo", "sleep", "ls", "ps", "id", "hostname", "ip", "touch", "mkdir", "rm", "env", "grep", "unshare", "true", "mount", "stat", "head"} {
		if err := os.Symlink("busybox", filepath.Join(lowerDir, "bin", app)); err != nil {
			return err
		}
	}
	return os.WriteFile(filepath.Join(lowerDir, "etc", "lower-file"), []byte("from the lower\n"), 0o644)
}

func requireRoot(t testing.TB) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

func newBackend(t testing.TB) *Backend {
	t.Helper()
	b, err := New(Config{StateDir: t.TempDir(), CgroupParent: testCgroupParent, PoolSize: -1, UserNS: testUserNS})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.agents.close) // the agent binary's tmpfs (agentcopy.go)
	return b
}

// testUserNS is the user namespace mode of the tests' backends:
// SHOAL_TEST_USERNS=off|on|auto (default auto), to compare (benchmarks).
var testUserNS = os.Getenv("SHOAL_TEST_USERNS")

// testLauncher is the launcher of the tests' pools:
// SHOAL_TEST_LAUNCHER=runc|native (default runc; serve defaults to native,
// so the e2e and SDK suites run that one), to run the pool tests with
// either.
var testLauncher = os.Getenv("SHOAL_TEST_LAUNCHER")

func newID(t testing.TB) string {
	var r [6]byte
	rand.Read(r[:])
	return "t-" + hex.EncodeToString(r[:])
}

func newSpec(t testing.TB) sandbox.Spec {
	return sandbox.Spec{
		ID:          newID(t),
		Dir:         t.TempDir(),
		Layers:      []sandbox.Layer{{Digest: "sha256:test", Kind: "base", MountPath: lowerDir}},
		AgentBinary: agentBinary,
		Env:         []string{"SHOAL_TEST=1"},
	}
}

// create creates a sandbox that is deleted when the test ends.
// createCtx bounds a test's create more loosely than the backend's own
// default (sandbox.DefaultStartTimeout, 30 s), which a host at load 100
// can exceed: a test checks what a create does, not how fast.
func createCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func create(t testing.TB, b *Backend, spec sandbox.Spec) sandbox.Handle {
	t.Helper()
	h, err := b.Create(createCtx(t), spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.Delete(context.Background(), h); err != nil {
			t.Error(err)
		}
	})
	return h
}

// agentConn is a connection to a test agent.
type agentConn struct {
	c  net.Conn
	rd *bufio.Reader
}

func dial(t testing.TB, sock string) *agentConn {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &agentConn{c: c, rd: bufio.NewReader(c)}
}

func (a *agentConn) ask(t testing.TB, req string) string {
	t.Helper()
	a.c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintln(a.c, req); err != nil {
		t.Fatalf("%s: %v", req, err)
	}
	line, err := a.rd.ReadBytes('\n')
	if err != nil {
		t.Fatalf("%s: %v", req, err)
	}
	var r struct{ Out, Err string }
	if err := json.Unmarshal(line, &r); err != nil {
		t.Fatalf("%s: %v: %s", req, err, line)
	}
	if r.Err != "" {
		t.Fatalf("%s: agent: %s (output %q)", req, r.Err, r.Out)
	}
	return r.Out
}

func TestCreate(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	spec := newSpec(t)
	spec.Resources = sandbox.Resources{MemoryBytes: 256 << 20, MilliCPU: 500, Pids: 100}

	// An fd we leak on purpose (no O_CLOEXEC): it reaches runc, but must
	// not reach the container.
	leak, err := unix.Open("/etc/hostname", unix.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	h, err := b.Create(createCtx(t), spec)
	unix.Close(leak)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Delete(context.Background(), h) })

	if h.ID != spec.ID || h.Backend != "container" || h.AgentSocket != filepath.Join(spec.Dir, "agent.sock") {
		t.Errorf("handle %+v", h)
	}
	if h.Data["rootfs"] != filepath.Join(spec.Dir, "rootfs") || h.Data["bundle"] != filepath.Join(spec.Dir, "bundle") || h.Data["dir"] != spec.Dir {
		t.Errorf("handle data %v", h.Data)
	}
	a := dial(t, h.AgentSocket)

	t.Run("agent is pid 1", func(t *testing.T) {
		if got := a.ask(t, "pid"); got != "1" {
			t.Errorf("agent pid %s, want 1", got)
		}
	})
	t.Run("hostname", func(t *testing.T) {
		if got := a.ask(t, "hostname"); got != hostname(spec.ID) {
			t.Errorf("hostname %q, want %q", got, hostname(spec.ID))
		}
	})
	t.Run("loopback only", func(t *testing.T) {
		if got := a.ask(t, "ifaces"); got != "lo" {
			t.Errorf("interfaces %q, want lo only", got)
		}
	})
	t.Run("fds", func(t *testing.T) {
		fds := map[string]string{}
		for _, kv := range strings.Split(a.ask(t, "fds"), ",") {
			k, v, _ := strings.Cut(kv, "=")
			fds[k] = v
		}
		// No host file: stderr is the log pipe the node drains (agentlog.go).
		if fds["0"] != "/dev/null" || fds["1"] != "/dev/null" || !strings.HasPrefix(fds["2"], "pipe:") || !strings.HasPrefix(fds["3"], "socket:") {
			t.Errorf("agent fds %v: want 0 and 1 /dev/null, 2 a pipe, 3 a socket", fds)
		}
		for fd, target := range fds {
			if strings.Contains(target, "hostname") {
				t.Errorf("fd %s %s leaked into the container", fd, target)
			}
		}
	})
	t.Run("env", func(t *testing.T) {
		env := a.ask(t, "exec env")
		for _, want := range []string{"SHOAL_AGENT_FD=3", "SHOAL_SANDBOX_ID=" + spec.ID, "SHOAL_TEST=1", "HOME=/root", "TERM=xterm", "PATH=/usr/local/sbin:"} {
			if !strings.Contains(env, want) {
				t.Errorf("env lacks %s:\n%s", want, env)
			}
		}
	})
	t.Run("nofile", func(t *testing.T) {
		want, _ := nofileLimit(DefaultNofile)
		if got := a.ask(t, "nofile"); got != fmt.Sprintf("%d %d", want, want) {
			t.Errorf("NOFILE %s, want %d", got, want)
		}
	})
	t.Run("limits in host cgroups", func(t *testing.T) {
		for file, want := range map[string]string{
			"memory/memory.limit_in_bytes":       strconv.Itoa(256 << 20),
			"memory/memory.memsw.limit_in_bytes": strconv.Itoa(256 << 20),
			"pids/pids.max":                      "100",
			"cpu/cpu.cfs_quota_us":               "50000",
			"cpu/cpu.cfs_period_us":              "100000",
		} {
			ctrl, name, _ := strings.Cut(file, "/")
			p := filepath.Join("/sys/fs/cgroup", ctrl, testCgroupParent, spec.ID, name)
			data, err := os.ReadFile(p)
			if errors.Is(err, os.ErrNotExist) && name == "memory.memsw.limit_in_bytes" {
				t.Logf("no swap accounting: %v", err)
				continue
			}
			if err != nil {
				t.Error(err)
				continue
			}
			if got := strings.TrimSpace(string(data)); got != want {
				t.Errorf("%s = %s, want %s", p, got, want)
			}
		}
		// The agent is in that cgroup (shown from its cgroup namespace as /).
		procs, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory", testCgroupParent, spec.ID, "cgroup.procs"))
		if err != nil {
			t.Fatal(err)
		}
		initPid, _ := os.ReadFile(filepath.Join(spec.Dir, "init.pid"))
		if !strings.Contains("\n"+string(procs), "\n"+strings.TrimSpace(string(initPid))+"\n") {
			t.Errorf("init pid %s not in the memory cgroup's procs %q", initPid, procs)
		}
		t.Logf("/proc/self/cgroup in the sandbox:\n%s", a.ask(t, "cgroup"))
	})
	t.Run("writes land in the upper", func(t *testing.T) {
		a.ask(t, "write /etc/hello hi")
		a.ask(t, "write /tmp/x y")
		a.ask(t, "write /new-at-root z")
		for _, p := range []string{"etc/hello", "tmp/x", "new-at-root"} {
			if _, err := os.Stat(filepath.Join(spec.Dir, "upper", p)); err != nil {
				t.Errorf("upper: %v", err)
			}
			if _, err := os.Stat(filepath.Join(lowerDir, p)); err == nil {
				t.Errorf("%s written to the lower layer", p)
			}
		}
		if got := a.ask(t, "exec cat /etc/lower-file"); got != "from the lower\n" {
			t.Errorf("lower file reads %q", got)
		}
	})
	t.Run("agent binary is read-only", func(t *testing.T) {
		out := a.ask(t, "exec echo x >> /.shoal/agent 2>&1; echo rc=$?")
		if !strings.Contains(out, "rc=1") {
			t.Errorf("appending to the agent binary: %q", out)
		}
	})
	t.Run("own session", func(t *testing.T) {
		pid := initPid(t, spec)
		pgid, err := unix.Getpgid(pid)
		if err != nil {
			t.Fatal(err)
		}
		sid, err := unix.Getsid(pid)
		if err != nil {
			t.Fatal(err)
		}
		if pgid == unix.Getpgrp() || sid == mustSid(t) {
			t.Errorf("the agent (pgid %d, sid %d) shares our process group or session", pgid, sid)
		}
	})
	t.Run("recover", func(t *testing.T) {
		st, err := b.Recover(context.Background(), h)
		if err != nil || st != sandbox.StatusRunning {
			t.Errorf("Recover = %v, %v; want running", st, err)
		}
	})
}

// leftovers lists what a sandbox left on the host: mounts under its dir,
// cgroup directories, runc state, live processes, its socket.
func leftovers(t *testing.T, b *Backend, spec sandbox.Spec, pids ...int) []string {
	t.Helper()
	var left []string
	mountinfo, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(mountinfo), "\n") {
		if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(unescapeMountinfo(f[4]), spec.Dir) {
			left = append(left, "mount "+f[4])
		}
	}
	dirs, err := b.cgroupDirs(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); err == nil {
			left = append(left, "cgroup "+d)
		}
	}
	if _, err := os.Stat(filepath.Join(b.stateDir, spec.ID)); err == nil {
		left = append(left, "runc state")
	}
	for _, pid := range pids {
		// A zombie is dead: reaping it is its parent's (PID 1's) business.
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err == nil && !strings.Contains(string(stat), ") Z ") {
			left = append(left, fmt.Sprintf("process %d", pid))
		}
	}
	if _, err := os.Lstat(filepath.Join(spec.Dir, "agent.sock")); err == nil {
		left = append(left, "socket")
	}
	return left
}

func mustSid(t *testing.T) int {
	sid, err := unix.Getsid(0)
	if err != nil {
		t.Fatal(err)
	}
	return sid
}

func initPid(t *testing.T, spec sandbox.Spec) int {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(spec.Dir, "init.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

func TestDelete(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		before func(t *testing.T, spec sandbox.Spec, a *agentConn)
	}{
		{"running", func(*testing.T, sandbox.Spec, *agentConn) {}},
		{"with children", func(t *testing.T, _ sandbox.Spec, a *agentConn) {
			a.ask(t, "exec (sleep 1000 >/dev/null 2>&1 & sleep 1000 >/dev/null 2>&1 &) ; echo started")
		}},
		{"frozen", func(t *testing.T, spec sandbox.Spec, a *agentConn) {
			a.ask(t, "exec sleep 1000 >/dev/null 2>&1 & echo started")
			p := filepath.Join("/sys/fs/cgroup/freezer", testCgroupParent, spec.ID, "freezer.state")
			if err := os.WriteFile(p, []byte("FROZEN"), 0); err != nil {
				t.Fatal(err)
			}
		}},
		{"stopped", func(t *testing.T, spec sandbox.Spec, a *agentConn) {
			unix.Kill(initPid(t, spec), unix.SIGKILL)
			time.Sleep(50 * time.Millisecond)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := newSpec(t)
			h := create(t, b, spec)
			a := dial(t, h.AgentSocket)
			a.ask(t, "pid")
			tc.before(t, spec, a)
			pids, _ := readPids(filepath.Join("/sys/fs/cgroup/pids", testCgroupParent, spec.ID, "cgroup.procs"))
			pids = append(pids, initPid(t, spec))
			if err := b.Delete(ctx, h); err != nil {
				t.Fatal(err)
			}
			if left := leftovers(t, b, spec, pids...); len(left) > 0 {
				t.Errorf("left after Delete: %v", left)
			}
			if err := b.Delete(ctx, h); err != nil {
				t.Errorf("second Delete: %v", err)
			}
			if _, err := b.Recover(ctx, h); !errors.Is(err, sandbox.ErrNotFound) {
				t.Errorf("Recover after Delete: %v, want ErrNotFound", err)
			}
		})
	}
}

func TestRecover(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	ctx := context.Background()
	spec := newSpec(t)
	h := create(t, b, spec)
	if st, err := b.Recover(ctx, h); err != nil || st != sandbox.StatusRunning {
		t.Fatalf("Recover = %v, %v; want running", st, err)
	}
	// Frozen (a paused sandbox) is running too.
	if err := b.Freeze(ctx, h); err != nil {
		t.Fatal(err)
	}
	if st, err := b.Recover(ctx, h); err != nil || st != sandbox.StatusRunning {
		t.Fatalf("Recover of a frozen sandbox = %v, %v; want running", st, err)
	}
	if err := b.Thaw(ctx, h); err != nil {
		t.Fatal(err)
	}
	unix.Kill(initPid(t, spec), unix.SIGKILL)
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, err := b.Recover(ctx, h)
		if err != nil {
			t.Fatal(err)
		}
		if st == sandbox.StatusStopped {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Recover still %v after the init was killed", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := b.Recover(ctx, sandbox.Handle{ID: "no-such-sandbox"}); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("Recover of an unknown sandbox: %v, want ErrNotFound", err)
	}
	if err := b.Delete(ctx, sandbox.Handle{ID: "no-such-sandbox"}); err != nil {
		t.Errorf("Delete of an unknown sandbox: %v", err)
	}
}

func TestRecoverUnmountedRoot(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	spec := newSpec(t)
	h := create(t, b, spec)
	if err := unix.Unmount(h.Data["rootfs"], unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if st, err := b.Recover(context.Background(), h); err != nil || st != sandbox.StatusStopped {
		t.Errorf("Recover = %v, %v; want stopped", st, err)
	}
}

func TestFailedCreateLeavesNothing(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	notExecutable := filepath.Join(t.TempDir(), "agent.txt")
	os.WriteFile(notExecutable, []byte("not a program"), 0o644)
	for _, tc := range []struct {
		name    string
		modify  func(*sandbox.Spec)
		wantErr string
	}{
		{"missing lower", func(s *sandbox.Spec) { s.Layers[0].MountPath = "/nonexistent/layer" }, "lowerdir+"},
		// The backend copies the binary before runc starts (agentcopy.go).
		{"missing agent", func(s *sandbox.Spec) { s.AgentBinary = "/nonexistent/agent" }, "open agent binary: "},
		{"agent not executable", func(s *sandbox.Spec) { s.AgentBinary = notExecutable }, "permission denied"},
		{"network", func(s *sandbox.Spec) { s.Network = &netpolicy.Request{Internet: true} }, "egress is disabled"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := newSpec(t)
			tc.modify(&spec)
			_, err := b.Create(createCtx(t), spec)
			if err == nil {
				t.Fatal("Create succeeded")
			}
			if !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("error %q does not mention %q", err, tc.wantErr)
			}
			if tc.name == "missing agent" && !strings.Contains(err.Error(), "/nonexistent/agent") {
				t.Errorf("error %q does not name the binary", err)
			}
			t.Log(err)
			if left := leftovers(t, b, spec); len(left) > 0 {
				t.Errorf("left after a failed Create: %v", left)
			}
		})
	}
}

const helperEnv = "SHOAL_CONTAINER_TEST_HELPER"

// helperMain creates a sandbox described by the environment, prints its
// handle and waits to be killed.
func helperMain() {
	var spec sandbox.Spec
	if err := json.Unmarshal([]byte(os.Getenv(helperEnv)), &spec); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	poolSize := -1
	if os.Getenv("SHOAL_TEST_POOL") == "1" {
		poolSize = 1
	}
	b, err := New(Config{StateDir: os.Getenv("SHOAL_TEST_STATE_DIR"), CgroupParent: testCgroupParent, Launcher: testLauncher, PoolSize: poolSize})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if b.pool != nil {
		// Wait for a pool container, so that the create is a claim.
		b.pool.take(spec.AgentBinary)
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			b.pool.mu.Lock()
			n := len(b.pool.ready)
			b.pool.mu.Unlock()
			if n > 0 {
				break
			}
			if time.Now().After(deadline) {
				fmt.Fprintln(os.Stderr, "no pool container after 30s")
				os.Exit(2)
			}
		}
	}
	h, err := b.Create(context.Background(), spec)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	json.NewEncoder(os.Stdout).Encode(h)
	select {}
}

func TestSurvivesCreatorDeath(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	spec := newSpec(t)
	js, _ := json.Marshal(spec)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+string(js), "SHOAL_TEST_STATE_DIR="+b.stateDir)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var h sandbox.Handle
	err = json.NewDecoder(out).Decode(&h)
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	if err != nil {
		t.Fatalf("read the helper's handle: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Delete(context.Background(), h); err != nil {
			t.Error(err)
		}
	})
	if st, err := b.Recover(context.Background(), h); err != nil || st != sandbox.StatusRunning {
		t.Fatalf("after the creator died, Recover = %v, %v; want running", st, err)
	}
	if got := dial(t, h.AgentSocket).ask(t, "pid"); got != "1" {
		t.Errorf("agent pid %s", got)
	}
}

func TestConcurrentCreates(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	const n = 4
	errs := make(chan error, n)
	for range n {
		spec := newSpec(t)
		go func() {
			h, err := b.Create(createCtx(t), spec)
			if err == nil {
				var c net.Conn
				if c, err = net.Dial("unix", h.AgentSocket); err == nil {
					fmt.Fprintln(c, "pid")
					var line []byte
					line, err = bufio.NewReader(c).ReadBytes('\n')
					if err == nil && !strings.Contains(string(line), `"1"`) {
						err = fmt.Errorf("agent says %s", line)
					}
					c.Close()
				}
				if derr := b.Delete(context.Background(), h); err == nil {
					err = derr
				}
			}
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

func TestNewRejectsMissingRuntime(t *testing.T) {
	if _, err := New(Config{Runtime: "/nonexistent/runc", StateDir: t.TempDir()}); err == nil {
		t.Error("New accepted a missing runtime")
	}
	if _, err := New(Config{StateDir: "relative/dir"}); err == nil {
		t.Error("New accepted a relative state dir")
	}
}

func TestCreateTwice(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	spec := newSpec(t)
	h := create(t, b, spec)
	if _, err := b.Create(createCtx(t), spec); err == nil {
		t.Fatal("a second Create with the same spec succeeded")
	}
	other := newSpec(t)
	other.ID = spec.ID
	if _, err := b.Create(createCtx(t), other); err == nil {
		t.Fatal("a second Create with the same id succeeded")
	}
	// The first sandbox is intact.
	if got := dial(t, h.AgentSocket).ask(t, "pid"); got != "1" {
		t.Errorf("agent pid %s", got)
	}
	if st, err := b.Recover(context.Background(), h); err != nil || st != sandbox.StatusRunning {
		t.Errorf("Recover = %v, %v; want running", st, err)
	}
}

func TestLongSocketPath(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	spec := newSpec(t)
	spec.Dir = filepath.Join(spec.Dir, strings.Repeat("d", 110))
	if err := os.Mkdir(spec.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := b.Create(createCtx(t), spec)
	if err == nil || !strings.Contains(err.Error(), "shorter sandbox dir") {
		t.Fatalf("Create = %v, want a socket path error", err)
	}
	if left := leftovers(t, b, spec); len(left) > 0 {
		t.Errorf("left after a failed Create: %v", left)
	}
}
