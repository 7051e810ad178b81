package container

import (
	"fmt"
	"os"
	"slices"

	"github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/backend/container/seccompbpf"
)

// Seccomp, compiled once per node.
//
// runc compiles a container's seccomp profile with libseccomp and loads it
// in every `runc run`: for docker's profile that is ~25 ms of CPU per
// container, half of runc's cost. Instead the backend compiles docker's
// profile for docker's capability set (without the debugging system calls,
// see debugSyscalls) once, in New, to a BPF program
// (seccompbpf, with the semantics runc gives the profile, -ENOSYS for
// system calls newer than the profile included), keeps it in a sealed
// memfd, and hands that to every agent as a descriptor; the agent installs
// it on all its threads before it serves anything (agent.StartBoot), so
// every command runs under it. As in docker, the container runs without
// no_new_privs, so that setuid binaries (sudo, su) work for a sandbox's
// users; installing a filter then takes CAP_SYS_ADMIN, which the agent
// alone has until it has installed the filter: it then drops it from
// every set of every thread, bounding set included (agent.StartBoot, or the claim of a pooled agent),
// before it serves anything. A setuid binary gains docker's capabilities
// at most, under the same filter.
//
// A pooled container's agent installs the same program when it is claimed
// (after the root switch, which needs the mount system calls): commands in
// a pooled sandbox run under the same policy as in a cold one.

// dockerFilterProfile is docker's default seccomp profile for docker's
// capability set, without the debugging system calls (denyDebugging): what
// runc would load for a sandbox.
func dockerFilterProfile() (*specs.LinuxSeccomp, error) {
	s := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{
		Bounding: dockerCaps, Effective: dockerCaps, Permitted: dockerCaps,
	}}}
	p, err := seccomp.GetDefaultProfile(s)
	if err != nil {
		return nil, err
	}
	denyDebugging(p)
	guardInitSignals(p)
	return p, nil
}

// signalInfoSyscalls send a signal with a siginfo of the caller's making.
// A negative si_code (SI_QUEUE) is the sender's to choose, and the Go
// runtime takes a SIGSEGV, SIGBUS, SIGFPE or SIGILL whose si_code is not
// SI_USER for a fault of its own: queued to the agent (PID 1), it crashes
// it, and the sandbox with it, whatever the agent catches
// (agent.HandleSignals). kill(2), tgkill(2) and pidfd_send_signal(2)
// without a siginfo send SI_USER or SI_TKILL, which the agent drops.
var signalInfoSyscalls = []string{"rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal"}

// guardInitSignals takes signalInfoSyscalls out of p's rules and allows
// them again on conditions: rt_sigqueueinfo and rt_tgsigqueueinfo unless
// their target (the low 32 bits of the first argument, a pid_t) is 1, the
// agent; pidfd_send_signal only without a siginfo (its pidfd may name PID
// 1 from /proc/1). Otherwise EPERM, docker's default action.
func guardInitSignals(p *specs.LinuxSeccomp) {
	guarded := map[string]bool{}
	for _, n := range signalInfoSyscalls {
		guarded[n] = true
	}
	kept := p.Syscalls[:0]
	for _, sc := range p.Syscalls {
		var names []string
		for _, n := range sc.Names {
			if !guarded[n] {
				names = append(names, n)
			}
		}
		if len(names) == 0 {
			continue
		}
		sc.Names = names
		kept = append(kept, sc)
	}
	p.Syscalls = kept
	// pid & 0xffffffff != 1, as rules whose conditions are ANDed and
	// which are ORed: bit 0 clear, or any of bits 1-31 set.
	queue := []string{"rt_sigqueueinfo", "rt_tgsigqueueinfo"}
	p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: queue, Action: specs.ActAllow,
		Args: []specs.LinuxSeccompArg{{Index: 0, Value: 1, ValueTwo: 0, Op: specs.OpMaskedEqual}}})
	for bit := uint64(1); bit < 32; bit++ {
		p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: queue, Action: specs.ActAllow,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: 1 << bit, ValueTwo: 1 << bit, Op: specs.OpMaskedEqual}}})
	}
	p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: []string{"pidfd_send_signal"}, Action: specs.ActAllow,
		Args: []specs.LinuxSeccompArg{{Index: 2, Value: 0, Op: specs.OpEqualTo}}})
}

// debugSyscalls are the system calls that let one process look into or
// act inside another: docker's profile allows the first three (on kernels
// since 4.8, where seccomp can no longer be bypassed with ptrace), and the
// last two with CAP_SYS_PTRACE, which a sandbox never has.
//
// A sandbox denies them all (EPERM), to every process, agent included
// (which needs none of them): no process of a sandbox can trace or read
// another one, and above all not the agent, PID 1, whose answers (command
// output, exit codes) the node trusts. The agent is also non-dumpable
// (agent.SetNotDumpable), which alone keeps it out of reach; denying the
// calls keeps it so should that ever fail, at a price: gdb, strace, ltrace
// and other debuggers do not work inside a sandbox (see README, security).
var debugSyscalls = []string{"ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"}

// denyDebugging removes debugSyscalls from every rule of p and adds a rule
// denying them with EPERM, which is the default action of docker's profile
// (the compiler and runc skip such a rule, but it names the calls, so that
// they never fall into the -ENOSYS stub).
func denyDebugging(p *specs.LinuxSeccomp) {
	deny := map[string]bool{}
	for _, n := range debugSyscalls {
		deny[n] = true
	}
	kept := p.Syscalls[:0]
	for _, sc := range p.Syscalls {
		var names []string
		for _, n := range sc.Names {
			if !deny[n] {
				names = append(names, n)
			}
		}
		if len(names) == 0 {
			continue
		}
		sc.Names = names
		kept = append(kept, sc)
	}
	eperm := uint(unix.EPERM)
	p.Syscalls = append(kept, specs.LinuxSyscall{
		Names:    slices.Clone(debugSyscalls),
		Action:   specs.ActErrno,
		ErrnoRet: &eperm,
	})
}

// compileDockerFilter compiles docker's profile and returns it in a sealed
// memfd (read-only for everyone, forever) positioned at offset 0.
func compileDockerFilter() (seccompbpf.Program, *os.File, error) {
	profile, err := dockerFilterProfile()
	if err != nil {
		return nil, nil, fmt.Errorf("seccomp profile: %w", err)
	}
	prog, err := seccompbpf.Compile(profile)
	if err != nil {
		return nil, nil, fmt.Errorf("compile seccomp profile: %w", err)
	}
	f, err := sealedFile("shoal-seccomp", prog.Bytes())
	if err != nil {
		return nil, nil, fmt.Errorf("seccomp program: %w", err)
	}
	return prog, f, nil
}

// sealedFile returns a memfd holding data that nobody can change.
func sealedFile(name string, data []byte) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if _, err := f.Write(data); err != nil {
		f.Close()
		return nil, err
	}
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SEAL|unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE); err != nil {
		f.Close()
		return nil, fmt.Errorf("seal: %w", err)
	}
	if _, err := f.Seek(0, 0); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}
