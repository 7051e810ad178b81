package seccompbpf

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

const childEnv = "SECCOMPBPF_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		child()
		return
	}
	os.Exit(m.Run())
}

// probe is a system call made under the filter, with arguments chosen so
// that the kernel fails it harmlessly when the filter lets it through: the
// errno tells the filter's answer (EPERM, ENOSYS) from the kernel's.
type probe struct {
	name string
	nr   uintptr
	args [6]uintptr
	want unix.Errno // 0: succeeds
}

var probes = []probe{
	{"getpid", unix.SYS_GETPID, [6]uintptr{}, 0},
	{"clone CLONE_SIGHAND (invalid without CLONE_VM)", unix.SYS_CLONE, [6]uintptr{unix.CLONE_SIGHAND}, unix.EINVAL},
	{"clone CLONE_NEWUSER|CLONE_SIGHAND", unix.SYS_CLONE, [6]uintptr{unix.CLONE_NEWUSER | unix.CLONE_SIGHAND}, unix.EPERM},
	{"clone CLONE_NEWNS|CLONE_SIGHAND", unix.SYS_CLONE, [6]uintptr{unix.CLONE_NEWNS | unix.CLONE_SIGHAND}, unix.EPERM},
	{"clone3", unix.SYS_CLONE3, [6]uintptr{}, unix.ENOSYS},
	{"unshare CLONE_NEWUSER", unix.SYS_UNSHARE, [6]uintptr{unix.CLONE_NEWUSER}, unix.EPERM},
	{"setns", unix.SYS_SETNS, [6]uintptr{^uintptr(0)}, unix.EPERM},
	{"mount", unix.SYS_MOUNT, [6]uintptr{}, unix.EPERM},
	{"keyctl", unix.SYS_KEYCTL, [6]uintptr{^uintptr(0)}, unix.EPERM},
	{"bpf", unix.SYS_BPF, [6]uintptr{^uintptr(0)}, unix.EPERM},
	{"io_uring_setup", unix.SYS_IO_URING_SETUP, [6]uintptr{}, unix.EPERM},
	{"ptrace bad request", unix.SYS_PTRACE, [6]uintptr{0x7fffffff, 0}, unix.ESRCH},
	{"personality query", unix.SYS_PERSONALITY, [6]uintptr{0xffffffff}, 0},
	{"personality ADDR_NO_RANDOMIZE", unix.SYS_PERSONALITY, [6]uintptr{0x0040000}, unix.EPERM},
	{"socket AF_INET bad type", unix.SYS_SOCKET, [6]uintptr{unix.AF_INET, 999}, unix.EINVAL},
	{"socket AF_VSOCK", unix.SYS_SOCKET, [6]uintptr{unix.AF_VSOCK, 999}, unix.EPERM},
	{"socket AF_ALG", unix.SYS_SOCKET, [6]uintptr{unix.AF_ALG, 999}, unix.EPERM},
	{"chroot bad pointer", unix.SYS_CHROOT, [6]uintptr{}, unix.EFAULT},
	{"unassigned 400", 400, [6]uintptr{}, unix.EPERM},
	{"newer than the profile", 1000, [6]uintptr{}, unix.ENOSYS},
}

func child() {
	prog, err := Compile(dockerProfile(&testing.T{}, dockerCaps))
	if err != nil {
		fmt.Println("compile:", err)
		os.Exit(2)
	}
	runtime.LockOSThread()
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		fmt.Println("no_new_privs:", err)
		os.Exit(2)
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if _, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog))); e != 0 {
		fmt.Println("seccomp:", e)
		os.Exit(2)
	}
	for i, p := range probes {
		_, _, e := unix.RawSyscall6(p.nr, p.args[0], p.args[1], p.args[2], p.args[3], p.args[4], p.args[5])
		fmt.Printf("%d %d\n", i, int(e))
	}
}

// TestKernelEnforces installs docker's profile, compiled, in a child
// process (with no_new_privs, so no privilege is needed) and makes the
// probe system calls under it.
func TestKernelEnforces(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("x86_64 only")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	got := map[int]unix.Errno{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 {
			t.Fatalf("child says %q", sc.Text())
		}
		i, _ := strconv.Atoi(f[0])
		e, _ := strconv.Atoi(f[1])
		got[i] = unix.Errno(e)
	}
	if len(got) != len(probes) {
		t.Fatalf("child answered %d of %d probes:\n%s", len(got), len(probes), out)
	}
	for i, p := range probes {
		if got[i] != p.want {
			t.Errorf("%s: errno %d (%v), want %d (%v)", p.name, got[i], got[i], p.want, p.want)
		}
	}
}
