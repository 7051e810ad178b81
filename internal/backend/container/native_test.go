package container

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/forkserver"
)

// TestNativeLikeRunc starts a pool container with runc and one with the
// native launcher from the same backend and compares what the kernel says
// of their agents (before any claim): capabilities, no_new_privs, seccomp,
// id maps, namespaces, cgroups and their limits, the devices list, NOFILE,
// and every mount (point, type, options); with user namespaces (when the
// kernel has them) and without (where runc makes /dev's nodes with mknod).
func TestNativeLikeRunc(t *testing.T) {
	requireRoot(t)
	for _, userns := range []string{UserNSAuto, UserNSOff} {
		t.Run("userns="+userns, func(t *testing.T) { testNativeLikeRunc(t, userns) })
	}
}

func testNativeLikeRunc(t *testing.T, userns string) {
	b := poolTestBackend(t, userns)
	rm, rpid := startTestMember(t, b, false)
	nm, npid := startTestMember(t, b, true)
	if !b.isNative(nm.id) || b.isNative(rm.id) {
		t.Fatalf("native state: runc %v, native %v", b.isNative(rm.id), b.isNative(nm.id))
	}
	if alive, err := b.nativeAlive(nm.id); err != nil || !alive {
		t.Errorf("nativeAlive = %v, %v", alive, err)
	}
	norm := func(m *member, s string) string {
		s = strings.ReplaceAll(s, m.id, "ID")
		s = strings.ReplaceAll(s, m.dir, "DIR")
		return s
	}
	status := func(m *member, pid string) map[string]string {
		out := map[string]string{}
		data, err := os.ReadFile("/proc/" + pid + "/status")
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(data), "\n") {
			k, v, _ := strings.Cut(l, ":")
			switch k {
			case "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "Uid", "Gid", "Groups", "NSpid":
				out[k] = strings.Join(strings.Fields(v), " ")
			}
			if k == "NSpid" { // the host's pid differs
				f := strings.Fields(v)
				out[k] = f[len(f)-1]
			}
		}
		if m.idmap != nil {
			for _, f := range []string{"uid_map", "gid_map", "setgroups"} {
				out[f] = strings.Join(strings.Fields(readTrim(t, "/proc/"+pid+"/"+f)), " ")
			}
			out["uid_map"] = strings.Replace(out["uid_map"], strings.Fields(out["uid_map"])[1], "HOST", 1)
			out["gid_map"] = strings.Replace(out["gid_map"], strings.Fields(out["gid_map"])[1], "HOST", 1)
			out["Uid"], out["Gid"] = "", ""
		}
		out["cgroup"] = norm(m, readTrim(t, "/proc/"+pid+"/cgroup"))
		for _, l := range strings.Split(readTrim(t, "/proc/"+pid+"/limits"), "\n") {
			if strings.HasPrefix(l, "Max open files") {
				out["nofile"] = strings.Join(strings.Fields(l), " ")
			}
		}
		for _, ns := range []string{"user", "pid", "mnt", "ipc", "uts", "net", "cgroup"} {
			mine, _ := os.Readlink("/proc/self/ns/" + ns)
			theirs, err := os.Readlink("/proc/" + pid + "/ns/" + ns)
			if err != nil {
				t.Fatal(err)
			}
			out["ns "+ns] = map[bool]string{true: "host's", false: "own"}[mine == theirs]
		}
		for _, f := range []string{"devices/devices.list", "memory/memory.limit_in_bytes", "memory/memory.memsw.limit_in_bytes", "pids/pids.max", "cpu/cpu.shares", "cpu/cpu.cfs_quota_us", "cpuset/cpuset.cpus", "cpuset/cpuset.mems"} {
			ctrl, name, _ := strings.Cut(f, "/")
			if data, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", ctrl, testCgroupParent, m.id, name)); err == nil {
				lines := strings.Split(strings.TrimSpace(string(data)), "\n")
				slices.Sort(lines) // devices.list keeps the order of writes
				out[f] = strings.Join(lines, "\n")
			}
		}
		// Mounts: point, options, type; sorted (the order differs).
		var mounts []string
		for _, l := range strings.Split(readTrim(t, "/proc/"+pid+"/mountinfo"), "\n") {
			pre, post, _ := strings.Cut(l, " - ")
			f, g := strings.Fields(pre), strings.Fields(post)
			if len(f) < 6 || len(g) < 1 {
				continue
			}
			mounts = append(mounts, f[4]+" "+f[5]+" "+g[0])
		}
		slices.Sort(mounts)
		// The native container's agent binary is bound twice, one on the
		// other: the host's bind, locked in the container's namespace,
		// and the agent's bind of it, which a claim moves (the other
		// goes with the blank root).
		mounts = slices.Compact(mounts)
		out["mounts"] = strings.Join(mounts, "\n")
		return out
	}
	want, got := status(rm, rpid), status(nm, npid)
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s:\nrunc:   %s\nnative: %s", k, w, got[k])
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: native only: %s", k, got[k])
		}
	}
	t.Logf("compared %d properties", len(want))
}

// poolTestBackend is a backend without a pool of its own (PoolSize -1)
// whose tests start pool containers themselves (startTestMember), with
// either launcher; it skips the test where there can be no pool.
func poolTestBackend(t *testing.T, userns string) *Backend {
	t.Helper()
	b, err := New(Config{StateDir: t.TempDir(), CgroupParent: testCgroupParent, PoolSize: -1, UserNS: userns, Log: testLog(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.agents.close) // the agent binary's tmpfs (agentcopy.go)
	if b.filter == nil {
		t.Skip("no compiled seccomp filter: no pool, no native launcher")
	}
	return b
}

// startTestMember starts a pool container with the native launcher or
// runc, removed at the test's end (and checked for leftovers); it returns
// it and its agent's pid.
func startTestMember(t *testing.T, b *Backend, native bool) (*member, string) {
	t.Helper()
	b.native = native
	defer func() { b.native = false }()
	m, err := b.startMember(context.Background(), realAgent, true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.removeMember(m); err != nil {
			t.Error(err)
		}
		if left := runcLeftovers(t, b, m.id, nil); len(left) > 0 {
			t.Errorf("left after removing %s: %v", m.id, left)
		}
		if b.isNative(m.id) {
			t.Errorf("native state of %s left", m.id)
		}
	})
	return m, readTrim(t, filepath.Join(m.dir, pidFileName))
}

// BenchmarkStartMember starts pool containers with each launcher and
// reports, per container, the wall time until its agent is ready and the
// CPU it cost: this process's (the node's side), its reaped children's
// (runc, and what runc reaped), and the container's init task's whole life
// (/proc/PID/schedstat: runc init then the agent, or the native start then
// the agent). Removal is not counted.
//
//	go test -run '^$' -bench StartMember -benchtime 20x ./internal/backend/container/
func BenchmarkStartMember(b *testing.B) {
	requireRoot(b)
	be, err := New(Config{StateDir: b.TempDir(), CgroupParent: testCgroupParent, PoolSize: -1, UserNS: testUserNS})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(be.agents.close) // the agent binary's tmpfs (agentcopy.go)
	if be.filter == nil {
		b.Skip("no compiled seccomp filter")
	}
	cpuNow := func() time.Duration {
		var self, kids unix.Rusage
		unix.Getrusage(unix.RUSAGE_SELF, &self)
		unix.Getrusage(unix.RUSAGE_CHILDREN, &kids)
		tv := func(t unix.Timeval) time.Duration { return time.Duration(t.Nano()) }
		return tv(self.Utime) + tv(self.Stime) + tv(kids.Utime) + tv(kids.Stime)
	}
	for _, launcher := range []string{LauncherRunc, LauncherNative} {
		b.Run(launcher, func(b *testing.B) {
			be.native = launcher == LauncherNative
			var walls, cpus, nodes []time.Duration
			for b.Loop() {
				start, cpu0 := time.Now(), cpuNow()
				m, err := be.startMember(context.Background(), realAgent, true)
				if err != nil {
					b.Fatal(err)
				}
				wall, cpu := time.Since(start), cpuNow()-cpu0
				b.StopTimer()
				nodes = append(nodes, cpu)
				pid := readTrim(b, filepath.Join(m.dir, pidFileName))
				if f := strings.Fields(readTrim(b, "/proc/"+pid+"/schedstat")); len(f) > 0 {
					ns, _ := strconv.ParseInt(f[0], 10, 64)
					cpu += time.Duration(ns)
				}
				walls, cpus = append(walls, wall), append(cpus, cpu)
				if err := be.removeMember(m); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			report(b, "start", walls)
			report(b, "cpu", cpus)
			report(b, "cpu-node", nodes)
		})
	}
}

// TestForkServerWithoutNodeMounts: the native launcher's agents are cloned
// from a fork server whose mount namespace holds none of the mounts below
// the pool's and runc's directories (each sandbox's disk is one there),
// which every agent's mount namespace would copy; a member started after
// the node mounted more there still starts (its agent binary is bound
// where it is cloned).
func TestForkServerWithoutNodeMounts(t *testing.T) {
	requireRoot(t)
	b := poolTestBackend(t, testUserNS)
	startTestMember(t, b, true)
	for _, d := range []string{b.poolDir, b.stateDir} {
		p := filepath.Join(d, "test-mount")
		if err := os.MkdirAll(p, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("tmpfs", p, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(p, unix.MNT_DETACH) })
	}
	startTestMember(t, b, true)
	// The fork server: the child of this process started --forkserver.
	var server string
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		st, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		f := strings.Fields(string(st[strings.LastIndexByte(string(st), ')')+2:]))
		cmdline, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if f[1] == strconv.Itoa(os.Getpid()) && strings.Contains(string(cmdline), "--forkserver") {
			server = e.Name()
		}
	}
	if server == "" {
		t.Fatal("no fork server among this process's children")
	}
	mi := readTrim(t, "/proc/"+server+"/mountinfo")
	for _, d := range []string{b.poolDir, b.stateDir} {
		if strings.Contains(mi, " "+d+"/") {
			t.Errorf("the fork server's mount namespace has mounts below %s:\n%s", d, mi)
		}
		if !strings.Contains(readTrim(t, "/proc/self/mountinfo"), " "+filepath.Join(d, "test-mount")+" ") {
			t.Errorf("the node lost its mount below %s", d)
		}
	}
}

// Without a fork server (its binary does not serve), the node starts a
// native agent itself, binding the agent binary on the host for the clone
// only: the member starts, and no bind is left in the node's namespace.
func TestNativeWithoutForkServer(t *testing.T) {
	requireRoot(t)
	b := poolTestBackend(t, testUserNS)
	fs := forkserver.NewPrivateClient("/bin/true")
	t.Cleanup(fs.Close)
	b.forks = map[string]*forkserver.Client{realAgent: fs}
	m, _ := startTestMember(t, b, true)
	if !b.isNative(m.id) {
		t.Fatal("not started natively")
	}
	if alive, err := b.nativeAlive(m.id); err != nil || !alive {
		t.Errorf("nativeAlive = %v, %v", alive, err)
	}
	bind := filepath.Join(m.dir, blankRoot, ".shoal", "agent")
	if strings.Contains(readTrim(t, "/proc/self/mountinfo"), " "+bind+" ") {
		t.Errorf("the host's bind of the agent at %s was left", bind)
	}
}

// TestAgentBindNamesNoHostPath: in a pool container of either launcher, the
// agent's mount table (what /proc/1/mountinfo shows inside: paths are
// relative to the reading process's root) does not name the agent binary's
// host path: the bind at /.shoal/agent comes from the backend's private
// tmpfs (agentcopy.go). (A pool container's root is its blank root until
// its claim moves the sandbox's overlay there: test/e2e checks a claimed
// sandbox for the data directory.)
func TestAgentBindNamesNoHostPath(t *testing.T) {
	requireRoot(t)
	b := poolTestBackend(t, UserNSOff)
	for _, native := range []bool{false, true} {
		_, pid := startTestMember(t, b, native)
		mi := readTrim(t, "/proc/"+pid+"/mountinfo")
		for _, host := range []string{realAgent, filepath.Dir(realAgent)} {
			if strings.Contains(mi, host) {
				t.Errorf("native %v: the sandbox's mountinfo names the host path %s:\n%s", native, host, mi)
			}
		}
		found := false
		for _, l := range strings.Split(mi, "\n") {
			f := strings.Fields(l)
			if len(f) > 4 && f[4] == agentPath {
				found = true
				if pre, post, _ := strings.Cut(l, " - "); !strings.HasPrefix(f[3], "/agent-") || !strings.HasPrefix(post, "tmpfs "+agentCopyFS+" ") {
					t.Errorf("native %v: the agent's bind: %s - %s, want from /agent-N on the %s tmpfs", native, pre, post, agentCopyFS)
				}
			}
		}
		if !found {
			t.Errorf("native %v: no bind at %s:\n%s", native, agentPath, mi)
		}
	}
}
