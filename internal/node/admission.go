package node

// Admission: a node refuses a create that would let its sandboxes together
// take more disk than the node may hand out, counted by their disk sizes
// (what they may take), not by what they use now: the sum stays within
// DiskBudget (by default a multiple of the data directory's free space at
// start, DiskBudgetFor), so that the node's store and logs keep room.
//
// Tasks are not admitted by the sum of pids limits (sandboxes rarely use
// theirs: summing them would cap a 24 GiB node at ~140 sandboxes); the
// kernel bounds all sandboxes' tasks together instead, with pids.max on
// their parent cgroup (HostPidsBudget, container.Config.PidsMax).
//
// A sandbox counts from its admission until its delete; one in error still
// counts (its disk is still there).

import (
	"fmt"
	"log/slog"
	"math"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// validateDisk fills and checks req.Disk for the backend of req.
func (m *Manager) validateDisk(req *CreateRequest) error {
	ok, how := false, "the "+req.Backend+" backend has no disk limits"
	if dl, is := m.backends[req.Backend].(sandbox.DiskLimiter); is {
		ok, how = dl.DiskLimits()
	}
	switch {
	case req.Disk < 0:
		return errdefs.New(ErrInvalid, "disk %d bytes is negative", req.Disk)
	case req.Disk > 0:
		if req.Disk < MinDiskBytes || req.Disk > m.cfg.MaxDisk {
			return errdefs.New(ErrInvalid, "disk must be between %d MiB and %d MiB, got %d bytes", MinDiskBytes>>20, m.cfg.MaxDisk>>20, req.Disk)
		}
		if !ok {
			return errdefs.New(errdefs.ErrFailedPrecondition, "this node cannot limit a sandbox's disk (%s): create it without a disk size", how)
		}
	case ok && m.cfg.DefaultDisk > 0:
		req.Disk = m.cfg.DefaultDisk
	}
	return nil
}

// admit counts r for the create of sandbox id, or refuses it with
// resource_exhausted when it would not fit in the node's budgets.
func (m *Manager) admit(id string, r sandbox.Resources) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var disk int64
	for _, e := range m.sandboxes {
		disk = satAdd(disk, e.rec.Resources.DiskBytes)
	}
	for _, r := range m.admitting {
		disk = satAdd(disk, r.DiskBytes)
	}
	if b := m.cfg.DiskBudget; b > 0 && satAdd(disk, r.DiskBytes) > b {
		return errdefs.New(errdefs.ErrResourceExhausted,
			"node disk budget: its sandboxes' disks add up to %d MiB of %d MiB (serve --disk-budget), and this one asks %d MiB: delete sandboxes or ask a smaller disk",
			disk>>20, b>>20, r.DiskBytes>>20)
	}
	m.admitting[id] = r
	return nil
}

// admitted forgets the admission of a create that failed.
func (m *Manager) admitted(id string) {
	m.mu.Lock()
	delete(m.admitting, id)
	m.mu.Unlock()
}

func satAdd(a, b int64) int64 {
	if b > 0 && a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// Host-wide kernel limits that sandboxes share with the node.

const (
	// PidMax is what RaiseHostLimits sets kernel.pid_max to when it is
	// lower (the kernel's maximum on 64-bit, as systemd sets it).
	PidMax = 4194304
	// InotifyInstances is what RaiseHostLimits sets
	// fs.inotify.max_user_instances to when it is lower: sandboxes run as
	// the host's root (no user namespace yet) and share its count with the
	// node and the host's own services.
	InotifyInstances = 8192
)

// RaiseHostLimits raises kernel.pid_max and fs.inotify.max_user_instances
// when they are below PidMax and InotifyInstances, logging what it did or
// could not do. Run once at the start of serve.
func RaiseHostLimits(log *slog.Logger) {
	for _, s := range []struct {
		path string
		want int64
	}{
		{"/proc/sys/kernel/pid_max", PidMax},
		{"/proc/sys/fs/inotify/max_user_instances", InotifyInstances},
	} {
		cur, err := readSysctl(s.path)
		if err != nil || cur >= s.want {
			continue
		}
		if err := os.WriteFile(s.path, []byte(strconv.FormatInt(s.want, 10)), 0); err != nil {
			log.Warn("cannot raise a host limit that sandboxes share with the node", "sysctl", s.path, "value", cur, "want", s.want, "err", err)
			continue
		}
		log.Info("raised a host limit that sandboxes share with the node", "sysctl", s.path, "from", cur, "to", s.want)
	}
}

// HostPidsBudget is the default bound of all sandboxes' tasks together:
// three quarters of the smaller of kernel.pid_max and kernel.threads-max,
// the rest left to the host and the node.
func HostPidsBudget() (int64, error) {
	pidMax, err := readSysctl("/proc/sys/kernel/pid_max")
	if err != nil {
		return 0, err
	}
	threads, err := readSysctl("/proc/sys/kernel/threads-max")
	if err != nil {
		return 0, err
	}
	return min(pidMax, threads) / 4 * 3, nil
}

// DiskBudgetFor is the default disk budget of a node whose data lives in
// dir: the free space of its file system, less a reserve for the node's
// own store and logs (a tenth of the file system, at least 1 GiB), times
// overcommit (1: full disks in every sandbox at once still fit).
func DiskBudgetFor(dir string, overcommit float64) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("disk budget: statfs %s: %w", dir, err)
	}
	free := int64(st.Bavail) * st.Bsize
	reserve := max(int64(st.Blocks)*st.Bsize/10, 1<<30)
	b := float64(max(free-reserve, 0)) * overcommit
	if b >= math.MaxInt64 {
		return math.MaxInt64, nil
	}
	return max(int64(b), 1), nil
}

func readSysctl(path string) (int64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
}
