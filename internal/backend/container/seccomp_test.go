package container

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"
	"unsafe"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/backend/container/seccompbpf"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// dumpFilters returns the seccomp filters of a process, newest first, as
// the kernel holds them (PTRACE_SECCOMP_GET_FILTER: the tracer must be
// privileged and the tracee stopped).
func dumpFilters(t *testing.T, pid int) []seccompbpf.Program {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.PtraceAttach(pid); err != nil {
		t.Fatalf("ptrace attach %d: %v", pid, err)
	}
	defer unix.PtraceDetach(pid)
	var ws unix.WaitStatus
	if _, err := unix.Wait4(pid, &ws, unix.WALL, nil); err != nil {
		t.Fatalf("wait for %d to stop: %v", pid, err)
	}
	const ptraceSeccompGetFilter = 0x420c
	var out []seccompbpf.Program
	for i := 0; ; i++ {
		n, _, e := unix.Syscall6(unix.SYS_PTRACE, ptraceSeccompGetFilter, uintptr(pid), uintptr(i), 0, 0, 0)
		if e == unix.ENOENT {
			return out
		}
		if e != 0 {
			t.Fatalf("PTRACE_SECCOMP_GET_FILTER %d: %v", i, e)
		}
		prog := make(seccompbpf.Program, n)
		if _, _, e := unix.Syscall6(unix.SYS_PTRACE, ptraceSeccompGetFilter, uintptr(pid), uintptr(i), uintptr(unsafe.Pointer(&prog[0])), 0, 0); e != 0 {
			t.Fatalf("PTRACE_SECCOMP_GET_FILTER %d: %v", i, e)
		}
		out = append(out, prog)
	}
}

// TestSeccompSameAsRunc compares, system call by system call, the filter
// the agent installs (the node's compiled program) with the one runc 1.1 +
// libseccomp install for the same docker profile, both read back from the
// kernel, on every system call number of the three x86 ABIs and argument
// values that cross every condition of the profile. They agree except
// where libseccomp does not know a system call that docker's profile
// allows: runc then drops the rule, and its -ENOSYS stub or the default
// answers; the compiled program allows it, as docker's profile says.
func TestSeccompSameAsRunc(t *testing.T) {
	requireRoot(t)
	ours := newBackend(t)
	if ours.filter == nil {
		t.Fatal("no compiled filter")
	}
	byRunc, err := New(Config{StateDir: t.TempDir(), CgroupParent: testCgroupParent, RuncSeccomp: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(byRunc.agents.close) // the agent binary's tmpfs (agentcopy.go)
	if byRunc.filter != nil {
		t.Fatal("RuncSeccomp backend has a compiled filter")
	}
	pooled := newPoolBackend(t, t.TempDir(), 1)
	waitPool(t, pooled, 1)

	sandboxFilters := func(b *Backend, spec sandbox.Spec) []seccompbpf.Program {
		t.Helper()
		h := create(t, b, spec)
		return dumpFilters(t, initPidOf(t, b, h))
	}
	got := sandboxFilters(ours, newSpec(t))
	gotPooled := sandboxFilters(pooled, poolSpec(t))
	want := sandboxFilters(byRunc, newSpec(t))
	if len(got) != 1 || len(gotPooled) != 1 || len(want) != 1 {
		t.Fatalf("filters installed: agent %d, pooled agent %d, runc %d; want 1 each", len(got), len(gotPooled), len(want))
	}
	if !slices.Equal(got[0], ours.filterProg) || !slices.Equal(gotPooled[0], ours.filterProg) {
		t.Fatal("the agent's filter is not the node's compiled program")
	}
	t.Logf("compiled program: %d instructions; runc's: %d", len(got[0]), len(want[0]))

	profile, err := dockerFilterProfile()
	if err != nil {
		t.Fatal(err)
	}
	allowedByProfile := map[string]bool{}
	for _, sc := range profile.Syscalls {
		if sc.Action == specs.ActAllow && len(sc.Args) == 0 {
			for _, n := range sc.Names {
				allowedByProfile[n] = true
			}
		}
	}
	nameOf := func(arch specs.Arch, nr uint32) string {
		for _, n := range allNames() {
			if v, ok := seccompbpf.Resolve(arch, n); ok && v == nr {
				return n
			}
		}
		return ""
	}
	vectors := testArgVectors()
	type abi struct {
		arch  specs.Arch
		audit uint32
		base  uint32
	}
	enosys := seccompbpf.RetErrno | uint32(unix.ENOSYS)
	var notes []string
	checked := 0
	for _, a := range []abi{{specs.ArchX86_64, seccompbpf.AuditArchX86_64, 0}, {specs.ArchX32, seccompbpf.AuditArchX86_64, seccompbpf.X32Bit}, {specs.ArchX86, seccompbpf.AuditArchI386, 0}} {
		verdict := func(p seccompbpf.Program, d seccompbpf.Data) uint32 {
			v, err := seccompbpf.Run(p, d)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
		// runc's -ENOSYS stub starts above the highest number it could
		// resolve, lower than ours when libseccomp is older than the profile.
		runcLast := a.base
		for nr := a.base; nr < a.base+1024; nr++ {
			if verdict(want[0], seccompbpf.Data{Nr: nr, Arch: a.audit}) != enosys {
				runcLast = nr
			}
		}
		var unknownToRunc []string
		for nr := a.base; nr < a.base+1024; nr++ {
			for _, args := range vectors {
				d := seccompbpf.Data{Nr: nr, Arch: a.audit, Args: args}
				g, w := verdict(got[0], d), verdict(want[0], d)
				checked++
				if g == w {
					continue
				}
				name := nameOf(a.arch, nr)
				// Allowed by the profile, unknown to runc's libseccomp: runc
				// dropped the rule (EPERM, or ENOSYS above its last).
				if g == seccompbpf.RetAllow && allowedByProfile[name] && (w == enosys || w == seccompbpf.RetErrno|uint32(unix.EPERM)) {
					if !slices.Contains(unknownToRunc, name) {
						unknownToRunc = append(unknownToRunc, name)
					}
					continue
				}
				// Not in the profile, above runc's last known number.
				if nr > runcLast && w == enosys && g == seccompbpf.RetErrno|uint32(unix.EPERM) {
					continue
				}
				t.Fatalf("%s %s (%d) args %#x: compiled %#x, runc %#x", a.arch, name, nr-a.base, args, g, w)
			}
		}
		notes = append(notes, fmt.Sprintf("%s: runc's -ENOSYS from %d on; allowed by docker's profile but unknown to runc's libseccomp: %s",
			a.arch, runcLast-a.base+1, strings.Join(unknownToRunc, " ")))
	}
	t.Logf("%d cases compared", checked)
	for _, n := range notes {
		t.Log(n)
	}
}

// initPidOf reads the init pid of a sandbox: from the sandbox dir for a cold
// one, from its pool container's dir for a pooled one.
func initPidOf(t *testing.T, b *Backend, h sandbox.Handle) int {
	t.Helper()
	dir := h.Data["dir"]
	if h.Data["pooled"] == "true" {
		dir = b.claimedDir(h.ID)
	}
	return initPid(t, sandbox.Spec{Dir: dir})
}

func allNames() []string {
	prof, _ := dockerFilterProfile()
	var names []string
	for _, sc := range prof.Syscalls {
		names = append(names, sc.Names...)
	}
	return names
}

// testArgVectors cross the conditions of docker's profile (clone flags,
// personality values, socket domains) plus some noise.
func testArgVectors() [][6]uint64 {
	ns := uint64(unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWCGROUP)
	vals := []uint64{0, 1, 8, 0x20000, 0x20008, 0xffffffff, 1 << 32, 0x400000, uint64(unix.SIGCHLD),
		uint64(unix.SIGCHLD) | unix.CLONE_NEWUSER, unix.CLONE_NEWNS, unix.CLONE_NEWTIME, ns, 1<<40 | uint64(unix.SIGCHLD)}
	for af := uint64(0); af <= 48; af++ {
		vals = append(vals, af)
	}
	var out [][6]uint64
	for _, v := range vals {
		out = append(out, [6]uint64{v})
	}
	r := rand.New(rand.NewPCG(3, 4))
	for range 4 {
		var a [6]uint64
		for i := range a {
			a[i] = r.Uint64() >> (r.IntN(4) * 16)
		}
		out = append(out, a)
	}
	return out
}

// TestSeccompFailsClosed: an agent that cannot install its filter does not
// serve; the create fails and leaves nothing behind.
func TestSeccompFailsClosed(t *testing.T) {
	requireRoot(t)
	for _, tc := range []struct {
		name string
		prog []byte
		want string
	}{
		{"truncated", []byte{1, 2, 3, 4, 5, 6, 7}, "seccomp filter of 7 bytes"},
		// One load and no return: the kernel refuses the program.
		{"rejected by the kernel", seccompbpf.Program{{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0}}.Bytes(), "install seccomp filter"},
	} {
		for _, agentBin := range []string{agentBinary, realAgent} {
			t.Run(tc.name+" "+agentBin[strings.LastIndexByte(agentBin, '/')+1:], func(t *testing.T) {
				b := newBackend(t)
				f, err := sealedFile("bad-seccomp", tc.prog)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				b.filter = f
				spec := newSpec(t)
				spec.AgentBinary = agentBin
				_, err = b.Create(createCtx(t), spec)
				if err == nil {
					t.Fatal("Create succeeded")
				}
				if !strings.Contains(err.Error(), tc.want) {
					t.Errorf("error %q does not mention %q", err, tc.want)
				}
				if left := leftovers(t, b, spec); len(left) > 0 {
					t.Errorf("left after a failed Create: %v", left)
				}
			})
		}
	}
}

// TestFilterDeniesDebugging: the compiled filter (and the profile runc
// would load) deny the system calls that reach into another process, on
// every x86 ABI.
func TestFilterDeniesDebugging(t *testing.T) {
	prog, f, err := compileDockerFilter()
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	eperm := seccompbpf.RetErrno | uint32(unix.EPERM)
	for _, a := range []struct {
		arch  specs.Arch
		audit uint32
	}{{specs.ArchX86_64, seccompbpf.AuditArchX86_64}, {specs.ArchX32, seccompbpf.AuditArchX86_64}, {specs.ArchX86, seccompbpf.AuditArchI386}} {
		for _, name := range debugSyscalls {
			nr, ok := seccompbpf.Resolve(a.arch, name)
			if !ok {
				continue
			}
			if v, err := seccompbpf.Run(prog, seccompbpf.Data{Nr: nr, Arch: a.audit}); err != nil || v != eperm {
				t.Errorf("%s (%s): verdict %#x %v, want EPERM", name, a.arch, v, err)
			}
		}
		// Still allowed: what they are not.
		for _, name := range []string{"getpid", "wait4", "pidfd_open", "pidfd_send_signal"} {
			nr, ok := seccompbpf.Resolve(a.arch, name)
			if !ok {
				continue
			}
			if v, err := seccompbpf.Run(prog, seccompbpf.Data{Nr: nr, Arch: a.audit}); err != nil || v != seccompbpf.RetAllow {
				t.Errorf("%s (%s): verdict %#x %v, want allow", name, a.arch, v, err)
			}
		}
	}
	// Signals with a siginfo of the caller's making: not to PID 1 (the low
	// 32 bits of the pid, as the kernel reads it), nor through a pidfd.
	for _, c := range []struct {
		name string
		args [6]uint64
		want uint32
	}{
		{"rt_sigqueueinfo", [6]uint64{1, 11}, eperm},
		{"rt_sigqueueinfo", [6]uint64{1 | 1<<32, 11}, eperm},
		{"rt_sigqueueinfo", [6]uint64{0xffffffff00000001, 11}, eperm},
		{"rt_tgsigqueueinfo", [6]uint64{1, 1, 11}, eperm},
		{"rt_sigqueueinfo", [6]uint64{2, 11}, seccompbpf.RetAllow},
		{"rt_sigqueueinfo", [6]uint64{0, 11}, seccompbpf.RetAllow},
		{"rt_sigqueueinfo", [6]uint64{3, 11}, seccompbpf.RetAllow},
		{"rt_sigqueueinfo", [6]uint64{0x80000001, 11}, seccompbpf.RetAllow},
		{"rt_tgsigqueueinfo", [6]uint64{7, 7, 11}, seccompbpf.RetAllow},
		{"pidfd_send_signal", [6]uint64{3, 11, 0x7fff0000}, eperm},
		{"pidfd_send_signal", [6]uint64{3, 11, 0}, seccompbpf.RetAllow},
	} {
		nr, _ := seccompbpf.Resolve(specs.ArchX86_64, c.name)
		if v, err := seccompbpf.Run(prog, seccompbpf.Data{Nr: nr, Arch: seccompbpf.AuditArchX86_64, Args: c.args}); err != nil || v != c.want {
			t.Errorf("%s%v: verdict %#x %v, want %#x", c.name, c.args[:3], v, err, c.want)
		}
	}
	// The profile runc loads with RuncSeccomp.
	b := &Backend{}
	s, err := b.containerSpec(containerOptions{runcID: "x", rootfs: "/", caps: dockerCaps})
	if err != nil {
		t.Fatal(err)
	}
	for _, sc := range s.Linux.Seccomp.Syscalls {
		for _, n := range sc.Names {
			for _, d := range debugSyscalls {
				if n == d && sc.Action != specs.ActErrno {
					t.Errorf("runc's profile: %s has action %s", n, sc.Action)
				}
			}
		}
	}
}
