package container

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// The bound of all sandboxes' tasks together is pids.max of their parent
// cgroup, made if no sandbox made it yet.
func TestParentPidsMax(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (cgroups)")
	}
	parent := fmt.Sprintf("shoal-test-pidsmax-%d", os.Getpid())
	b := &Backend{cgroupParent: parent}
	mounts, err := b.cgroupMounts()
	if err != nil {
		t.Skip(err)
	}
	var dir string
	for _, m := range mounts {
		if !m.v2 && strings.Contains(strings.Join(m.options, ","), "pids") {
			dir = filepath.Join(m.dir, parent)
		}
	}
	if dir == "" {
		t.Skip("no cgroup v1 pids hierarchy")
	}
	t.Cleanup(func() { os.Remove(dir) })
	if err := b.setParentPidsMax(12345); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(dir, "pids.max"))
	if err != nil || strings.TrimSpace(string(got)) != "12345" {
		t.Fatalf("pids.max = %q, %v", got, err)
	}
}

// A best-effort sandbox's tasks are scheduled, on a cgroup v1 host, in a
// group of the cpu hierarchy under an idle parent beside the sandboxes'
// parent (so that the node and latency-sensitive sandboxes preempt them:
// makeIdle), with its CPU limit; what they start is born there; its other
// controllers' groups stay under the parent; a latency-sensitive sandbox
// stays where it was made; delete removes the group. Cold and pooled.
func TestBestEffortIdleGroup(t *testing.T) {
	requireRoot(t)
	cpu := "/sys/fs/cgroup/cpu"
	if _, err := os.Stat(filepath.Join(cpu, "cpu.shares")); err != nil {
		t.Skip("no cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu")
	}
	for _, pooled := range []bool{false, true} {
		t.Run(map[bool]string{false: "cold", true: "pooled"}[pooled], func(t *testing.T) {
			var b *Backend
			if pooled {
				b = newPoolBackend(t, t.TempDir(), 2)
				waitPool(t, b, 2)
			} else {
				b = newBackend(t)
			}
			be := poolSpec(t)
			be.Resources = sandbox.Resources{BestEffort: true, MilliCPU: 500}
			hb := create(t, b, be)
			ls := create(t, b, poolSpec(t))
			if got := hb.Data["pooled"] == "true"; got != pooled {
				t.Fatalf("pooled = %v", got)
			}
			cpuGroup := func(h sandbox.Handle, pid string) string {
				t.Helper()
				for _, l := range strings.Split(readTrim(t, "/proc/"+pid+"/cgroup"), "\n") {
					if f := strings.SplitN(l, ":", 3); len(f) == 3 && strings.Contains(","+f[1]+",", ",cpu,") {
						return f[2]
					}
				}
				t.Fatalf("no cpu line in /proc/%s/cgroup", pid)
				return ""
			}
			agentPid := func(h sandbox.Handle) string {
				pids, err := b.cgroupPids(h.Data["runc_id"])
				if err != nil || len(pids) == 0 {
					t.Fatalf("pids of %s: %v %v", h.ID, pids, err)
				}
				return strconv.Itoa(pids[0])
			}
			idle := filepath.Join(cpu, testCgroupParent+"-be")
			want := "/" + testCgroupParent + "-be/" + hb.Data["runc_id"]
			if got := cpuGroup(hb, agentPid(hb)); got != want {
				t.Errorf("best-effort agent in cpu group %s, want %s", got, want)
			}
			if got := readTrim(t, filepath.Join(idle, hb.Data["runc_id"], "cpu.cfs_quota_us")); got != "50000" {
				t.Errorf("best-effort group's quota %s, want 50000", got)
			}
			if _, err := os.Stat(filepath.Join(idle, "cpu.idle")); err == nil {
				if got := readTrim(t, filepath.Join(idle, "cpu.idle")); got != "1" {
					t.Errorf("%s/cpu.idle = %s", idle, got)
				}
			} else if got := readTrim(t, filepath.Join(idle, "cpu.shares")); got != "2" {
				t.Errorf("%s/cpu.shares = %s (no cpu.idle)", idle, got)
			}
			// A command's process (started after the move) is there too,
			// and the sandbox's pids group has not moved.
			out, code := run(t, hb, "sleep 30 & echo $!")
			if code != 0 {
				t.Fatalf("sleep: %d %s", code, out)
			}
			pids, _ := b.cgroupPids(hb.Data["runc_id"])
			if len(pids) < 2 {
				t.Fatalf("the sandbox's pids group lists %v", pids)
			}
			// The agent in the sandbox's group, its commands in their
			// own under it (commandsGroup), the spawner thread too.
			for _, p := range pids {
				w := want + "/" + commandsGroupName
				if strconv.Itoa(p) == agentPid(hb) {
					w = want
				}
				if got := cpuGroup(hb, strconv.Itoa(p)); got != w {
					t.Errorf("task %d of the best-effort sandbox in cpu group %s, want %s", p, got, w)
				}
			}
			for _, h := range []sandbox.Handle{hb, ls} {
				pid, _ := strconv.Atoi(agentPid(h))
				tid, err := spawnerThread(pid)
				if err != nil {
					t.Fatal(err)
				}
				base := "/" + testCgroupParent + "/" + h.Data["runc_id"]
				if h.ID == hb.ID {
					base = want
				}
				if got := cpuGroup(h, agentPid(h)+"/task/"+strconv.Itoa(tid)); got != base+"/"+commandsGroupName {
					t.Errorf("the spawner of %s in cpu group %s, want %s/%s", h.ID, got, base, commandsGroupName)
				}
				if out, code := run(t, h, "cat /proc/self/cgroup"); code != 0 || !strings.Contains(out, ":/"+commandsGroupName+"\n") && !strings.Contains(out, "/"+h.Data["runc_id"]+"/"+commandsGroupName+"\n") {
					t.Errorf("a command of %s not in its commands' cpu group:\n%s", h.ID, out)
				}
			}
			// Its commands run under SCHED_IDLE at nice 0 (fields 41 and
			// 19 of /proc/PID/stat), a latency-sensitive sandbox's under
			// SCHED_OTHER; the agents' threads at nice 0 under SCHED_OTHER
			// too (the commands' own CPU group keeps the agent above them,
			// not agent.AgentNice).
			for _, c := range []struct {
				h    sandbox.Handle
				want string
			}{{hb, "0 5"}, {ls, "0 0"}} {
				if out, code := run(t, c.h, "cut -d' ' -f19,41 /proc/self/stat"); code != 0 || strings.TrimSpace(out) != c.want {
					t.Errorf("a command of %s runs at nice and policy %q (%d), want %q", c.h.ID, out, code, c.want)
				}
				out, code := run(t, c.h, "cat /proc/1/task/*/stat | sed 's/.*) //' | cut -d' ' -f17,39 | sort | uniq -c")
				if code != 0 || !strings.Contains(out, " 0 0\n") || strings.Contains(out, " "+strconv.Itoa(agent.AgentNice)+" ") {
					t.Errorf("the agent's threads of %s (count, nice, policy):\n%s(%d), want them at nice 0", c.h.ID, out, code)
				}
			}
			if got := cpuGroup(ls, agentPid(ls)); got != "/"+testCgroupParent+"/"+ls.Data["runc_id"] {
				t.Errorf("latency-sensitive agent in cpu group %s", got)
			}
			if err := b.Delete(context.Background(), hb); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(idle, hb.Data["runc_id"])); !os.IsNotExist(err) {
				t.Errorf("best-effort cpu group left after delete: %v", err)
			}
			if err := b.Delete(context.Background(), ls); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(cpu, testCgroupParent, ls.Data["runc_id"])); !os.IsNotExist(err) {
				t.Errorf("cpu group (and its commands') left after delete: %v", err)
			}
		})
	}
}

// The core scheduling probe agrees with the kernel's configuration (where
// /proc/config.gz tells it) and with the host's SMT.
func TestProbeCoreSched(t *testing.T) {
	ok, why := probeCoreSched()
	t.Logf("core scheduling: %v %s", ok, why)
	out, err := exec.Command("sh", "-c", "zcat /proc/config.gz | grep -E '^(# )?CONFIG_SCHED_CORE[ =]'").Output()
	if err != nil {
		t.Skip("no /proc/config.gz to compare with")
	}
	built := strings.Contains(string(out), "CONFIG_SCHED_CORE=y")
	switch {
	case !built && (ok || !strings.Contains(why, "CONFIG_SCHED_CORE")):
		t.Errorf("kernel without CONFIG_SCHED_CORE: probe says %v (%s)", ok, why)
	case built && ok != smtActive():
		t.Errorf("kernel with CONFIG_SCHED_CORE, SMT %v: probe says %v (%s)", smtActive(), ok, why)
	}
}
