package seccompbpf

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// dockerCaps is docker's default capability set (as in the container
// backend), which decides what docker's profile allows.
var dockerCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

func dockerProfile(t testing.TB, caps []string) *specs.LinuxSeccomp {
	t.Helper()
	s := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: caps}}}
	p, err := seccomp.GetDefaultProfile(s)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// seccompData is the kernel's struct seccomp_data.
type seccompData struct {
	nr, arch uint32
	ip       uint64
	args     [6]uint64
}

// run interprets a program with Run and checks that it only uses the
// instructions Compile emits.
func run(t testing.TB, p Program, d seccompData) uint32 {
	t.Helper()
	for pc, in := range p {
		switch in.Code {
		case unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, unix.BPF_ALU | unix.BPF_AND | unix.BPF_K, unix.BPF_RET | unix.BPF_K,
			unix.BPF_JMP | unix.BPF_JA, unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K, unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K:
		default:
			t.Fatalf("pc %d: unexpected instruction %#x", pc, in.Code)
		}
	}
	v, err := Run(p, Data{Nr: d.nr, Arch: d.arch, IP: d.ip, Args: d.args})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// reference evaluates cfg for one system call directly from the OCI rules,
// with runc's semantics (see the package comment). It shares nothing with
// the compiler but the tables and Action.
func reference(t testing.TB, cfg *specs.LinuxSeccomp, arch specs.Arch, d seccompData) uint32 {
	t.Helper()
	def, err := Action(cfg.DefaultAction, cfg.DefaultErrnoRet)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(cfg.Architectures, arch) {
		return badArch
	}
	var last uint32
	var named bool
	var names []string
	for _, sc := range cfg.Syscalls {
		for _, n := range sc.Names {
			if nr, ok := Resolve(arch, n); ok {
				if !named || nr > last {
					last, named = nr, true
				}
				if nr == d.nr {
					names = append(names, n)
				}
			}
		}
	}
	if named && d.nr > last {
		return RetErrno | uint32(unix.ENOSYS)
	}
	width := 64
	if arch == specs.ArchX86 || arch == specs.ArchX32 {
		width = 32
	}
	holds := func(c specs.LinuxSeccompArg) bool {
		v, val, two := d.args[c.Index], c.Value, c.ValueTwo
		if width == 32 {
			v, val, two = uint64(uint32(v)), uint64(uint32(val)), uint64(uint32(two))
		}
		switch c.Op {
		case specs.OpEqualTo:
			return v == val
		case specs.OpNotEqual:
			return v != val
		case specs.OpLessThan:
			return v < val
		case specs.OpLessEqual:
			return v <= val
		case specs.OpGreaterThan:
			return v > val
		case specs.OpGreaterEqual:
			return v >= val
		case specs.OpMaskedEqual:
			return v&val == two
		}
		t.Fatalf("operator %s", c.Op)
		return false
	}
	for _, sc := range cfg.Syscalls {
		if !slices.ContainsFunc(sc.Names, func(n string) bool { return slices.Contains(names, n) }) {
			continue
		}
		act, err := Action(sc.Action, sc.ErrnoRet)
		if err != nil {
			t.Fatal(err)
		}
		if act == def {
			continue
		}
		idx := map[uint]int{}
		for _, c := range sc.Args {
			idx[c.Index]++
		}
		dup := false
		for _, n := range idx {
			dup = dup || n > 1
		}
		match := true
		if dup {
			match = slices.ContainsFunc(sc.Args, holds)
		} else {
			for _, c := range sc.Args {
				match = match && holds(c)
			}
		}
		if match {
			return act
		}
	}
	return def
}

var archOf = map[specs.Arch]uint32{specs.ArchX86_64: AuditArchX86_64, specs.ArchX32: AuditArchX86_64, specs.ArchX86: AuditArchI386}

// argVectors are the argument sets every system call is tried with: they
// hit each boundary of docker's conditions (clone flags, personality,
// socket domains) and some noise.
func argVectors() [][6]uint64 {
	ns := uint64(unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWCGROUP)
	vals := []uint64{0, 1, 8, 0x20000, 0x20008, 0xffffffff, 0x1ffffffff, 1 << 32, 0x400000,
		uint64(unix.SIGCHLD), uint64(unix.SIGCHLD) | unix.CLONE_NEWUSER, unix.CLONE_NEWNS, unix.CLONE_NEWCGROUP,
		unix.CLONE_NEWTIME, ns, ns | 1<<40, 1<<40 | uint64(unix.SIGCHLD), ^uint64(0)}
	for af := uint64(0); af <= 50; af++ {
		vals = append(vals, af, af|1<<32)
	}
	var out [][6]uint64
	for _, v := range vals {
		out = append(out, [6]uint64{v}, [6]uint64{1, v})
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 8 {
		var a [6]uint64
		for i := range a {
			a[i] = r.Uint64() >> (r.IntN(4) * 16)
		}
		out = append(out, a)
	}
	return out
}

// TestMatchesReference compiles docker's profile (for docker's capability
// set, and with CAP_SYS_ADMIN added) and compares the program with the
// reference evaluation on every system call number of every ABI, with
// argument sets that cross each condition's boundaries.
func TestMatchesReference(t *testing.T) {
	for _, tc := range []struct {
		name string
		caps []string
	}{
		{"docker caps", dockerCaps},
		{"docker caps + SYS_ADMIN", append(slices.Clone(dockerCaps), "CAP_SYS_ADMIN")},
		{"all caps", append(slices.Clone(dockerCaps), "CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_SYS_NICE", "CAP_BPF", "CAP_PERFMON", "CAP_SYS_TIME", "CAP_DAC_READ_SEARCH", "CAP_SYSLOG")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := dockerProfile(t, tc.caps)
			prog, err := Compile(cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d instructions", len(prog))
			vectors := argVectors()
			// Numbers with conditional rules get every argument vector;
			// the others (whose result cannot depend on arguments) two.
			conditional := map[uint32]bool{}
			for _, sc := range cfg.Syscalls {
				if len(sc.Args) == 0 {
					continue
				}
				for _, n := range sc.Names {
					for _, arch := range []specs.Arch{specs.ArchX86_64, specs.ArchX32, specs.ArchX86} {
						if nr, ok := Resolve(arch, n); ok {
							conditional[nr] = true
						}
					}
				}
			}
			checked := 0
			for _, arch := range []specs.Arch{specs.ArchX86_64, specs.ArchX32, specs.ArchX86} {
				var base uint32
				if arch == specs.ArchX32 {
					base = X32Bit
				}
				nrs := []uint32{0xffffffff, 0xfffffffe, 0x7fffffff, 0x80000000, X32Bit - 1, X32Bit, 4096, 100000}
				for nr := uint32(0); nr < 700; nr++ {
					nrs = append(nrs, base+nr)
				}
				for _, nr := range nrs {
					vs := vectors[len(vectors)-2:]
					if conditional[nr] {
						vs = vectors
					}
					for _, args := range vs {
						d := seccompData{nr: nr, arch: archOf[arch], args: args}
						refArch := arch
						// Above the x32 bit, an x86_64 number is an x32 one.
						if arch == specs.ArchX86_64 && nr >= X32Bit {
							refArch = specs.ArchX32
						}
						if arch == specs.ArchX32 && nr < X32Bit {
							refArch = specs.ArchX86_64
						}
						got, want := run(t, prog, d), reference(t, cfg, refArch, d)
						if got != want {
							t.Fatalf("%s nr %#x args %#x: program says %#x, reference %#x", arch, nr, args, got, want)
						}
						checked++
					}
				}
			}
			t.Logf("%d cases agree", checked)
		})
	}
}

// TestDockerPolicy spells out what docker's profile means for a sandbox
// with docker's capabilities, on x86_64 and i386.
func TestDockerPolicy(t *testing.T) {
	prog, err := Compile(dockerProfile(t, dockerCaps))
	if err != nil {
		t.Fatal(err)
	}
	const (
		allow  = RetAllow
		eperm  = RetErrno | uint32(unix.EPERM)
		enosys = RetErrno | uint32(unix.ENOSYS)
	)
	sigchld := uint64(unix.SIGCHLD)
	for _, tc := range []struct {
		name string
		arch uint32
		nr   uint32
		args [6]uint64
		want uint32
	}{
		{"read", AuditArchX86_64, unix.SYS_READ, [6]uint64{}, allow},
		{"fork-like clone", AuditArchX86_64, unix.SYS_CLONE, [6]uint64{sigchld}, allow},
		{"thread clone", AuditArchX86_64, unix.SYS_CLONE, [6]uint64{unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND | unix.CLONE_THREAD}, allow},
		{"clone CLONE_NEWUSER", AuditArchX86_64, unix.SYS_CLONE, [6]uint64{unix.CLONE_NEWUSER | sigchld}, eperm},
		{"clone CLONE_NEWNS", AuditArchX86_64, unix.SYS_CLONE, [6]uint64{unix.CLONE_NEWNS}, eperm},
		{"clone CLONE_NEWNET", AuditArchX86_64, unix.SYS_CLONE, [6]uint64{unix.CLONE_NEWNET}, eperm},
		{"clone3 (libc falls back to clone)", AuditArchX86_64, unix.SYS_CLONE3, [6]uint64{}, enosys},
		{"unshare", AuditArchX86_64, unix.SYS_UNSHARE, [6]uint64{unix.CLONE_NEWUSER}, eperm},
		{"unshare nothing", AuditArchX86_64, unix.SYS_UNSHARE, [6]uint64{}, eperm},
		{"setns", AuditArchX86_64, unix.SYS_SETNS, [6]uint64{}, eperm},
		{"mount", AuditArchX86_64, unix.SYS_MOUNT, [6]uint64{}, eperm},
		{"umount2", AuditArchX86_64, unix.SYS_UMOUNT2, [6]uint64{}, eperm},
		{"pivot_root", AuditArchX86_64, unix.SYS_PIVOT_ROOT, [6]uint64{}, eperm},
		{"move_mount", AuditArchX86_64, unix.SYS_MOVE_MOUNT, [6]uint64{}, eperm},
		{"fsopen", AuditArchX86_64, unix.SYS_FSOPEN, [6]uint64{}, eperm},
		{"sethostname", AuditArchX86_64, unix.SYS_SETHOSTNAME, [6]uint64{}, eperm},
		{"keyctl", AuditArchX86_64, unix.SYS_KEYCTL, [6]uint64{}, eperm},
		{"add_key", AuditArchX86_64, unix.SYS_ADD_KEY, [6]uint64{}, eperm},
		{"bpf", AuditArchX86_64, unix.SYS_BPF, [6]uint64{}, eperm},
		{"perf_event_open", AuditArchX86_64, unix.SYS_PERF_EVENT_OPEN, [6]uint64{}, eperm},
		{"io_uring_setup", AuditArchX86_64, unix.SYS_IO_URING_SETUP, [6]uint64{}, eperm},
		{"kexec_load", AuditArchX86_64, unix.SYS_KEXEC_LOAD, [6]uint64{}, eperm},
		{"init_module", AuditArchX86_64, unix.SYS_INIT_MODULE, [6]uint64{}, eperm},
		{"reboot", AuditArchX86_64, unix.SYS_REBOOT, [6]uint64{}, eperm},
		{"open_by_handle_at", AuditArchX86_64, unix.SYS_OPEN_BY_HANDLE_AT, [6]uint64{}, eperm},
		{"ptrace (kernel >= 4.8)", AuditArchX86_64, unix.SYS_PTRACE, [6]uint64{}, allow},
		{"process_vm_readv", AuditArchX86_64, unix.SYS_PROCESS_VM_READV, [6]uint64{}, allow},
		{"chroot (CAP_SYS_CHROOT)", AuditArchX86_64, unix.SYS_CHROOT, [6]uint64{}, allow},
		{"personality 0", AuditArchX86_64, unix.SYS_PERSONALITY, [6]uint64{0}, allow},
		{"personality query", AuditArchX86_64, unix.SYS_PERSONALITY, [6]uint64{0xffffffff}, allow},
		{"personality LINUX32", AuditArchX86_64, unix.SYS_PERSONALITY, [6]uint64{8}, allow},
		{"personality ADDR_NO_RANDOMIZE", AuditArchX86_64, unix.SYS_PERSONALITY, [6]uint64{0x0040000}, eperm},
		{"socket AF_UNIX", AuditArchX86_64, unix.SYS_SOCKET, [6]uint64{unix.AF_UNIX}, allow},
		{"socket AF_INET", AuditArchX86_64, unix.SYS_SOCKET, [6]uint64{unix.AF_INET}, allow},
		{"socket AF_NETLINK", AuditArchX86_64, unix.SYS_SOCKET, [6]uint64{unix.AF_NETLINK}, allow},
		{"socket AF_VSOCK", AuditArchX86_64, unix.SYS_SOCKET, [6]uint64{unix.AF_VSOCK}, eperm},
		{"socket AF_ALG", AuditArchX86_64, unix.SYS_SOCKET, [6]uint64{unix.AF_ALG}, eperm},
		{"socket AF_INET high bits", AuditArchX86_64, unix.SYS_SOCKET, [6]uint64{1<<32 | unix.AF_INET}, eperm},
		{"arch_prctl", AuditArchX86_64, unix.SYS_ARCH_PRCTL, [6]uint64{}, allow},
		{"seccomp", AuditArchX86_64, unix.SYS_SECCOMP, [6]uint64{}, allow},
		{"fchmodat2", AuditArchX86_64, 452, [6]uint64{}, allow},
		{"unassigned 400", AuditArchX86_64, 400, [6]uint64{}, eperm},
		{"newer than the profile", AuditArchX86_64, 1000, [6]uint64{}, enosys},
		{"nr -1", AuditArchX86_64, 0xffffffff, [6]uint64{}, enosys},
		{"i386 read", AuditArchI386, 3, [6]uint64{}, allow},
		{"i386 socketcall", AuditArchI386, 102, [6]uint64{}, allow},
		{"i386 unshare", AuditArchI386, 310, [6]uint64{}, eperm},
		{"i386 clone CLONE_NEWUSER", AuditArchI386, 120, [6]uint64{unix.CLONE_NEWUSER}, eperm},
		{"i386 clone", AuditArchI386, 120, [6]uint64{sigchld}, allow},
		{"i386 socket AF_VSOCK", AuditArchI386, 359, [6]uint64{unix.AF_VSOCK}, eperm},
		{"x32 rt_sigaction", AuditArchX86_64, X32Bit + 512, [6]uint64{}, allow},
		{"x32 unshare", AuditArchX86_64, X32Bit + unix.SYS_UNSHARE, [6]uint64{}, eperm},
		{"x32 kexec_load", AuditArchX86_64, X32Bit + 528, [6]uint64{}, eperm},
		{"x32 beyond", AuditArchX86_64, X32Bit + 600, [6]uint64{}, enosys},
		{"unknown arch", 0xdeadbeef, 0, [6]uint64{}, badArch},
	} {
		got := run(t, prog, seccompData{nr: tc.nr, arch: tc.arch, args: tc.args})
		if got != tc.want {
			t.Errorf("%s: %#x, want %#x", tc.name, got, tc.want)
		}
	}
}

func TestBytesRoundTrip(t *testing.T) {
	prog, err := Compile(dockerProfile(t, dockerCaps))
	if err != nil {
		t.Fatal(err)
	}
	back, err := Decode(prog.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(prog, back) {
		t.Error("Decode(Bytes()) differs")
	}
	if _, err := Decode([]byte{1, 2, 3}); err == nil {
		t.Error("Decode accepted 3 bytes")
	}
}

func TestRefusesWhatItCannotCompile(t *testing.T) {
	errno := uint(unix.ENOENT)
	for _, tc := range []struct {
		name string
		cfg  specs.LinuxSeccomp
	}{
		{"arm", specs.LinuxSeccomp{DefaultAction: specs.ActErrno, Architectures: []specs.Arch{specs.ArchAARCH64}}},
		{"no x86_64", specs.LinuxSeccomp{DefaultAction: specs.ActErrno, Architectures: []specs.Arch{specs.ArchX86}}},
		{"notify", specs.LinuxSeccomp{DefaultAction: specs.ActNotify}},
		{"flags", specs.LinuxSeccomp{DefaultAction: specs.ActErrno, Flags: []specs.LinuxSeccompFlag{specs.LinuxSeccompFlagLog}}},
		{"mixed actions", specs.LinuxSeccomp{DefaultAction: specs.ActErrno, Syscalls: []specs.LinuxSyscall{
			{Names: []string{"read"}, Action: specs.ActAllow},
			{Names: []string{"read"}, Action: specs.ActErrno, ErrnoRet: &errno, Args: []specs.LinuxSeccompArg{{Index: 0, Value: 1, Op: specs.OpEqualTo}}},
		}}},
		{"i386 wide value", specs.LinuxSeccomp{DefaultAction: specs.ActErrno, Architectures: []specs.Arch{specs.ArchX86_64, specs.ArchX86}, Syscalls: []specs.LinuxSyscall{
			{Names: []string{"read"}, Action: specs.ActAllow, Args: []specs.LinuxSeccompArg{{Index: 0, Value: 1 << 40, Op: specs.OpEqualTo}}},
		}}},
	} {
		if _, err := Compile(&tc.cfg); err == nil {
			t.Errorf("%s: compiled", tc.name)
		} else {
			t.Logf("%s: %v", tc.name, err)
		}
	}
}

// TestFarJumps compiles a profile large enough that conditional jumps must
// be relayed through unconditional ones, and checks it still agrees with
// the reference.
func TestFarJumps(t *testing.T) {
	cfg := &specs.LinuxSeccomp{DefaultAction: specs.ActErrno, Architectures: []specs.Arch{specs.ArchX86_64}}
	names := make([]string, 0, len(sysX86_64))
	for n := range sysX86_64 {
		names = append(names, n)
	}
	slices.Sort(names)
	for i, n := range names {
		if i%8 != 0 {
			continue
		}
		// Every other call allowed only for a few argument values: long
		// conditional blocks between the tree's nodes.
		for v := range uint64(3) {
			cfg.Syscalls = append(cfg.Syscalls, specs.LinuxSyscall{Names: []string{n}, Action: specs.ActAllow,
				Args: []specs.LinuxSeccompArg{{Index: 1, Value: v * 3, Op: specs.OpEqualTo}, {Index: 2, Value: v, Op: specs.OpLessEqual}}})
		}
	}
	prog, err := Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	far := 0
	for _, in := range prog {
		if in.Code == unix.BPF_JMP|unix.BPF_JA {
			far++
		}
	}
	if far == 0 {
		t.Fatalf("%d instructions and no far jump: the test does not test", len(prog))
	}
	for nr := uint32(0); nr < 480; nr++ {
		for _, args := range [][6]uint64{{}, {0, 3, 1}, {0, 6, 2}, {0, 6, 3}, {0, 15, 0}, {0, 18, 0}} {
			d := seccompData{nr: nr, arch: AuditArchX86_64, args: args}
			if got, want := run(t, prog, d), reference(t, cfg, specs.ArchX86_64, d); got != want {
				t.Fatalf("nr %d args %v: %#x, want %#x", nr, args, got, want)
			}
		}
	}
	t.Logf("%d instructions, %d far jumps", len(prog), far)
}

func ExampleCompile() {
	s := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: dockerCaps}}}
	profile, _ := seccomp.GetDefaultProfile(s)
	prog, err := Compile(profile)
	fmt.Println(err, len(prog) > 0)
	// Output: <nil> true
}
