package fncall

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/cgroups"
)

// Per-run cgroups.
//
// Every process of a call (the compile step, each test) runs in cgroups of
// its own, created by the host under the sandbox's cgroup in the memory,
// cpuacct and pids v1 hierarchies and removed after the run. The agent
// makes the process be born in them (see internal/agent/fncall.go), so the
// accounting covers the process and everything it starts, from its first
// instruction: CPU time is cpuacct.usage, peak memory
// memory.max_usage_in_bytes (anonymous memory, page cache and tmpfs files
// the run created), the memory limit is enforced by the kernel's OOM killer
// inside the run's cgroup (counted in memory.oom_control), the process
// limit by pids.max.

// controllers are the v1 controllers a run's cgroup is created in.
var controllers = []string{"memory", "cpuacct", "pids"}

// hierarchies maps each needed controller to its v1 mount point.
type hierarchies map[string]string

// findHierarchies finds the v1 hierarchies of the controllers among the
// host's cgroup mounts.
func findHierarchies() (hierarchies, error) {
	mounts, err := cgroups.Mounts()
	if err != nil {
		return nil, err
	}
	h := hierarchies{}
	for _, m := range mounts {
		for _, c := range controllers {
			if _, seen := h[c]; !seen && m.Has(c) {
				h[c] = m.Dir
			}
		}
	}
	var missing []string
	for _, c := range controllers {
		if h[c] == "" {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("fncall needs the cgroup v1 hierarchies of %s (this host has none mounted: cgroup v2 alone is not supported yet)", strings.Join(missing, ", "))
	}
	return h, nil
}

// runCgroup is the cgroup set of one run.
type runCgroup struct {
	dirs    map[string]string // controller → directory
	tasks   []int             // open tasks files, for the agent
	pidsMax int               // open pids.max, for the agent (-1 once closed)
}

// newRunCgroup creates the cgroups of a run under the sandbox's (parent:
// one directory per controller) and opens their tasks files. They are
// made ahead of the run, off its critical path; setLimits arms them. On
// error nothing is left.
func newRunCgroup(parent map[string]string, name string) (cg *runCgroup, err error) {
	cg = &runCgroup{dirs: map[string]string{}, pidsMax: -1}
	defer func() {
		if err != nil {
			cg.closeTasks()
			cg.remove()
		}
	}()
	for _, c := range controllers {
		d := filepath.Join(parent[c], name)
		if err := os.Mkdir(d, 0o755); err != nil {
			return cg, fmt.Errorf("create cgroup: %w", err)
		}
		cg.dirs[c] = d
	}
	for _, c := range controllers {
		fd, err := unix.Open(filepath.Join(cg.dirs[c], "tasks"), unix.O_WRONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return cg, fmt.Errorf("open cgroup tasks: %w", err)
		}
		cg.tasks = append(cg.tasks, fd)
	}
	if cg.pidsMax, err = unix.Open(filepath.Join(cg.dirs["pids"], "pids.max"), unix.O_WRONLY|unix.O_CLOEXEC, 0); err != nil {
		return cg, fmt.Errorf("open cgroup pids.max: %w", err)
	}
	return cg, nil
}

// setLimits sets the run's memory limit (memory and memory+swap: no swap
// escape) and process limit.
func (cg *runCgroup) setLimits(memory int64, pids int) error {
	if err := cgroups.SetMemoryV1(cg.dirs["memory"], memory); err != nil {
		return err
	}
	return cgroups.Write(filepath.Join(cg.dirs["pids"], "pids.max"), strconv.Itoa(pids))
}

// dispose removes the run's cgroups, killing from the host whatever the
// agent left in them (it reports whether anything was left, or could not
// be removed: the sandbox is then not reused).
func (cg *runCgroup) dispose() (clean bool, err error) {
	cg.closeTasks()
	clean = true
	if len(cg.procs()) > 0 {
		clean = false
		err = cg.kill(5 * time.Second)
	}
	if rerr := cg.remove(); rerr != nil {
		clean = false
		err = errors.Join(err, rerr)
	}
	return clean, err
}

func (cg *runCgroup) closeTasks() {
	for _, fd := range cg.tasks {
		unix.Close(fd)
	}
	cg.tasks = nil
	if cg.pidsMax >= 0 {
		unix.Close(cg.pidsMax)
		cg.pidsMax = -1
	}
}

// cpuTime is the CPU time used by the run so far.
func (cg *runCgroup) cpuTime() (time.Duration, error) {
	v, err := readInt(filepath.Join(cg.dirs["cpuacct"], "cpuacct.usage"))
	return time.Duration(v), err
}

// memStats returns the run's peak memory, how often the limit was hit,
// and how many processes the OOM killer killed in it.
func (cg *runCgroup) memStats() (peak, failcnt, oomKills int64, err error) {
	d := cg.dirs["memory"]
	if peak, err = readInt(filepath.Join(d, "memory.max_usage_in_bytes")); err != nil {
		return
	}
	if failcnt, err = readInt(filepath.Join(d, "memory.failcnt")); err != nil {
		return
	}
	b, err := os.ReadFile(filepath.Join(d, "memory.oom_control"))
	if err != nil {
		return
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "oom_kill "); ok {
			oomKills, _ = strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return
}

// readInt reads a control file holding one integer.
func readInt(path string) (int64, error) {
	v := cgroups.ReadInt(path)
	if v < 0 {
		return 0, fmt.Errorf("read %s: not a count", path)
	}
	return v, nil
}

// procs lists the host pids still in the run's cgroup.
func (cg *runCgroup) procs() []int {
	pids, _ := cgroups.ReadPids(filepath.Join(cg.dirs["pids"], "cgroup.procs"))
	return pids
}

// kill SIGKILLs what is left in the run's cgroup from the host, through
// pidfds (a pid reused by another process in the meantime is not hit: the
// pidfd's process is checked to be in the cgroup), until it is empty or
// wait has passed. The agent normally leaves nothing: this is the safety
// net.
func (cg *runCgroup) kill(wait time.Duration) error {
	deadline := time.Now().Add(wait)
	want := "/" + filepath.Base(cg.dirs["pids"]) + "\n"
	for {
		pids := cg.procs()
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d processes left in %s", len(pids), cg.dirs["pids"])
		}
		for _, pid := range pids {
			fd, err := unix.PidfdOpen(pid, 0)
			if err != nil {
				continue
			}
			if b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup"); err == nil && strings.Contains(string(b), want) {
				unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
			}
			unix.Close(fd)
		}
		time.Sleep(time.Millisecond)
	}
}

// remove removes the run's cgroups (which must be empty), waiting a
// moment for exiting tasks to leave them.
func (cg *runCgroup) remove() error {
	var errs []error
	for _, d := range cg.dirs {
		errs = append(errs, cgroups.Remove(d, 250*time.Millisecond))
	}
	return errors.Join(errs...)
}
