package microvm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/shoal-sandbox/shoal/internal/cgroups"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// A VM's QEMU runs in a cgroup of its own, CgroupParent/ID in each
// hierarchy (as a container's processes do), so that its quotas hold on
// the host and not only inside the guest:
//
//   - memory: the guest's RAM plus qemuOverhead (QEMU itself, TCG's
//     translation cache, device buffers), memory+swap the same; a QEMU past
//     it is reclaimed, then killed by the kernel, alone;
//   - pids: qemuPids tasks (QEMU's threads: vCPUs, I/O workers);
//   - cpu: the sandbox's CPU limit as a CFS quota over all of QEMU's
//     threads; a best-effort VM's group goes under the idle parent beside
//     CgroupParent (CgroupParent-be, as a best-effort container's), so the
//     node and latency-sensitive sandboxes preempt it;
//   - cpuacct: its CPU time, for the node's usage.
//
// On a cgroup v2-only host the same limits are written in the unified
// hierarchy (when its controllers are enabled for us); on a hybrid host
// the unified hierarchy is systemd's and is left alone.
//
// QEMU is started, then moved into its groups before it has run the
// guest (microseconds after its start; the threads it starts later are
// born there). A resume's new QEMU goes into the same groups.
const (
	qemuOverhead = 384 << 20
	qemuPids     = 128
	cpuPeriod    = 100000 // µs
)

var (
	hostCgroupsOnce sync.Once
	hostCgroups     []cgroups.Mount
	hostCgroupsErr  error
)

func mounts() ([]cgroups.Mount, error) {
	hostCgroupsOnce.Do(func() { hostCgroups, hostCgroupsErr = cgroups.Mounts() })
	return hostCgroups, hostCgroupsErr
}

// vmGroups returns the VM's group directory in each hierarchy that takes
// a limit, with that hierarchy.
func (b *Backend) vmGroups(h sandbox.Handle) ([]cgroups.Mount, []string, error) {
	ms, err := mounts()
	if err != nil {
		return nil, nil, err
	}
	v1 := false
	for _, m := range ms {
		v1 = v1 || m.Has("memory") || m.Has("cpu") || m.Has("pids")
	}
	var out []cgroups.Mount
	var dirs []string
	for _, m := range ms {
		var dir string
		switch {
		case m.V2 && !v1:
			dir = filepath.Join(m.Dir, b.cfg.CgroupParent, h.ID)
		case m.Has("cpu") && h.Data["qos"] == "be":
			dir = filepath.Join(m.Dir, cgroups.IdleParent(b.cfg.CgroupParent), h.ID)
		case m.Has("memory"), m.Has("cpu"), m.Has("cpuacct"), m.Has("pids"):
			dir = filepath.Join(m.Dir, b.cfg.CgroupParent, h.ID)
		default:
			continue
		}
		out, dirs = append(out, m), append(dirs, dir)
	}
	return out, dirs, nil
}

// enterCgroup makes the VM's groups (if not made yet), writes its limits
// and moves the process pid (its QEMU) into them.
func (b *Backend) enterCgroup(h sandbox.Handle, pid int) error {
	if b.cfg.CgroupParent == "" {
		return nil
	}
	mem, err1 := strconv.ParseInt(h.Data["mem"], 10, 64)
	milli, err2 := strconv.ParseInt(h.Data["millicpu"], 10, 64)
	if err1 != nil || mem <= 0 {
		return fmt.Errorf("vm cgroup: sandbox %s: memory %q", h.ID, h.Data["mem"])
	}
	if err2 != nil {
		milli = 0 // a VM made before its handle recorded it: no quota
	}
	ms, dirs, err := b.vmGroups(h)
	if err != nil {
		return err
	}
	quota := int64(-1)
	if milli > 0 {
		quota = milli * cpuPeriod / 1000
	}
	limit := mem + qemuOverhead
	for i, m := range ms {
		dir := dirs[i]
		if m.Has("cpu") && h.Data["qos"] == "be" {
			if err := cgroups.MakeIdle(filepath.Dir(dir)); err != nil {
				return fmt.Errorf("vm cgroup: %w", err)
			}
		}
		if m.V2 {
			if err := enableV2(m.Dir, b.cfg.CgroupParent); err != nil {
				return err
			}
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("vm cgroup: %w", err)
		}
		var writes [][2]string
		switch {
		case m.V2:
			cpuMax := "max"
			if quota > 0 {
				cpuMax = strconv.FormatInt(quota, 10)
			}
			writes = [][2]string{
				{"memory.max", strconv.FormatInt(limit, 10)}, {"memory.swap.max", "0"},
				{"pids.max", strconv.Itoa(qemuPids)}, {"cpu.max", cpuMax + " " + strconv.Itoa(cpuPeriod)},
			}
			if h.Data["qos"] == "be" {
				writes = append(writes, [2]string{"cpu.idle", "1"})
			}
		case m.Has("memory"):
			if err := cgroups.SetMemoryV1(dir, limit); err != nil {
				return fmt.Errorf("vm cgroup: %w", err)
			}
		}
		if m.Has("pids") {
			writes = append(writes, [2]string{"pids.max", strconv.Itoa(qemuPids)})
		}
		if m.Has("cpu") {
			writes = append(writes, [2]string{"cpu.cfs_period_us", strconv.Itoa(cpuPeriod)}, [2]string{"cpu.cfs_quota_us", strconv.FormatInt(quota, 10)})
		}
		for _, w := range writes {
			write := cgroups.Write
			if m.V2 {
				write = cgroups.WriteIfExists // a controller not enabled for us
			}
			if err := write(filepath.Join(dir, w[0]), w[1]); err != nil {
				return fmt.Errorf("vm cgroup: %w", err)
			}
		}
		if err := cgroups.Write(filepath.Join(dir, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
			return fmt.Errorf("vm cgroup: %w", err)
		}
	}
	return nil
}

// enableV2 enables the memory, pids and cpu controllers for the groups
// below parent, from the unified hierarchy's root down (as runc does for
// a container).
func enableV2(root, parent string) error {
	dir := root
	for _, part := range append([]string{""}, filepath.SplitList(strings.ReplaceAll(parent, "/", string(filepath.ListSeparator)))...) {
		dir = filepath.Join(dir, part)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("vm cgroup: %w", err)
		}
		if err := cgroups.Write(filepath.Join(dir, "cgroup.subtree_control"), "+memory +pids +cpu"); err != nil {
			return fmt.Errorf("vm cgroup: %w", err)
		}
	}
	return nil
}

// removeCgroup removes the VM's groups (its QEMU has exited).
func (b *Backend) removeCgroup(h sandbox.Handle) error {
	if b.cfg.CgroupParent == "" {
		return nil
	}
	_, dirs, err := b.vmGroups(h)
	if err != nil {
		return err
	}
	var errs []error
	for _, d := range dirs {
		errs = append(errs, cgroups.Remove(d, 5*time.Second))
	}
	return errors.Join(errs...)
}

// Usage implements sandbox.UsageReader from the VM's groups: the memory
// charged to its QEMU (guest RAM it touched, QEMU's own, page cache) and
// QEMU's CPU time (every vCPU and QEMU's threads); -1 without cgroups. A
// paused VM has no QEMU: what its group still holds is page cache.
func (b *Backend) Usage(h sandbox.Handle) sandbox.Usage {
	u := sandbox.Usage{MemoryBytes: -1, CPUUsec: -1}
	if b.cfg.CgroupParent == "" {
		return u
	}
	ms, dirs, err := b.vmGroups(h)
	if err != nil {
		return u
	}
	read := cgroups.ReadInt
	for i, m := range ms {
		switch {
		case m.V2:
			u.MemoryBytes = read(filepath.Join(dirs[i], "memory.current"))
		case m.Has("memory"):
			u.MemoryBytes = read(filepath.Join(dirs[i], "memory.usage_in_bytes"))
		}
		if m.Has("cpuacct") {
			if ns := read(filepath.Join(dirs[i], "cpuacct.usage")); ns >= 0 {
				u.CPUUsec = ns / 1000
			}
		}
	}
	return u
}
