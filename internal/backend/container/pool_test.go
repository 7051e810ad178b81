package container

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// newPoolBackend returns a backend with a pool of size, already filling,
// that is closed when the test ends.
func newPoolBackend(t testing.TB, stateDir string, size int) *Backend {
	t.Helper()
	b, err := New(Config{StateDir: stateDir, CgroupParent: testCgroupParent, Launcher: testLauncher, PoolSize: size, Log: testLog(t), UserNS: testUserNS})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.agents.close) // the agent binary's tmpfs (agentcopy.go)
	if b.pool == nil {
		t.Fatal("no pool")
	}
	t.Cleanup(func() {
		if err := b.Close(context.Background()); err != nil {
			t.Error(err)
		}
	})
	b.pool.take(realAgent) // starts the filler
	return b
}

// testLog logs warnings and errors through t.
func testLog(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// waitPool waits until the pool holds n ready containers.
func waitPool(t testing.TB, b *Backend, n int) []*member {
	t.Helper()
	deadline := time.Now().Add(120 * time.Second) // a hang detector, on any host load
	for {
		b.pool.mu.Lock()
		ready := append([]*member(nil), b.pool.ready...)
		b.pool.mu.Unlock()
		if len(ready) >= n {
			return ready
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool has %d ready containers after 120s, want %d", len(ready), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func readTrim(t testing.TB, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(data))
}

func poolSpec(t testing.TB) sandbox.Spec {
	s := newSpec(t)
	s.AgentBinary = realAgent
	return s
}

// run runs a shell command in a sandbox through its agent and returns its
// combined output and exit code.
func run(t testing.TB, h sandbox.Handle, script string) (string, int) {
	t.Helper()
	return runAs(t, h, "", script)
}

// runAs is run as a user of the sandbox ("": the agent's, root).
func runAs(t testing.TB, h sandbox.Handle, user, script string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p, err := agent.NewClient(h.AgentSocket).Exec(ctx, agent.ExecRequest{Args: []string{"/bin/sh", "-c", script}, User: user})
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	var out bytes.Buffer
	for {
		ev, err := p.Recv()
		if err != nil {
			t.Fatalf("exec %q: %v", script, err)
		}
		switch ev.Kind {
		case agent.EventStdout, agent.EventStderr:
			out.Write(ev.Data)
		case agent.EventExit:
			return out.String(), ev.Exit.Code
		}
	}
}

// capBit reports whether capability bit n is set in a hex capability mask
// line of /proc/PID/status ("CapEff:\t00000000a80425fb").
func capBit(t testing.TB, status, field string, n uint) bool {
	t.Helper()
	for _, l := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatalf("%s: %v", l, err)
			}
			return mask&(1<<n) != 0
		}
	}
	t.Fatalf("no %s in status:\n%s", field, status)
	return false
}

func statusField(status, field string) string {
	for _, l := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// checkConfined checks what every command of a sandbox must see, pooled or
// cold: no CAP_SYS_ADMIN anywhere, docker's seccomp filter; and, as in
// docker, no no_new_privs: a setuid binary (sudo) run by a user gains root
// with docker's capabilities, no more.
func checkConfined(t *testing.T, h sandbox.Handle) {
	t.Helper()
	status, code := run(t, h, "cat /proc/self/status")
	if code != 0 {
		t.Fatalf("status: %d %s", code, status)
	}
	if capBit(t, status, "CapEff", unix.CAP_SYS_ADMIN) || capBit(t, status, "CapBnd", unix.CAP_SYS_ADMIN) || capBit(t, status, "CapPrm", unix.CAP_SYS_ADMIN) {
		t.Errorf("a command has CAP_SYS_ADMIN:\n%s", status)
	}
	if !capBit(t, status, "CapBnd", unix.CAP_CHOWN) || !capBit(t, status, "CapEff", unix.CAP_SYS_CHROOT) {
		t.Errorf("a command lacks docker's capabilities:\n%s", status)
	}
	if got := statusField(status, "Seccomp"); got != "2" {
		t.Errorf("Seccomp: %q, want 2 (filter)", got)
	}
	if got := statusField(status, "NoNewPrivs"); got != "0" {
		t.Errorf("NoNewPrivs: %q, want 0 (setuid binaries such as sudo must work)", got)
	}
	// The host name resolves (sudo looks it up): the layer's /etc/hosts
	// and a line for it, bound over the file, not written to the layers.
	hosts, code := run(t, h, `cat /etc/hosts; echo "host: $(hostname)"; grep -c hosts /proc/self/mountinfo`)
	if host := statusField(hosts, "host"); code != 0 || host == "" ||
		!strings.HasPrefix(hosts, "127.0.0.1\tlocalhost # the layer's\n127.0.1.1\t"+host+"\n") || !strings.HasSuffix(hosts, "\n1\n") {
		t.Errorf("/etc/hosts (then the host name, then its mounts): exit %d\n%s", code, hosts)
	}
	ids, code := runAs(t, h, "user", "/bin/escape-suid ids")
	if code != 0 || !strings.Contains(ids, "uid=1000 euid=0\n") {
		where, _ := run(t, h, "ls -ln /bin/escape-suid; grep ' / ' /proc/self/mountinfo; cat /proc/self/uid_map")
		t.Errorf("a setuid-root binary run by a user: exit %d:\n%s\nwant uid=1000 euid=0; the binary and the root:\n%s", code, ids, where)
	} else {
		if capBit(t, ids, "CapEff", unix.CAP_SYS_ADMIN) || capBit(t, ids, "CapBnd", unix.CAP_SYS_ADMIN) || capBit(t, ids, "CapPrm", unix.CAP_SYS_ADMIN) {
			t.Errorf("a setuid-root binary gained CAP_SYS_ADMIN:\n%s", ids)
		}
		if !capBit(t, ids, "CapEff", unix.CAP_CHOWN) {
			t.Errorf("a setuid-root binary lacks docker's capabilities:\n%s", ids)
		}
		if got := statusField(ids, "Seccomp"); got != "2" {
			t.Errorf("a setuid-root binary: Seccomp %q, want 2 (filter)", got)
		}
	}
	// Every thread of the agent too: a command forked from any of them
	// inherits that thread's sets.
	threads, code := run(t, h, "for s in /proc/1/task/*/status; do grep -E '^(CapBnd|CapEff|Seccomp):' $s; done")
	if code != 0 || !strings.Contains(threads, "Seccomp") {
		t.Fatalf("agent threads: %d %s", code, threads)
	}
	for _, l := range strings.Split(strings.TrimSpace(threads), "\n") {
		if strings.HasPrefix(l, "Cap") && capBit(t, l, strings.SplitN(l, ":", 2)[0], unix.CAP_SYS_ADMIN) {
			t.Errorf("an agent thread has CAP_SYS_ADMIN: %s", l)
		}
		if strings.HasPrefix(l, "Seccomp:") && strings.TrimSpace(strings.TrimPrefix(l, "Seccomp:")) != "2" {
			t.Errorf("an agent thread is not filtered: %s", l)
		}
	}
	for _, tc := range []struct{ name, script string }{
		{"user namespace", "unshare -U true"},
		{"mount namespace", "unshare -m true"},
		{"mount", "mount -t tmpfs none /mnt"},
	} {
		if out, code := run(t, h, tc.script+" 2>&1"); code == 0 {
			t.Errorf("%s: %q succeeded: %s", tc.name, tc.script, out)
		}
	}
}

func TestPoolClaim(t *testing.T) {
	requireRoot(t)
	b := newPoolBackend(t, t.TempDir(), 2)
	for _, m := range waitPool(t, b, 2) {
		// Waiting at the lowest CPU weight, its threads at nice 0 (runc
		// ran at nice 19), its spawner in its commands' CPU group (see
		// commandsGroup).
		if got := readTrim(t, filepath.Join("/sys/fs/cgroup/cpu", testCgroupParent, m.id, "cpu.shares")); got != "2" {
			t.Errorf("pool container cpu.shares %s, want 2", got)
		}
		pid := readTrim(t, filepath.Join(m.dir, pidFileName))
		tasks, _ := filepath.Glob("/proc/" + pid + "/task/*/stat")
		for _, task := range tasks {
			f := strings.Fields(readTrim(t, task)[strings.LastIndexByte(readTrim(t, task), ')')+2:])
			if f[16] != "0" { // field 19, nice
				t.Errorf("pool agent thread %s has nice %s", task, f[16])
			}
		}
		p, _ := strconv.Atoi(pid)
		if tid, err := spawnerThread(p); err != nil {
			t.Error(err)
		} else if tasks := readTrim(t, filepath.Join("/sys/fs/cgroup/cpu", testCgroupParent, m.id, commandsGroupName, "tasks")); tasks != strconv.Itoa(tid) {
			t.Errorf("the commands' cpu group of %s holds %q, want the spawner %d", m.id, tasks, tid)
		}
	}
	spec := poolSpec(t)
	spec.Resources = sandbox.Resources{MemoryBytes: 256 << 20, MilliCPU: 500, Pids: 100}
	spec.Env = []string{"SHOAL_TEST=1"}
	h := create(t, b, spec)
	if h.Data["pooled"] != "true" || !strings.HasPrefix(h.Data["runc_id"], poolPrefix) {
		t.Fatalf("not created from the pool: %+v", h)
	}
	if h.AgentSocket != filepath.Join(b.claimedDir(spec.ID), socketName) {
		t.Errorf("agent socket %s", h.AgentSocket)
	}
	// The claim's answer says what a ping would: the node's client of the
	// agent need not ask (agent.Client.Learn).
	if h.Agent == nil || h.Agent.Protocol != agent.ProtocolVersion || !h.Agent.Users || h.Agent.Pid != 1 {
		t.Errorf("handle's agent info %+v, want protocol %d, users, pid 1", h.Agent, agent.ProtocolVersion)
	}

	t.Run("root from the layers", func(t *testing.T) {
		if out, code := run(t, h, "cat /etc/lower-file"); code != 0 || out != "from the lower\n" {
			t.Errorf("lower file: %d %q", code, out)
		}
		if out, code := run(t, h, "echo hi > /written && mkdir -p /etc/new && echo x > /etc/new/f && cat /written"); code != 0 || out != "hi\n" {
			t.Fatalf("write: %d %q", code, out)
		}
		for _, p := range []string{"written", "etc/new/f"} {
			if _, err := os.Stat(filepath.Join(spec.Dir, "upper", p)); err != nil {
				t.Errorf("not in the upper: %v", err)
			}
			if _, err := os.Stat(filepath.Join(lowerDir, p)); err == nil {
				t.Errorf("%s written to the lower layer", p)
			}
		}
		// Nothing of the pool container's blank root is left in view.
		if out, _ := run(t, h, "ls -a /.shoal"); strings.Contains(out, "newroot") {
			t.Errorf("/.shoal lists %q", out)
		}
		mounts, _ := run(t, h, "cat /proc/self/mountinfo")
		root := ""
		for _, l := range strings.Split(mounts, "\n") {
			if f := strings.Fields(l); len(f) > 4 && f[4] == "/" {
				root = l
			}
		}
		// Its directories are given to overlayfs by descriptor: the
		// sandbox's mountinfo names no host path.
		if !strings.Contains(root, " - overlay ") || !strings.Contains(root, "upperdir=/proc/self/fd/") || strings.Contains(mounts, spec.Dir) {
			t.Errorf("root mount %q\n%s", root, mounts)
		}
		for _, want := range []string{" /proc ", " /proc/keys ", " /proc/sys ", " /dev ", " /dev/pts ", " /dev/shm ", " /sys ", " /sys/fs/cgroup ", " /.shoal/agent "} {
			if !strings.Contains(mounts, want) {
				t.Errorf("no %s mount:\n%s", want, mounts)
			}
		}
		// The root is not mounted on the host.
		if m, _ := isOverlayMount(filepath.Join(spec.Dir, rootfsDir)); m {
			t.Error("overlay mounted on the host")
		}
	})
	t.Run("masked and read-only paths", func(t *testing.T) {
		if out, code := run(t, h, "echo 1 > /proc/sys/kernel/ns_last_pid 2>&1"); code == 0 {
			t.Errorf("/proc/sys writable: %s", out)
		}
		if out, code := run(t, h, "stat -c %F /proc/keys"); code != 0 || !strings.Contains(out, "character special") {
			t.Errorf("/proc/keys not masked: %d %s", code, out)
		}
		if out, code := run(t, h, "echo x >> /.shoal/agent 2>&1"); code == 0 {
			t.Errorf("agent binary writable: %s", out)
		}
	})
	t.Run("hostname and env", func(t *testing.T) {
		if out, _ := run(t, h, "hostname"); strings.TrimSpace(out) != hostname(spec.ID) {
			t.Errorf("hostname %q, want %q", out, hostname(spec.ID))
		}
		env, _ := run(t, h, "env")
		for _, want := range []string{"SHOAL_SANDBOX_ID=" + spec.ID, "SHOAL_TEST=1", "HOME=/root", "PATH=/usr/local/sbin:"} {
			if !strings.Contains(env, want) {
				t.Errorf("env lacks %s:\n%s", want, env)
			}
		}
		if strings.Contains(env, "SHOAL_POOL") || strings.Contains(env, "SHOAL_SECCOMP_FD") || strings.Contains(env, "SHOAL_READY_FD") {
			t.Errorf("agent's start-up variables leak into commands:\n%s", env)
		}
	})
	t.Run("loopback only and pid 1", func(t *testing.T) {
		if out, _ := run(t, h, "cat /proc/net/dev | grep : | cut -d: -f1 | tr -d ' '"); strings.TrimSpace(out) != "lo" && !strings.Contains(out, "not found") {
			t.Errorf("interfaces %q", out)
		}
		info, err := agent.NewClient(h.AgentSocket).Ping(context.Background())
		if err != nil || info.Pid != 1 {
			t.Errorf("agent ping: %+v %v", info, err)
		}
	})
	t.Run("confined", func(t *testing.T) { checkConfined(t, h) })
	t.Run("limits written", func(t *testing.T) {
		id := h.Data["runc_id"]
		for file, want := range map[string]string{
			"memory/memory.limit_in_bytes":       strconv.Itoa(256 << 20),
			"memory/memory.memsw.limit_in_bytes": strconv.Itoa(256 << 20),
			"pids/pids.max":                      "100",
			"cpu/cpu.cfs_quota_us":               "50000",
			"cpu/cpu.cfs_period_us":              "100000",
			"cpu/cpu.shares":                     "1024",
		} {
			ctrl, name, _ := strings.Cut(file, "/")
			data, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", ctrl, testCgroupParent, id, name))
			if errors.Is(err, os.ErrNotExist) && strings.Contains(name, "memsw") {
				continue
			}
			if err != nil {
				t.Error(err)
				continue
			}
			if got := strings.TrimSpace(string(data)); got != want {
				t.Errorf("%s = %s, want %s", file, got, want)
			}
		}
		// The pids limit is in force inside.
		if out, _ := run(t, h, "cat /sys/fs/cgroup/pids/pids.max"); strings.TrimSpace(out) != "100" {
			t.Errorf("pids.max seen inside: %q", out)
		}
	})
	t.Run("recover", func(t *testing.T) {
		if st, err := b.Recover(context.Background(), h); err != nil || st != sandbox.StatusRunning {
			t.Errorf("Recover = %v, %v", st, err)
		}
		// A provisional handle (ID and dir) finds the container too.
		if st, err := b.Recover(context.Background(), sandbox.Handle{ID: spec.ID, Data: map[string]string{"dir": spec.Dir}}); err != nil || st != sandbox.StatusRunning {
			t.Errorf("Recover with a provisional handle = %v, %v", st, err)
		}
	})
	t.Run("same id refused", func(t *testing.T) {
		other := poolSpec(t)
		other.ID = spec.ID
		if _, err := b.Create(createCtx(t), other); err == nil {
			t.Error("a second sandbox with the same id was created")
		}
	})
}

func TestColdSandboxIsConfined(t *testing.T) {
	requireRoot(t)
	b := newBackend(t)
	spec := poolSpec(t)
	h := create(t, b, spec)
	if h.Data["pooled"] != "" {
		t.Fatal("pooled")
	}
	checkConfined(t, h)
}

func TestPoolRefillAndDelete(t *testing.T) {
	requireRoot(t)
	b := newPoolBackend(t, t.TempDir(), 2)
	ready := waitPool(t, b, 2)
	ctx := context.Background()
	var handles []sandbox.Handle
	for range 3 {
		spec := poolSpec(t)
		h, err := b.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		handles = append(handles, h)
		if out, code := run(t, h, "echo ok"); code != 0 || out != "ok\n" {
			t.Fatalf("exec: %d %q", code, out)
		}
	}
	pooled := 0
	for _, h := range handles {
		if h.Data["pooled"] == "true" {
			pooled++
		}
	}
	if pooled < 2 {
		t.Errorf("%d of 3 creates came from a pool of 2", pooled)
	}
	// Refilled in the background, with new containers.
	again := waitPool(t, b, 2)
	for _, m := range again {
		for _, old := range ready {
			if m.id == old.id {
				t.Errorf("container %s handed out twice", m.id)
			}
		}
	}
	// Delete leaves nothing: cgroups, runc state, dirs, processes.
	for _, h := range handles {
		id := h.Data["runc_id"]
		pids, _ := readPids(filepath.Join("/sys/fs/cgroup/pids", testCgroupParent, id, "cgroup.procs"))
		if err := b.Delete(ctx, h); err != nil {
			t.Fatal(err)
		}
		if left := runcLeftovers(t, b, id, pids); len(left) > 0 {
			t.Errorf("left after Delete of %s: %v", h.ID, left)
		}
		if exists(b.claimedDir(h.ID)) {
			t.Errorf("claimed dir of %s left", h.ID)
		}
		if err := b.Delete(ctx, h); err != nil {
			t.Errorf("second Delete: %v", err)
		}
	}
}

// runcLeftovers lists what is left of a runc container: cgroups, state,
// live processes.
func runcLeftovers(t *testing.T, b *Backend, runcID string, pids []int) []string {
	t.Helper()
	var left []string
	dirs, err := b.cgroupDirs(runcID)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); err == nil {
			left = append(left, "cgroup "+d)
		}
	}
	if b.hasState(runcID) {
		left = append(left, "runc state")
	}
	for _, pid := range pids {
		stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err == nil && !strings.Contains(string(stat), ") Z ") {
			left = append(left, "process "+strconv.Itoa(pid))
		}
	}
	return left
}

func TestPoolCloseDrains(t *testing.T) {
	requireRoot(t)
	b, err := New(Config{StateDir: t.TempDir(), CgroupParent: testCgroupParent, Launcher: testLauncher, PoolSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.agents.close) // the agent binary's tmpfs (agentcopy.go)
	b.pool.take(realAgent)
	ready := waitPool(t, b, 2)
	if err := b.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, m := range ready {
		if left := runcLeftovers(t, b, m.id, nil); len(left) > 0 {
			t.Errorf("left after Close: %v", left)
		}
	}
	if ents, _ := os.ReadDir(filepath.Join(b.poolDir, poolReady)); len(ents) > 0 {
		t.Errorf("ready dir not empty after Close: %v", ents)
	}
	// A closed backend's Create no longer uses the pool.
	if m := b.pool.take(realAgent); m != nil {
		t.Error("take after Close returned a container")
	}
}

// TestPoolFailedClaim: a pool container whose agent died cannot be claimed;
// the create falls back on the cold path and nothing of the failed claim
// is left.
func TestPoolFailedClaim(t *testing.T) {
	requireRoot(t)
	b := newPoolBackend(t, t.TempDir(), 1)
	m := waitPool(t, b, 1)[0]
	pidData, err := os.ReadFile(filepath.Join(m.dir, pidFileName))
	if err != nil {
		t.Fatal(err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(pidData)))
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	spec := poolSpec(t)
	h := create(t, b, spec)
	// The fallback: runc around the root, or with the native launcher a
	// pool container started for it.
	if h.Data["runc_id"] == m.id || (h.Data["pooled"] != "" && !b.native) {
		t.Fatalf("created from a dead pool container: %+v", h)
	}
	if out, code := run(t, h, "cat /etc/lower-file"); code != 0 || out != "from the lower\n" {
		t.Errorf("cold fallback sandbox: %d %q", code, out)
	}
	if left := runcLeftovers(t, b, m.id, []int{pid}); len(left) > 0 {
		t.Errorf("left of the failed claim: %v", left)
	}
	if exists(m.dir) {
		t.Error("the failed pool container's dir is left")
	}
}

// TestPoolGrowsWithDemandAndShrinksWhenIdle: creates that find the pool
// empty grow its target (up to max) and the filler catches up; once idle,
// the surplus is deleted down to the minimum.
func TestPoolGrowsWithDemandAndShrinksWhenIdle(t *testing.T) {
	requireRoot(t)
	defer func(i, e, u time.Duration) { shrinkIdle, shrinkEvery, urgentFor = i, e, u }(shrinkIdle, shrinkEvery, urgentFor)
	// Urgent (normal priority) for the whole test: a pool refilling at
	// nice 19 makes no progress under a CPU hog, by design.
	// No shrink until the growth is checked (below).
	shrinkIdle, shrinkEvery, urgentFor = time.Hour, 200*time.Millisecond, time.Hour
	b, err := New(Config{StateDir: t.TempDir(), CgroupParent: testCgroupParent, Launcher: testLauncher, PoolSize: 1, PoolMax: 4, Log: testLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.agents.close) // the agent binary's tmpfs (agentcopy.go)
	t.Cleanup(func() { b.Close(context.Background()) })
	b.pool.take(realAgent) // starts the filler
	waitPool(t, b, 1)
	// Three creates at once: one claim, then misses.
	var handles []sandbox.Handle
	for range 3 {
		handles = append(handles, create(t, b, poolSpec(t)))
	}
	st, _ := b.PoolStats()
	if st.Misses == 0 || st.Target <= 1 || st.Target > 4 {
		t.Fatalf("after a burst: %+v, want misses and a target in (1, 4]", st)
	}
	waitPool(t, b, st.Target) // the filler reaches the new target
	for _, h := range handles {
		if err := b.Delete(context.Background(), h); err != nil {
			t.Error(err)
		}
	}
	// Now idle after 2 s.
	b.pool.mu.Lock()
	b.pool.shrinkIdle = 2 * time.Second
	b.pool.mu.Unlock()
	// Idle: back to the minimum, the surplus deleted (the counters change
	// before the deletes finish: wait for the dirs too).
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, _ = b.PoolStats()
		ents, _ := os.ReadDir(filepath.Join(b.poolDir, poolReady))
		if st.Target == 1 && st.Ready == 1 && st.Starting == 0 && len(ents) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool did not shrink back to 1 within 30s: %+v, %d ready dirs", st, len(ents))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if st.Shrunk == 0 {
		t.Errorf("nothing deleted by the shrink: %+v", st)
	}
}

// TestPoolYieldsToClaims: while creates keep taking from a pool that is
// still more than a quarter full, the filler starts nothing (a refill costs
// the CPU the claims need); once they pause, it fills the pool again.
func TestPoolYieldsToClaims(t *testing.T) {
	requireRoot(t)
	defer func(y time.Duration) { yieldFor = y }(yieldFor)
	yieldFor = time.Minute // longer than any removeMember on a loaded host
	b := newPoolBackend(t, t.TempDir(), 4)
	waitPool(t, b, 4)
	st0, _ := b.PoolStats()
	// Takes 300 ms apart, each within yieldFor of the last: no refill.
	for range 2 {
		m := b.pool.take(realAgent)
		if m == nil {
			t.Fatal("the pool gave nothing with 4 ready")
		}
		if err := b.removeMember(m); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
	}
	st, _ := b.PoolStats()
	if st.Started != st0.Started || st.Starting != 0 || st.Ready != 2 {
		t.Fatalf("the filler refilled during the takes: before %+v, after %+v", st0, st)
	}
	if st.Yields == 0 {
		t.Errorf("no yield counted: %+v", st)
	}
	// The takes have paused (for longer than a shorter yieldFor): the
	// pool fills up again.
	setYield := func(d time.Duration) {
		b.pool.mu.Lock()
		b.pool.yieldFor = d
		b.pool.mu.Unlock()
		b.pool.poke()
	}
	setYield(100 * time.Millisecond)
	waitPool(t, b, 4)
	setYield(time.Minute)
	// A pool down to a quarter refills at once whatever the takes do.
	for range 3 {
		if err := b.removeMember(b.pool.take(realAgent)); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if st, _ := b.PoolStats(); st.Starting > 0 || st.Ready > 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a pool down to a quarter waited for the takes to pause: %+v", st)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestPoolHoldsSome: the filler waits for a burst of claims to pause while
// the pool holds more than a quarter of its target or 2, whichever is
// fewer: a pool of 55 covers a burst of 50 without refilling under it.
func TestPoolHoldsSome(t *testing.T) {
	for _, c := range []struct {
		ready, target int
		want          bool
	}{
		{55, 55, true}, {14, 55, true}, {3, 55, true}, {2, 55, false}, {0, 55, false},
		{2, 4, true}, {1, 4, false}, {1, 1, true}, {0, 1, false},
	} {
		if got := holdsSome(c.ready, c.target); got != c.want {
			t.Errorf("holdsSome(%d ready of %d) = %v, want %v", c.ready, c.target, got, c.want)
		}
	}
}

// TestPoolClaimNotAnswered: a pool member whose agent never answers the
// claim (stopped, as a hung or starved agent would be) costs the create at
// most claimTimeout: the member is destroyed with all it had (bundle, dir,
// cgroups, runc state) and the sandbox is created elsewhere.
func TestPoolClaimNotAnswered(t *testing.T) {
	requireRoot(t)
	b := newPoolBackend(t, t.TempDir(), 1)
	m := waitPool(t, b, 1)[0]
	pid, err := strconv.Atoi(readTrim(t, filepath.Join(m.dir, pidFileName)))
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Kill(pid, unix.SIGKILL) })
	spec := poolSpec(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, err := b.Create(ctx, spec)
	if err != nil {
		t.Fatalf("create with a stopped pool member: %v", err)
	}
	t.Cleanup(func() { b.Delete(context.Background(), h) })
	if h.Data["runc_id"] == m.id {
		t.Fatalf("created from the stopped member: %+v", h)
	}
	if out, code := run(t, h, "cat /etc/lower-file"); code != 0 || out != "from the lower\n" {
		t.Errorf("sandbox after the failed claim: %d %q", code, out)
	}
	if left := runcLeftovers(t, b, m.id, []int{pid}); len(left) > 0 {
		t.Errorf("left of the unanswered claim: %v", left)
	}
	for _, p := range []string{m.dir, b.memberBundle(m.id), b.claimedDir(spec.ID) + "/" + runcIDFile} {
		if h.Data["pooled"] != "" && p == b.claimedDir(spec.ID)+"/"+runcIDFile {
			continue // the sandbox came from another member
		}
		if exists(p) {
			t.Errorf("%s is left after the unanswered claim", p)
		}
	}
}

// TestPoolAcrossRestart: a pooled sandbox survives the death of the process
// that created it; the next backend on the same dirs deletes the pool
// containers that process left unclaimed, keeps the sandbox, and deletes it
// even from a provisional handle.
func TestPoolAcrossRestart(t *testing.T) {
	requireRoot(t)
	stateDir := t.TempDir()
	spec := poolSpec(t)
	js, _ := json.Marshal(spec)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+string(js), "SHOAL_TEST_STATE_DIR="+stateDir, "SHOAL_TEST_POOL=1")
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
	// Let the helper start refilling its pool before it dies.
	time.Sleep(200 * time.Millisecond)
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	if err != nil {
		t.Fatalf("read the helper's handle: %v", err)
	}
	if h.Data["pooled"] != "true" {
		t.Fatalf("helper's sandbox is not pooled: %+v", h)
	}
	leftover, _ := filepath.Glob(filepath.Join(filepath.Dir(stateDir), "pool", poolReady, "*"))
	// The unclaimed pool containers die with the process that made them
	// (their lifeline); the claimed one lives on (checked below).
	deadline := time.Now().Add(10 * time.Second)
	for _, d := range leftover {
		procs := filepath.Join("/sys/fs/cgroup/pids", testCgroupParent, filepath.Base(d), "cgroup.procs")
		for {
			pids, err := readPids(procs)
			if errors.Is(err, os.ErrNotExist) || (err == nil && len(pids) == 0) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("unclaimed pool container %s still runs %v after its node died", filepath.Base(d), pids)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	t.Logf("%d unclaimed pool containers stopped with their node", len(leftover))

	b, err := New(Config{StateDir: stateDir, CgroupParent: testCgroupParent, Launcher: testLauncher, PoolSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.agents.close) // the agent binary's tmpfs (agentcopy.go)
	for _, d := range leftover {
		if left := runcLeftovers(t, b, filepath.Base(d), nil); len(left) > 0 || exists(d) {
			t.Errorf("unclaimed pool container %s left after New: %v", filepath.Base(d), left)
		}
	}
	if st, err := b.Recover(context.Background(), h); err != nil || st != sandbox.StatusRunning {
		t.Fatalf("after the creator died, Recover = %v, %v", st, err)
	}
	if out, code := run(t, h, "cat /etc/lower-file"); code != 0 || out != "from the lower\n" {
		t.Errorf("sandbox after the creator died: %d %q", code, out)
	}
	id := h.Data["runc_id"]
	if err := b.Delete(context.Background(), sandbox.Handle{ID: spec.ID, Data: map[string]string{"dir": spec.Dir}}); err != nil {
		t.Fatal(err)
	}
	if left := runcLeftovers(t, b, id, nil); len(left) > 0 || exists(b.claimedDir(spec.ID)) {
		t.Errorf("left after Delete with a provisional handle: %v", left)
	}
}

// BenchmarkPoolClaim measures Create from a ready pool (the claim) and the
// first exec after it.
//
//	go test -run '^$' -bench PoolClaim -benchtime 20x ./internal/backend/container/
func BenchmarkPoolClaim(b *testing.B) {
	requireRoot(b)
	be := newPoolBackend(b, b.TempDir(), 4)
	ctx := context.Background()
	var claims, firsts []time.Duration
	for b.Loop() {
		b.StopTimer()
		waitPool(b, be, 4)
		spec := poolSpec(b)
		b.StartTimer()
		start := time.Now()
		h, err := be.Create(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		claims = append(claims, time.Since(start))
		p, err := agent.NewClient(h.AgentSocket).Exec(ctx, agent.ExecRequest{Args: []string{"/bin/true"}})
		if err != nil {
			b.Fatal(err)
		}
		for {
			ev, err := p.Recv()
			if err != nil {
				b.Fatal(err)
			}
			if ev.Kind == agent.EventExit {
				break
			}
		}
		firsts = append(firsts, time.Since(start))
		b.StopTimer()
		if h.Data["pooled"] != "true" {
			b.Fatal("not pooled")
		}
		if err := be.Delete(ctx, h); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	report(b, "claim", claims)
	report(b, "claim+first-exec", firsts)
}
