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
//
// Tenants: a create for a tenant with a quota (Config.Quotas) is refused,
// resource_exhausted with the quota named, when the tenant's sandboxes
// (admitted, running, in error or being deleted) would exceed its number of
// sandboxes, total memory or total CPU, or when its create-rate token
// bucket is empty. Admission comes before anything of the sandbox exists,
// so a refused create leaves nothing; a create repeated with its client key
// returns the sandbox already made without being admitted again.

import (
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
	"github.com/shoal-sandbox/shoal/internal/tenant"
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
	if req.LogBudget == 0 {
		req.LogBudget = m.defaultLog(req.Disk)
	}
	return nil
}

// validateLog checks req.LogBudget; validateDisk (after it) fills the
// default, which may depend on the disk.
func (m *Manager) validateLog(req *CreateRequest) error {
	if req.LogBudget != 0 && (req.LogBudget < MinLogBytes || req.LogBudget > m.cfg.MaxLog) {
		return errdefs.New(ErrInvalid, "log budget must be between %d MiB and %d MiB, got %d bytes", MinLogBytes>>20, m.cfg.MaxLog>>20, req.LogBudget)
	}
	return nil
}

// defaultLog is the log budget of a sandbox of disk bytes (0: no limit)
// whose create asked none.
func (m *Manager) defaultLog(disk int64) int64 {
	switch {
	case m.cfg.DefaultLog > 0:
		return m.cfg.DefaultLog
	case disk > 0:
		return min(max(disk/4, MinLogBytes), m.cfg.MaxLog)
	}
	return min(DefaultLogBytes, m.cfg.MaxLog)
}

// Quotas gives the quota of a tenant (*tenant.Store).
type Quotas interface {
	Quota(tenant string) tenant.Quota
}

// admission is what a create in flight was admitted with.
type admission struct {
	tenant string
	res    sandbox.Resources
}

// admit counts r for the create of sandbox id for tenant t, or refuses it
// with resource_exhausted when it would not fit in the node's budgets or in
// the tenant's quota.
func (m *Manager) admit(id, t string, r sandbox.Resources) error {
	var q tenant.Quota
	if m.cfg.Quotas != nil && t != "" {
		q = m.cfg.Quotas.Quota(t)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var disk, mem, cpu int64
	var mine struct{ n, mem, cpu int64 }
	count := func(owner string, res sandbox.Resources, paused bool) {
		// The host's disk: its writable layer and its commands' logs.
		disk = satAdd(disk, satAdd(res.DiskBytes, res.LogBytes))
		if !paused { // a paused sandbox's memory is reclaimed, its CPU idle
			mem = satAdd(mem, res.MemoryBytes)
			cpu = satAdd(cpu, res.MilliCPU)
		}
		if owner == t {
			mine.n++
			mine.mem = satAdd(mine.mem, res.MemoryBytes)
			mine.cpu = satAdd(mine.cpu, res.MilliCPU)
		}
	}
	for _, e := range m.sandboxes {
		count(e.rec.Tenant, e.rec.Resources, e.rec.State == StatePaused)
	}
	for _, a := range m.admitting {
		count(a.tenant, a.res, false)
	}
	if err := m.cfg.Capacity.check(mem, cpu, r); err != nil {
		return err
	}
	if b := m.cfg.DiskBudget; b > 0 && satAdd(disk, satAdd(r.DiskBytes, r.LogBytes)) > b {
		return errdefs.New(errdefs.ErrResourceExhausted,
			"node disk budget: its sandboxes' disks and log budgets add up to %d MiB of %d MiB (serve --disk-budget), and this one asks %d MiB: delete sandboxes or ask a smaller disk or log budget",
			disk>>20, b>>20, satAdd(r.DiskBytes, r.LogBytes)>>20)
	}
	switch {
	case q.MaxSandboxes > 0 && mine.n+1 > q.MaxSandboxes:
		return errdefs.New(errdefs.ErrResourceExhausted,
			"tenant %s quota max-sandboxes: it has %d sandboxes of %d: delete one first", t, mine.n, q.MaxSandboxes)
	case q.MaxMemory > 0 && satAdd(mine.mem, r.MemoryBytes) > q.MaxMemory:
		return errdefs.New(errdefs.ErrResourceExhausted,
			"tenant %s quota max-memory: its sandboxes have %d MiB of %d MiB, and this one asks %d MiB", t, mine.mem>>20, q.MaxMemory>>20, r.MemoryBytes>>20)
	case q.MaxMilliCPU > 0 && satAdd(mine.cpu, r.MilliCPU) > q.MaxMilliCPU:
		return errdefs.New(errdefs.ErrResourceExhausted,
			"tenant %s quota max-cpus: its sandboxes have %.3f cpus of %.3f, and this one asks %.3f", t, float64(mine.cpu)/1000, float64(q.MaxMilliCPU)/1000, float64(r.MilliCPU)/1000)
	}
	if q.CreatesPerSecond > 0 {
		b := m.buckets[t]
		if b == nil || !b.Same(q.CreatesPerSecond, q.Burst) {
			b = tenant.NewBucket(q.CreatesPerSecond, q.Burst, time.Now())
			m.buckets[t] = b
		}
		if !b.Take(time.Now()) {
			return errdefs.New(errdefs.ErrResourceExhausted,
				"tenant %s quota creates-per-second: more than %g creates a second (burst %d): retry later", t, q.CreatesPerSecond, q.Burst)
		}
	} else {
		delete(m.buckets, t)
	}
	m.admitting[id] = admission{tenant: t, res: r}
	return nil
}

// Capacity is what a node admits beyond the sandboxes' own limits: their
// memory and CPU limits may add up to a multiple of the host's (sandboxes
// idle most of the time: DSec's use under 5% of their CPU), while the
// host's real available memory stays above a floor. A create past either
// is refused with unavailable ("node full"), which says: this node, not
// the request, is the problem; retry later or elsewhere (the cluster
// places it on another node). Paused sandboxes count neither memory nor
// CPU (their memory is reclaimed).
type Capacity struct {
	MemoryOvercommit float64 // memory limits may add up to this × MemTotal; 0: no bound
	CPUOvercommit    float64 // CPU limits may add up to this × the host's CPUs; 0: no bound
	MinAvailable     int64   // refuse while MemAvailable is below this; 0: no floor

	// Host: MemTotal and MemAvailable (bytes) and CPUs; /proc/meminfo and
	// runtime.NumCPU when nil (tests set it).
	Host func() (total, available int64, cpus int, err error)
}

// check refuses a create of r onto sandboxes whose limits add up to mem
// and cpu.
func (c Capacity) check(mem, cpu int64, r sandbox.Resources) error {
	if c.MemoryOvercommit <= 0 && c.CPUOvercommit <= 0 && c.MinAvailable <= 0 {
		return nil
	}
	host := c.Host
	if host == nil {
		host = hostCapacity.get
	}
	total, avail, cpus, err := host()
	if err != nil {
		return nil // cannot tell: admit
	}
	full := func(format string, args ...any) error {
		return errdefs.New(errdefs.ErrUnavailable, "node full: "+format+": retry later or on another node", args...)
	}
	if c.MinAvailable > 0 && avail < c.MinAvailable {
		return full("the host has %d MiB of memory available, below the floor of %d MiB (serve --min-available)", avail>>20, c.MinAvailable>>20)
	}
	if c.MemoryOvercommit > 0 {
		limit := int64(c.MemoryOvercommit * float64(total))
		if satAdd(mem, r.MemoryBytes) > limit {
			return full("its running sandboxes' memory limits add up to %d MiB, and this one asks %d MiB, past %g × the host's %d MiB (serve --memory-overcommit)",
				mem>>20, r.MemoryBytes>>20, c.MemoryOvercommit, total>>20)
		}
	}
	if c.CPUOvercommit > 0 {
		limit := int64(c.CPUOvercommit * float64(cpus) * 1000)
		if satAdd(cpu, r.MilliCPU) > limit {
			return full("its running sandboxes' CPU limits add up to %.1f CPUs, and this one asks %.1f, past %g × the host's %d (serve --cpu-overcommit)",
				float64(cpu)/1000, float64(r.MilliCPU)/1000, c.CPUOvercommit, cpus)
		}
	}
	return nil
}

// hostCapacity is what admission reads of the host: HostCapacity at most
// every 50 ms. Every create asks, and /proc/meminfo costs 0.1 ms of CPU a
// read on a quiet host, several times that in a burst of creates (perf of
// `bench burst`: ~1% of a rollout's CPU); the floor on available memory
// is checked against a reading at most that old, while the sandboxes'
// limits are counted exactly on every create.
var hostCapacity = &hostCache{ttl: 50 * time.Millisecond, read: HostCapacity, now: time.Now}

// hostCache keeps the last HostCapacity reading for ttl.
type hostCache struct {
	ttl  time.Duration
	read func() (total, available int64, cpus int, err error)
	now  func() time.Time

	mu               sync.Mutex
	at               time.Time
	total, available int64
	cpus             int
}

func (h *hostCache) get() (total, available int64, cpus int, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.now()
	if !h.at.IsZero() && now.Sub(h.at) < h.ttl && now.Sub(h.at) >= 0 {
		return h.total, h.available, h.cpus, nil
	}
	if total, available, cpus, err = h.read(); err != nil {
		return 0, 0, 0, err // not kept: the next create reads again
	}
	h.at, h.total, h.available, h.cpus = now, total, available, cpus
	return total, available, cpus, nil
}

// HostCapacity reads MemTotal and MemAvailable from /proc/meminfo, and
// the CPUs this process may use.
func HostCapacity() (total, available int64, cpus int, err error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0, 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "MemTotal:":
			total = n << 10
		case "MemAvailable:":
			available = n << 10
		}
	}
	if total == 0 {
		return 0, 0, 0, fmt.Errorf("no MemTotal in /proc/meminfo")
	}
	return total, available, runtime.NumCPU(), nil
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

// NodeNofile is what RaiseHostLimits raises the node's own RLIMIT_NOFILE
// to (soft and hard, at most fs.nr_open): the node holds about three
// descriptors per sandbox (its agent log pipe and file, its user
// namespace) besides connections, so 3,200 sandboxes need ~10,000, past
// a shell's usual hard limit of 4,096.
const NodeNofile = 1 << 20

// raiseNofile raises the node's RLIMIT_NOFILE to NodeNofile (at most
// fs.nr_open); without CAP_SYS_RESOURCE, the soft limit to the hard one.
func raiseNofile(log *slog.Logger) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return
	}
	want := uint64(NodeNofile)
	if n, err := readSysctl("/proc/sys/fs/nr_open"); err == nil && n > 0 && uint64(n) < want {
		want = uint64(n)
	}
	if rl.Max < want {
		err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: want, Max: want})
		if err == nil {
			log.Info("raised the node's open files limit", "from", rl.Max, "to", want)
			return
		}
		log.Warn("cannot raise the node's open files limit: it holds about 3 per sandbox", "nofile", rl.Max, "want", want, "err", err)
	}
	if rl.Cur < min(rl.Max, want) {
		unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: min(rl.Max, want), Max: rl.Max})
	}
}

// RaiseHostLimits raises kernel.pid_max and fs.inotify.max_user_instances
// when they are below PidMax and InotifyInstances, and the node's own
// RLIMIT_NOFILE to NodeNofile, logging what it did or could not do. Run
// once at the start of serve.
func RaiseHostLimits(log *slog.Logger) {
	raiseNofile(log)
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
