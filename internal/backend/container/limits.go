package container

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/cgroups"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// CPU weights: a pool container's while it waits, a sandbox's (the
// kernel's default, which cold sandboxes keep).
const (
	poolCPUShares    = 2
	defaultCPUShares = 1024
	beCPUShares      = 2 // a best-effort sandbox's
)

// setLimits writes a sandbox's resource limits into the cgroups of the
// container runcID, as runc would have from the OCI spec: memory and
// memory+swap (v1: memory.limit_in_bytes, memory.memsw.limit_in_bytes;
// v2: memory.max, memory.swap.max = 0), the CFS quota, the pids limit, and
// the default CPU weight in place of a pool container's lowest one.
// A pool container is created with the defaults; a claim sets the limits
// of the sandbox it becomes before the sandbox's root arrives.
func (b *Backend) setLimits(runcID string, r sandbox.Resources) error {
	mem := r.MemoryBytes
	if mem == 0 {
		mem = DefaultMemoryBytes
	}
	pids := r.Pids
	if pids == 0 {
		pids = DefaultPids
	}
	if mem < 0 || pids < 0 || r.MilliCPU < 0 {
		return fmt.Errorf("negative resource limit %+v", r)
	}
	quota := int64(-1)
	if r.MilliCPU > 0 {
		quota = r.MilliCPU * cpuPeriod / 1000
	}
	mounts, err := b.cgroupMounts()
	if err != nil {
		return err
	}
	memStr, pidsStr := strconv.FormatInt(mem, 10), strconv.FormatInt(pids, 10)
	for _, m := range mounts {
		dir := filepath.Join(m.dir, b.cgroupParent, runcID)
		has := func(ctrl string) bool { return slices.Contains(m.options, ctrl) }
		if m.v2 {
			// Only the controllers enabled for us have files (none on a
			// hybrid host, whose v2 hierarchy is systemd's alone).
			for _, w := range []struct{ file, value string }{
				{"memory.max", memStr},
				{"memory.swap.max", "0"},
				{"pids.max", pidsStr},
				{"cpu.max", cpuMax(quota)},
				{"cpu.idle", "0"}, // before the weight: an idle group refuses one
				{"cpu.weight", map[bool]string{false: "100", true: "1"}[r.BestEffort]},
				{"cpu.idle", map[bool]string{false: "0", true: "1"}[r.BestEffort]},
			} {
				if err := writeIfExists(filepath.Join(dir, w.file), w.value); err != nil {
					return err
				}
			}
			continue
		}
		if has("memory") {
			if err := cgroups.SetMemoryV1(dir, mem); err != nil {
				return err
			}
		}
		if has("pids") {
			if err := writeCgroup(filepath.Join(dir, "pids.max"), pidsStr); err != nil {
				return err
			}
		}
		if has("cpu") {
			shares := defaultCPUShares
			if r.BestEffort {
				shares = beCPUShares
			}
			// A best-effort sandbox's tasks leave this group (makeIdle).
			if err := writeCgroup(filepath.Join(dir, "cpu.shares"), strconv.Itoa(shares)); err != nil {
				return err
			}
			if err := writeCgroup(filepath.Join(dir, "cpu.cfs_period_us"), strconv.Itoa(cpuPeriod)); err != nil {
				return err
			}
			if err := writeCgroup(filepath.Join(dir, "cpu.cfs_quota_us"), strconv.FormatInt(quota, 10)); err != nil {
				return err
			}
		}
	}
	return nil
}

func cpuMax(quota int64) string {
	if quota < 0 {
		return "max " + strconv.Itoa(cpuPeriod)
	}
	return strconv.FormatInt(quota, 10) + " " + strconv.Itoa(cpuPeriod)
}

var (
	writeCgroup   = cgroups.Write
	writeIfExists = cgroups.WriteIfExists
)

// idleParent is the cgroup, beside --cgroup-parent (the same level of
// each hierarchy: "shoal-be" for the default "shoal"), under which a
// best-effort sandbox's CPU group goes on a cgroup v1 host (see makeIdle).
func (b *Backend) idleParent() string { return cgroups.IdleParent(b.cgroupParent) }

// makeIdle makes a best-effort sandbox's CPU scheduling idle against all
// that is not best-effort: the node's own process and the latency-
// sensitive sandboxes preempt it as soon as they wake.
//
// SCHED_IDLE on its commands (agent.AgentNice) ranks them only within their own
// group, and an idle group (cpu.idle 1) only among its siblings: under
// --cgroup-parent, the sandboxes' parent as a whole still competed with
// the node (serve, in its own cgroup above) at its full weight, so a
// waking serve waited for a burner's slice to end (an LS exec's p99 went
// from 3.5 to 22.6 ms with best-effort burners on a quiet host). So on a
// cgroup v1 host, whose cpu controller is a hierarchy of its own, the
// sandbox's tasks move, in that hierarchy only, to idleParent()/runcID,
// idleParent itself idle: at the top of the hierarchy, where the node and
// the latency-sensitive sandboxes' parent are its siblings. Its memory,
// pids and freezer groups stay where they are. On the unified (v2)
// hierarchy every controller would move with it: there the group stays
// under --cgroup-parent and is idle among its siblings only.
//
// It runs when the sandbox is made, before anything of the workload runs,
// so no task of the sandbox is left behind; the tasks a moved task starts
// are born in its group.
func (b *Backend) makeIdle(runcID string, r sandbox.Resources) error {
	mounts, err := b.cgroupMounts()
	if err != nil {
		return err
	}
	for _, m := range mounts {
		switch {
		case m.v2:
			if err := writeIfExists(filepath.Join(m.dir, b.cgroupParent, runcID, "cpu.idle"), "1"); err != nil {
				return err
			}
		case isV1CPU(m):
			if err := b.moveToIdleParent(m, runcID, r); err != nil {
				return fmt.Errorf("best-effort CPU group: %w", err)
			}
		}
	}
	return nil
}

func (b *Backend) moveToIdleParent(m cgroupMount, runcID string, r sandbox.Resources) error {
	parent := filepath.Join(m.dir, b.idleParent())
	if err := cgroups.MakeIdle(parent); err != nil {
		return err
	}
	dst := filepath.Join(parent, runcID)
	if err := os.Mkdir(dst, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	quota := int64(-1)
	if r.MilliCPU > 0 {
		quota = r.MilliCPU * cpuPeriod / 1000
	}
	if err := writeCgroup(filepath.Join(dst, "cpu.cfs_period_us"), strconv.Itoa(cpuPeriod)); err != nil {
		return err
	}
	if err := writeCgroup(filepath.Join(dst, "cpu.cfs_quota_us"), strconv.FormatInt(quota, 10)); err != nil {
		return err
	}
	src := filepath.Join(m.dir, b.cgroupParent, runcID, "cgroup.procs")
	for range 10 {
		pids, err := readPids(src)
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		for _, pid := range pids {
			if err := writeCgroup(filepath.Join(dst, "cgroup.procs"), strconv.Itoa(pid)); err != nil && !errors.Is(err, unix.ESRCH) {
				return err
			}
		}
	}
	return fmt.Errorf("tasks keep appearing in %s", src)
}

// commandsGroupName is the CPU group, under a sandbox's own in cgroup v1's
// cpu hierarchy, that its commands are born in (see agent.AgentNice).
const commandsGroupName = "cmds"

// placeAgent makes the CPU group of the commands of the container whose
// agent's pid is in pidFile (commandsGroup) and sets the agent's threads'
// nice value: 0 when the commands have their group, else agent.AgentNice
// (above its commands, which it forks at nice 0). best: the sandbox's CPU
// group is under the idle parent (makeIdle ran). The agent could do
// neither itself. It returns the agent's pid and the nice value it set.
func (b *Backend) placeAgent(runcID, pidFile string, best bool) (pid, nice int, err error) {
	if pid, err = readPidFile(pidFile); err != nil {
		return 0, 0, err
	}
	nice = agent.AgentNice
	if err := b.commandsGroup(runcID, pid, best); err != nil {
		b.log.Debug("no CPU group for the commands: the agent runs above them", "runc_id", runcID, "nice", nice, "why", err)
	} else {
		nice = 0
	}
	return pid, nice, agent.Prioritize(pid, nice)
}

// commandsGroup makes the CPU group the sandbox's commands are born in, a
// child of its own group in the v1 cpu hierarchy, and moves the agent's
// spawner thread (agent.SpawnerThread) into it: cgroup v1 places threads,
// and a task is born in its creator's group. The commands then weigh as
// one task (the group's cpu.shares) against each thread of the agent
// within the sandbox's share, so that a fork bomb cannot starve the agent
// that must kill it, without the agent's nice -20, which skewed the
// host's per-CPU split of busy sandboxes' weights. The sandbox's CPU
// limit (its group's quota) covers the child. Not on a unified (v2)
// hierarchy, where the cpu controller places processes, not threads.
func (b *Backend) commandsGroup(runcID string, pid int, best bool) error {
	mounts, err := b.cgroupMounts()
	if err != nil {
		return err
	}
	i := slices.IndexFunc(mounts, isV1CPU)
	if i < 0 {
		return errors.New("no cgroup v1 cpu hierarchy")
	}
	parent := b.cgroupParent
	if best {
		parent = b.idleParent()
	}
	dir := filepath.Join(mounts[i].dir, parent, runcID, commandsGroupName)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	tid, err := spawnerThread(pid)
	if err != nil {
		return err
	}
	return writeCgroup(filepath.Join(dir, "tasks"), strconv.Itoa(tid))
}

// spawnerThread finds the thread of agent pid that forks its commands.
func spawnerThread(pid int) (int, error) {
	task := "/proc/" + strconv.Itoa(pid) + "/task"
	ents, err := os.ReadDir(task)
	if err != nil {
		return 0, err
	}
	for _, e := range ents {
		comm, err := os.ReadFile(filepath.Join(task, e.Name(), "comm"))
		if err == nil && strings.TrimSpace(string(comm)) == agent.SpawnerThread {
			return strconv.Atoi(e.Name())
		}
	}
	return 0, fmt.Errorf("agent %d has no %s thread (an older agent)", pid, agent.SpawnerThread)
}
