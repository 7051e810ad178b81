// Package cgroups is the little of the host's control groups that Shoal's
// backends share: the mounted hierarchies (v1, v2 or both), writing a
// control file, a v1 memory limit, the tasks of a group, and removing a
// group whose tasks are exiting. The container backend (runc makes its
// groups) and the VM backends (a QEMU's group, made here) use it.
package cgroups

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/procfs"
)

// Mount is one mounted cgroup hierarchy.
type Mount struct {
	Dir     string   // mount point, e.g. /sys/fs/cgroup/memory
	V2      bool     // cgroup2 (the unified hierarchy)
	Options []string // super options: the v1 controllers, "name=systemd", ...
}

// Has tells whether a v1 hierarchy has the controller ctrl.
func (m Mount) Has(ctrl string) bool { return !m.V2 && slices.Contains(m.Options, ctrl) }

// Mounts lists the cgroup hierarchies mounted in our mount namespace, each
// once (the first mount of a hierarchy wins).
func Mounts() ([]Mount, error) {
	all, err := procfs.Mountinfo("self")
	if err != nil {
		return nil, fmt.Errorf("list cgroup mounts: %w", err)
	}
	var mounts []Mount
	seen := map[string]bool{}
	for _, m := range all {
		// 36 25 0:31 / /sys/fs/cgroup/memory rw,relatime shared:14 - cgroup cgroup rw,memory
		if (m.FSType != "cgroup" && m.FSType != "cgroup2") || m.Root != "/" || m.SuperOptions == nil {
			continue
		}
		key := m.FSType + " " + strings.Join(m.SuperOptions, ",")
		if seen[key] {
			continue
		}
		seen[key] = true
		mounts = append(mounts, Mount{Dir: m.Point, V2: m.FSType == "cgroup2", Options: m.SuperOptions})
	}
	return mounts, nil
}

// Write writes a cgroup control file (never creating it: cgroupfs answers
// EACCES, not ENOENT, to a create).
func Write(path, value string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err == nil {
		_, err = f.WriteString(value)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		return fmt.Errorf("write %s = %s: %w", path, value, err)
	}
	return nil
}

// WriteIfExists is Write, doing nothing where the file does not exist (a
// controller or a feature the kernel does not have).
func WriteIfExists(path, value string) error {
	err := Write(path, value)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// SetMemoryV1 sets a v1 group's memory and memory+swap to the same limit.
// The kernel keeps memory <= memory+swap at every step, so the order
// depends on whether the limit goes down or up.
func SetMemoryV1(dir string, limit int64) error {
	value := strconv.FormatInt(limit, 10)
	memFile := dir + "/memory.limit_in_bytes"
	swFile := dir + "/memory.memsw.limit_in_bytes"
	cur, err := os.ReadFile(memFile)
	if err != nil {
		return fmt.Errorf("read %s: %w", memFile, err)
	}
	curLimit, _ := strconv.ParseInt(strings.TrimSpace(string(cur)), 10, 64)
	order := []string{memFile, swFile}
	if limit > curLimit {
		order = []string{swFile, memFile}
	}
	for _, f := range order {
		if f == swFile {
			// No swap accounting (swapaccount=0): nothing to bound.
			if err := WriteIfExists(f, value); err != nil {
				return err
			}
			continue
		}
		if err := Write(f, value); err != nil {
			return err
		}
	}
	return nil
}

// ReadPids lists the pids in a cgroup.procs (or tasks) file.
func ReadPids(procs string) ([]int, error) {
	data, err := os.ReadFile(procs)
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(data)) {
		pid, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", procs, err)
		}
		pids = append(pids, pid)
	}
	return pids, nil
}

// Remove removes the group dir (none: nothing to do), waiting up to wait
// for tasks killed a moment ago to leave it (they may take a while on a
// loaded host: 55 ms of retries was too short at load 88).
func Remove(dir string, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for i := 1; ; i++ {
		err := unix.Rmdir(dir)
		if err == nil || errors.Is(err, unix.ENOENT) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			return fmt.Errorf("remove cgroup %s: %w", dir, err)
		}
		time.Sleep(time.Duration(min(i, 50)) * time.Millisecond) // tasks still exiting
	}
}

// IdleParent names the cgroup, beside parent at the same level of each
// hierarchy ("shoal-be" for "shoal"), under which best-effort sandboxes'
// CPU groups go on a cgroup v1 host (containers' and VMs' alike).
func IdleParent(parent string) string { return parent + "-be" }

// MakeIdle makes the v1 cpu group dir (if need be) and makes it idle
// (cpu.idle 1), the lowest weight first: a kernel without cpu.idle keeps
// that, and an idle group refuses a weight.
func MakeIdle(dir string) error {
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if idle, err := os.ReadFile(dir + "/cpu.idle"); err == nil && strings.TrimSpace(string(idle)) == "1" {
		return nil
	}
	if err := Write(dir+"/cpu.shares", "2"); err != nil {
		return err
	}
	return WriteIfExists(dir+"/cpu.idle", "1")
}

// ReadInt reads a control file holding one integer; -1 if it cannot.
func ReadInt(path string) int64 {
	data, err := os.ReadFile(path)
	if err != nil {
		return -1
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	if err != nil {
		return -1
	}
	return n
}
