package container

import (
	"bufio"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Usage reads the sandbox's memory and CPU counters from its cgroups (the
// host's cgroup file systems, which hold no links a sandbox could plant).
func (b *Backend) Usage(h sandbox.Handle) sandbox.Usage {
	u := sandbox.Usage{MemoryBytes: -1, CPUUsec: -1}
	id, err := b.runcID(h)
	if err != nil {
		return u
	}
	u.MemoryBytes = b.memoryCgroup(id).usage()
	u.CPUUsec = b.cpuUsec(id)
	return u
}

// cpuUsec is the CPU time of a cgroup: cpuacct.usage (ns) in a v1 cpuacct
// hierarchy, else usage_usec of cpu.stat in the v2 one; -1 if neither.
func (b *Backend) cpuUsec(runcID string) int64 {
	mounts, err := b.cgroupMounts()
	if err != nil {
		return -1
	}
	for _, m := range mounts {
		if !m.v2 && slices.Contains(m.options, "cpuacct") {
			dirs := []string{filepath.Join(m.dir, b.cgroupParent, runcID)}
			if isV1CPU(m) {
				// cpu,cpuacct mounted together: a best-effort sandbox's
				// tasks, and its account, are under the idle parent.
				dirs = append([]string{filepath.Join(m.dir, b.idleParent(), runcID)}, dirs...)
			}
			for _, dir := range dirs {
				if ns := readInt(filepath.Join(dir, "cpuacct.usage")); ns >= 0 {
					return ns / 1000
				}
			}
		}
	}
	for _, m := range mounts {
		if m.v2 {
			if n := cpuStatUsec(filepath.Join(m.dir, b.cgroupParent, runcID, "cpu.stat")); n >= 0 {
				return n
			}
		}
	}
	return -1
}

// cpuStatUsec reads usage_usec from a cgroup v2 cpu.stat file, -1 if absent.
func cpuStatUsec(path string) int64 {
	f, err := os.Open(path)
	if err != nil {
		return -1
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "usage_usec "); ok {
			if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
				return n
			}
		}
	}
	return -1
}
