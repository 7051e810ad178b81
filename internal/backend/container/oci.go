package container

import (
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// ociVersion is what we declare in config.json: the runtime-spec version of
// the types we use.
var ociVersion = specs.Version

// dockerCaps is docker's default capability set.
var dockerCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

// docker's default masked and read-only paths.
var (
	dockerMaskedPaths = []string{
		"/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys",
		"/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
		"/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
	}
	dockerReadonlyPaths = []string{
		"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
	}
)

const cpuPeriod = 100000 // µs

// baseEnv is every sandbox process's environment before Spec.Env.
var baseEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"HOME=/root",
	"TERM=xterm",
}

// Descriptors the agent inherits from runc (--preserve-fds): the listening
// socket, the seccomp filter (when the agent installs it), the ready pipe,
// and for a pool container the lifeline.
const (
	fdSocket  = 3
	fdSeccomp = 4
)

// ociSpec returns the runtime configuration of a sandbox whose overlay root
// is mounted at rootfs (the cold path: runc sets the container up around
// its final root).
func (b *Backend) ociSpec(spec sandbox.Spec, rootfs string, idmap *sandbox.IDMap) (*specs.Spec, error) {
	return b.containerSpec(containerOptions{
		runcID:   spec.ID,
		rootfs:   rootfs,
		hostname: hostname(spec.ID),
		env:      sandboxEnv(spec),
		res:      spec.Resources,
		agent:    spec.AgentBinary,
		caps:     dockerCaps,
		idmap:    idmap,
	})
}

// sandboxEnv is the environment of a sandbox's processes. The variables of
// the agent's start-up contract are not the caller's to set.
func sandboxEnv(spec sandbox.Spec) []string {
	env := make([]string, 0, len(spec.Env))
	for _, kv := range spec.Env {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "SHOAL_AGENT_FD", agent.EnvSeccompFD, agent.EnvReadyFD, agent.EnvPool, agent.EnvLifeline, agent.EnvBestEffort:
			continue
		}
		env = append(env, kv)
	}
	return mergeEnv(baseEnv, env, []string{"SHOAL_SANDBOX_ID=" + spec.ID})
}

// containerOptions are what differs between a sandbox's container and a
// pool container.
type containerOptions struct {
	runcID   string
	rootfs   string
	hostname string
	env      []string // without the SHOAL_*_FD variables
	res      sandbox.Resources
	agent    string
	caps     []string
	pooled   bool // a blank pool container (SHOAL_POOL=1)
	urgent   bool // pooled, started while creates wait: normal CPU weight
	// idmap, if not nil: a user namespace mapping the container's ids
	// 0..Size-1 to this host range (userns.go).
	idmap *sandbox.IDMap
}

// readyFD is the ready pipe's descriptor number in the agent.
func (b *Backend) readyFD() int {
	if b.filter != nil {
		return fdSeccomp + 1
	}
	return fdSeccomp
}

func (b *Backend) containerSpec(o containerOptions) (*specs.Spec, error) {
	mem := o.res.MemoryBytes
	if mem == 0 {
		mem = DefaultMemoryBytes
	}
	pids := o.res.Pids
	if pids == 0 {
		pids = DefaultPids
	}
	if mem < 0 || pids < 0 || o.res.MilliCPU < 0 {
		return nil, fmt.Errorf("negative resource limit %+v", o.res)
	}
	res := &specs.LinuxResources{
		// Deny every device; runc allows its default /dev nodes back.
		Devices: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}},
		// Swap limit = memory limit: memory+swap may not exceed the limit.
		Memory: &specs.LinuxMemory{Limit: &mem, Swap: &mem},
		Pids:   &specs.LinuxPids{Limit: &pids},
	}
	if m := o.res.MilliCPU; m > 0 {
		quota, period := m*cpuPeriod/1000, uint64(cpuPeriod)
		res.CPU = &specs.LinuxCPU{Quota: &quota, Period: &period}
	}
	if o.res.BestEffort {
		shares := uint64(beCPUShares)
		if res.CPU == nil {
			res.CPU = &specs.LinuxCPU{}
		}
		res.CPU.Shares = &shares
	}
	if o.pooled && !o.urgent {
		// A pool container starts at the lowest CPU weight, so that filling
		// the pool yields to the sandboxes (and claims) that run; the claim
		// restores the default weight (setLimits).
		shares := uint64(poolCPUShares)
		res.CPU = &specs.LinuxCPU{Shares: &shares}
	}

	nofile, err := nofileLimit(b.nofile)
	if err != nil {
		return nil, err
	}
	fdEnv := []string{
		"SHOAL_AGENT_FD=" + strconv.Itoa(fdSocket),
		agent.EnvReadyFD + "=" + strconv.Itoa(b.readyFD()),
	}
	if b.filter != nil {
		fdEnv = append(fdEnv, agent.EnvSeccompFD+"="+strconv.Itoa(fdSeccomp))
	}
	if o.res.BestEffort && !o.pooled {
		fdEnv = append(fdEnv, agent.EnvBestEffort+"=1")
	}
	if o.pooled {
		fdEnv = append(fdEnv, agent.EnvPool+"=1")
		if b.lifeline != nil {
			fdEnv = append(fdEnv, agent.EnvLifeline+"="+strconv.Itoa(b.readyFD()+1))
		}
	}
	agentCopy := o.agent
	if o.agent != "" { // "": a spec made to be looked at (tests)
		if agentCopy, err = b.agents.path(o.agent); err != nil {
			return nil, err
		}
	}
	s := &specs.Spec{
		Version: ociVersion,
		Root:    &specs.Root{Path: o.rootfs},
		Process: &specs.Process{
			Args: []string{agentPath},
			Env:  mergeEnv(o.env, fdEnv),
			Cwd:  "/",
			User: specs.User{UID: 0, GID: 0},
			Capabilities: &specs.LinuxCapabilities{
				Bounding:  o.caps,
				Effective: o.caps,
				Permitted: o.caps,
			},
			Rlimits: []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: nofile, Soft: nofile}},
		},
		Hostname: o.hostname,
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup", Options: []string{"nosuid", "noexec", "nodev", "relatime", "ro"}},
			// The agent: one binary shared (page cache and all) by every
			// sandbox, bound from the backend's private copy (agentcopy.go).
			{Destination: agentPath, Type: "bind", Source: agentCopy, Options: []string{"bind", "ro", "nosuid", "nodev"}},
		},
		Linux: &specs.Linux{
			CgroupsPath: b.cgroupPath(o.runcID),
			Resources:   res,
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace},
				{Type: specs.MountNamespace},
				{Type: specs.IPCNamespace},
				{Type: specs.UTSNamespace},
				// A new network namespace: runc brings up lo, nothing else.
				{Type: specs.NetworkNamespace},
				{Type: specs.CgroupNamespace},
			},
			MaskedPaths:   dockerMaskedPaths,
			ReadonlyPaths: dockerReadonlyPaths,
		},
	}
	if m := o.idmap; m != nil {
		s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
		s.Linux.UIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: m.HostUID, Size: m.Size}}
		s.Linux.GIDMappings = []specs.LinuxIDMapping{{ContainerID: 0, HostID: m.HostGID, Size: m.Size}}
	}
	if b.filter != nil {
		// The agent installs the node's precompiled filter on itself
		// (seccomp.go). Without no_new_privs (which would keep setuid
		// binaries such as sudo from working, unlike docker) that takes
		// CAP_SYS_ADMIN: the agent starts with it and drops it from all
		// its sets, the bounding set included, right after installing the
		// filter and before it serves anything (agent.StartBoot; a pooled
		// agent on claim). No command ever has it, and a setuid binary
		// gains docker's capabilities at most.
		if !slices.Contains(s.Process.Capabilities.Bounding, "CAP_SYS_ADMIN") {
			caps := append(slices.Clone(o.caps), "CAP_SYS_ADMIN")
			s.Process.Capabilities = &specs.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps}
		}
		return s, nil
	}
	// runc compiles and loads the profile. It depends on the capabilities:
	// set them first.
	sc, err := seccomp.GetDefaultProfile(s)
	if err != nil {
		return nil, fmt.Errorf("seccomp profile: %w", err)
	}
	denyDebugging(sc) // as the compiled filter does (seccomp.go)
	guardInitSignals(sc)
	s.Linux.Seccomp = sc
	return s, nil
}

// cgroupPath is the sandbox's cgroup, absolute so that runc takes it from
// the root of each hierarchy rather than from its own cgroup.
func (b *Backend) cgroupPath(id string) string {
	return "/" + path.Join(b.cgroupParent, id)
}

// nofileLimit is the NOFILE limit of sandbox processes: want (the
// backend's Config.Nofile, else DefaultNofile), or our own hard limit if
// lower (without CAP_SYS_RESOURCE, asking for more fails). It bounds each
// process; the kernel memory of a sandbox's open files is charged to its
// memory cgroup.
func nofileLimit(want uint64) (uint64, error) {
	if want == 0 {
		want = DefaultNofile
	}
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 0, fmt.Errorf("get NOFILE limit: %w", err)
	}
	return min(want, rl.Max), nil
}

// hostname derives a valid host name (RFC 1123 label) from a sandbox ID.
func hostname(id string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(id) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			b.WriteByte('-')
		}
	}
	h := b.String()
	if len(h) > 63 {
		h = h[:63]
	}
	if h = strings.Trim(h, "-"); h == "" {
		return "sandbox"
	}
	return h
}

// mergeEnv concatenates KEY=value lists; a later KEY replaces an earlier
// one in place, so each KEY appears once.
func mergeEnv(lists ...[]string) []string {
	var out []string
	index := map[string]int{}
	for _, l := range lists {
		for _, kv := range l {
			k, _, _ := strings.Cut(kv, "=")
			if i, ok := index[k]; ok {
				out[i] = kv
				continue
			}
			index[k] = len(out)
			out = append(out, kv)
		}
	}
	return out
}
