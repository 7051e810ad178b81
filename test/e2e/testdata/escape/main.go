// Command escape tries, from inside a sandbox, what a workload must not be
// able to do to the sandbox's guest agent (PID 1): trace it, read or write
// its memory, reach its descriptors and environment through /proc. It also
// tries to trace a child of its own, which only the seccomp filter stops,
// and lists its own descriptors.
//
// Usage: escape [BYTES]  (BYTES: how much to write to the agent's fd 1 and
// 2 should they open; default 1 MiB)
//
//	escape sleep  (sleeps 30 s)
//	escape ids    (prints its uid, euid, capability sets, no_new_privs and
//	               seccomp mode: installed setuid, what setuid gains)
//
// Output, one line per attempt: "NAME denied ERRNO" or "NAME ALLOWED DETAIL",
// then "fds N=TARGET ..." (the descriptors it inherited). Exit 0.
//
// Built static (CGO_ENABLED=0) by the tests and copied into the sandbox.
package main

import (
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// marker is mapped at the same address in every process of this binary.
var marker = [8]byte{'s', 'h', 'o', 'a', 'l'}

const (
	ptraceSeize = 0x4206
	kcmpFile    = 0
)

func main() {
	// First, before the Go runtime or os opens anything of its own.
	fds := listFDs()

	if len(os.Args) > 1 && os.Args[1] == "sleep" {
		time.Sleep(30 * time.Second)
		return
	}
	if len(os.Args) > 1 && os.Args[1] == "ids" {
		// Installed setuid root, this shows what a setuid binary (sudo)
		// gains in a sandbox: its ids, then its capability lines.
		fmt.Printf("uid=%d euid=%d\n", os.Getuid(), os.Geteuid())
		status, _ := os.ReadFile("/proc/self/status")
		for _, l := range strings.Split(string(status), "\n") {
			if strings.HasPrefix(l, "Cap") || strings.HasPrefix(l, "NoNewPrivs") || strings.HasPrefix(l, "Seccomp:") {
				fmt.Println(l)
			}
		}
		return
	}
	size := 1 << 20
	if len(os.Args) > 1 {
		if n, err := strconv.Atoi(os.Args[1]); err == nil {
			size = n
		}
	}
	report := func(name string, err error, detail string) {
		if err != nil {
			fmt.Printf("%s denied %v\n", name, err)
		} else {
			fmt.Printf("%s ALLOWED %s\n", name, detail)
		}
	}

	// ptrace PID 1: attach and seize.
	for _, req := range []struct {
		name string
		op   uintptr
	}{{"ptrace-attach-pid1", unix.PTRACE_ATTACH}, {"ptrace-seize-pid1", ptraceSeize}} {
		_, _, e := unix.Syscall6(unix.SYS_PTRACE, req.op, 1, 0, 0, 0, 0)
		if e == 0 {
			// Let it go: wait for the stop the attach caused, then detach
			// (a detach before that fails, and leaves it stopped).
			if req.op == unix.PTRACE_ATTACH {
				var ws unix.WaitStatus
				unix.Wait4(1, &ws, unix.WALL, nil)
			} else {
				unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_INTERRUPT, 1, 0, 0, 0, 0)
				var ws unix.WaitStatus
				unix.Wait4(1, &ws, unix.WALL, nil)
			}
			unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_DETACH, 1, 0, 0, 0, 0)
			report(req.name, nil, "attached")
		} else {
			report(req.name, e, "")
		}
	}

	// Its memory, environment and descriptors through /proc.
	for _, o := range []struct {
		name, path string
		flags      int
	}{
		{"open-mem-rw", "/proc/1/mem", unix.O_RDWR},
		{"open-mem-ro", "/proc/1/mem", unix.O_RDONLY},
		{"open-environ", "/proc/1/environ", unix.O_RDONLY},
		{"open-cwd", "/proc/1/cwd", unix.O_RDONLY | unix.O_DIRECTORY},
	} {
		fd, err := unix.Open(o.path, o.flags|unix.O_CLOEXEC, 0)
		if err == nil {
			unix.Close(fd)
		}
		report(o.name, err, o.path+" opened")
	}
	// (The numbers in /proc/1/fd can be listed; what they are cannot.)
	for _, p := range []string{"/proc/1/exe", "/proc/1/fd/2", "/proc/1/fd/3"} {
		name := "readlink-" + strings.ReplaceAll(strings.TrimPrefix(p, "/proc/1/"), "/", "")
		if target, err := os.Readlink(p); err != nil {
			report(name, err, "")
		} else {
			report(name, nil, target)
		}
	}

	// The agent's stdout and stderr: host files once.
	for _, n := range []string{"1", "2"} {
		fd, err := unix.Open("/proc/1/fd/"+n, unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			report("write-fd"+n, err, "")
			continue
		}
		buf := make([]byte, 64<<10)
		for i := range buf {
			buf[i] = 'X'
		}
		total := 0
		for total < size {
			w, err := unix.Write(fd, buf[:min(len(buf), size-total)])
			if err != nil {
				break
			}
			total += w
		}
		unix.Close(fd)
		report("write-fd"+n, nil, fmt.Sprintf("wrote %d bytes", total))
	}

	// Its memory without /proc.
	var word [8]byte
	local := []unix.Iovec{{Base: &word[0], Len: 8}}
	remote := []unix.RemoteIovec{{Base: 0x400000, Len: 8}}
	if _, err := unix.ProcessVMReadv(1, local, remote, 0); err != nil {
		report("process_vm_readv-pid1", err, "")
	} else {
		report("process_vm_readv-pid1", nil, "read")
	}
	if _, err := unix.ProcessVMWritev(1, local, remote, 0); err != nil {
		report("process_vm_writev-pid1", err, "")
	} else {
		report("process_vm_writev-pid1", nil, "written")
	}
	_, _, e := unix.Syscall6(unix.SYS_KCMP, uintptr(os.Getpid()), 1, kcmpFile, 0, 0, 0)
	report("kcmp-pid1", errnoErr(e), "compared")
	if pidfd, err := unix.PidfdOpen(1, 0); err != nil {
		report("pidfd_getfd-pid1", fmt.Errorf("pidfd_open: %w", err), "")
	} else {
		fd, err := unix.PidfdGetfd(pidfd, 2, 0)
		if err == nil {
			unix.Close(fd)
		}
		report("pidfd_getfd-pid1", err, "got the agent's fd 2")
		unix.Close(pidfd)
	}

	// A fault forged for the agent: SIGSEGV with a siginfo of our making
	// (si_code SI_QUEUE), which the Go runtime would take for its own
	// fault and die of.
	var info [128]byte
	*(*int32)(unsafe.Pointer(&info[0])) = int32(unix.SIGSEGV)
	*(*int32)(unsafe.Pointer(&info[8])) = -1 // SI_QUEUE
	_, _, e = unix.Syscall(unix.SYS_RT_SIGQUEUEINFO, 1, uintptr(unix.SIGSEGV), uintptr(unsafe.Pointer(&info[0])))
	report("rt_sigqueueinfo-pid1", errnoErr(e), "queued a SIGSEGV")
	// The kernel reads the pid's low 32 bits only.
	_, _, e = unix.Syscall(unix.SYS_RT_SIGQUEUEINFO, 1|1<<32, uintptr(unix.SIGSEGV), uintptr(unsafe.Pointer(&info[0])))
	report("rt_sigqueueinfo-pid1-high", errnoErr(e), "queued a SIGSEGV")
	_, _, e = unix.Syscall6(unix.SYS_RT_TGSIGQUEUEINFO, 1, 1, uintptr(unix.SIGSEGV), uintptr(unsafe.Pointer(&info[0])), 0, 0)
	report("rt_tgsigqueueinfo-pid1", errnoErr(e), "queued a SIGSEGV")
	if pidfd, err := unix.PidfdOpen(1, 0); err != nil {
		report("pidfd_send_signal-info-pid1", fmt.Errorf("pidfd_open: %w", err), "")
	} else {
		_, _, e = unix.Syscall6(unix.SYS_PIDFD_SEND_SIGNAL, uintptr(pidfd), uintptr(unix.SIGSEGV), uintptr(unsafe.Pointer(&info[0])), 0, 0, 0)
		report("pidfd_send_signal-info-pid1", errnoErr(e), "sent a SIGSEGV")
		unix.Close(pidfd)
	}
	// To itself, and without a siginfo, they work (an ignored signal).
	signal.Ignore(unix.SIGUSR1)
	*(*int32)(unsafe.Pointer(&info[0])) = int32(unix.SIGUSR1)
	_, _, e = unix.Syscall(unix.SYS_RT_SIGQUEUEINFO, uintptr(os.Getpid()), uintptr(unix.SIGUSR1), uintptr(unsafe.Pointer(&info[0])))
	report("rt_sigqueueinfo-self", errnoErr(e), "queued")
	if pidfd, err := unix.PidfdOpen(os.Getpid(), 0); err == nil {
		_, _, e = unix.Syscall6(unix.SYS_PIDFD_SEND_SIGNAL, uintptr(pidfd), uintptr(unix.SIGUSR1), 0, 0, 0, 0)
		report("pidfd_send_signal-self", errnoErr(e), "sent")
		unix.Close(pidfd)
	}

	// A child of our own: only seccomp forbids tracing it.
	child := exec.Command("/proc/self/exe", "sleep")
	if err := child.Start(); err != nil {
		report("ptrace-seize-child", fmt.Errorf("start child: %w", err), "")
	} else {
		_, _, e := unix.Syscall6(unix.SYS_PTRACE, ptraceSeize, uintptr(child.Process.Pid), 0, 0, 0, 0)
		report("ptrace-seize-child", errnoErr(e), "attached")
		var w [8]byte
		l := []unix.Iovec{{Base: &w[0], Len: 8}}
		// The same static, non-PIE binary: marker is at the same address.
		r := []unix.RemoteIovec{{Base: uintptr(unsafe.Pointer(&marker[0])), Len: 8}}
		_, err := unix.ProcessVMReadv(child.Process.Pid, l, r, 0)
		report("process_vm_readv-child", err, "read")
		child.Process.Kill()
		child.Wait()
	}

	fmt.Println("fds " + strings.Join(fds, " "))
}

func errnoErr(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

// listFDs lists the descriptors the process inherited (those without
// close-on-exec: the Go runtime opens its own, cgroup files for GOMAXPROCS,
// with it) as "N=TARGET", with raw system calls only.
func listFDs() []string {
	dir, err := unix.Open("/proc/self/fd", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return []string{"error=" + err.Error()}
	}
	defer unix.Close(dir)
	var out []string
	buf := make([]byte, 8<<10)
	for {
		n, err := unix.Getdents(dir, buf)
		if err != nil || n <= 0 {
			break
		}
		for off := 0; off < n; {
			reclen := int(*(*uint16)(unsafe.Pointer(&buf[off+16])))
			name := buf[off+19 : off+reclen]
			if i := strings.IndexByte(string(name), 0); i >= 0 {
				name = name[:i]
			}
			off += reclen
			s := string(name)
			if s == "." || s == ".." || s == strconv.Itoa(dir) {
				continue
			}
			if fd, err := strconv.Atoi(s); err == nil {
				if fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err == nil && fl&unix.FD_CLOEXEC != 0 {
					continue
				}
			}
			target := make([]byte, 256)
			m, err := unix.Readlinkat(dir, s, target)
			if err != nil {
				out = append(out, s+"=?")
				continue
			}
			out = append(out, s+"="+string(target[:m]))
		}
	}
	return out
}
