package agent

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The start-up contract between the container backend and the agent. The
// backend passes, besides the listening socket ($SHOAL_AGENT_FD):
//
//   - $SHOAL_SECCOMP_FD: a file holding the sandbox's seccomp filter, a
//     classic BPF program as the kernel's struct sock_filter array. The
//     node compiles docker's profile once (internal/backend/container/
//     seccompbpf) instead of runc compiling it for every container. The
//     agent installs it on all its threads (TSYNC) before it serves
//     anything, so every command inherits it. The container runs
//     without no_new_privs (setuid binaries such as sudo work, as in
//     docker), so the agent starts with CAP_SYS_ADMIN, which installing
//     a filter then requires, and drops it from every set of every
//     thread right after (dropSysAdmin).
//   - $SHOAL_READY_FD: a pipe on which the agent writes "ok\n" once it is
//     ready to serve, or "error: ...\n" before exiting. The backend's Create
//     waits for it, so a filter that cannot be installed fails the create
//     (fail closed) instead of leaving a sandbox whose agent died.
//   - $SHOAL_POOL=1: the agent is a pre-started blank sandbox of the pool.
//     It serves nothing but ping and claim until a claim gives it its root
//     (see claim.go); the filter is installed by the claim, after the root
//     switch that needs the mount system calls.
//   - $SHOAL_BEST_EFFORT=1: a best-effort sandbox; its commands run under
//     SCHED_IDLE (see AgentNice; a pooled agent learns it from its claim).
//   - $SHOAL_LIFELINE_FD (pooled only): the read end of a pipe whose write
//     end only the node process holds. When it reads EOF (the node died or
//     exited) before a claim, the agent exits: an unclaimed pool container
//     never outlives the node that made it, whatever became of the node's
//     data. A claimed sandbox stops watching it and survives the node.
//
// The variables are removed from the environment so that commands do not
// inherit them, and the descriptors are closed.
const (
	EnvSeccompFD  = "SHOAL_SECCOMP_FD"
	EnvReadyFD    = "SHOAL_READY_FD"
	EnvPool       = "SHOAL_POOL"
	EnvLifeline   = "SHOAL_LIFELINE_FD"
	EnvBestEffort = "SHOAL_BEST_EFFORT"
)

// Boot is what the backend handed the agent at start-up.
type Boot struct {
	seccomp  []unix.SockFilter // the filter (pooled: to install on claim)
	ready    *os.File          // nil when the backend waits for nothing
	lifeline *os.File          // pooled: EOF when the node is gone; may be nil
	pooled   bool
	idle     bool // $SHOAL_BEST_EFFORT
}

// StartBoot makes the process non-dumpable (SetNotDumpable) and its log
// safe (PrepareStderr), then reads the start-up environment. Unless the
// agent is pooled, it installs the seccomp filter now. An error means the
// agent must not serve: report it with Ready and exit.
func StartBoot() (*Boot, error) {
	b := &Boot{}
	PrepareStderr()
	if err := SetNotDumpable(); err != nil {
		// Fail closed: a dumpable PID 1 is the workload's to trace.
		return b, fmt.Errorf("prctl PR_SET_DUMPABLE: %w", err)
	}
	if s, ok := os.LookupEnv(EnvReadyFD); ok {
		os.Unsetenv(EnvReadyFD)
		fd, err := envFD(EnvReadyFD, s)
		if err != nil {
			return b, err
		}
		unix.CloseOnExec(fd)
		b.ready = os.NewFile(uintptr(fd), "ready")
	}
	b.pooled = os.Getenv(EnvPool) == "1"
	os.Unsetenv(EnvPool)
	b.idle = os.Getenv(EnvBestEffort) == "1"
	os.Unsetenv(EnvBestEffort)
	if s, ok := os.LookupEnv(EnvLifeline); ok {
		os.Unsetenv(EnvLifeline)
		fd, err := envFD(EnvLifeline, s)
		if err != nil {
			return b, err
		}
		unix.CloseOnExec(fd)
		// Left as it is, never read (see Server.watchLifeline): its
		// O_NONBLOCK flag is shared with the node and changes under us.
		b.lifeline = os.NewFile(uintptr(fd), "lifeline")
	}
	if s, ok := os.LookupEnv(EnvSeccompFD); ok {
		os.Unsetenv(EnvSeccompFD)
		fd, err := envFD(EnvSeccompFD, s)
		if err != nil {
			return b, err
		}
		f := os.NewFile(uintptr(fd), "seccomp")
		data, err := readAllAt(f)
		f.Close()
		if err != nil {
			return b, fmt.Errorf("read seccomp filter: %w", err)
		}
		if b.seccomp, err = decodeFilter(data); err != nil {
			return b, err
		}
	} else if b.pooled {
		// A pooled agent must be able to confine its commands on claim.
		return b, errors.New("pooled agent without a seccomp filter")
	}
	if !b.pooled && b.seccomp != nil {
		// Still with CAP_SYS_ADMIN, before any command: the host name runc
		// set resolves (a pooled agent does this on claim).
		if h, err := os.Hostname(); err == nil {
			if err := BindHosts(h); err != nil {
				fmt.Fprintf(os.Stderr, "shoal-agent: the host name will not resolve: %v\n", err)
			}
		}
		if err := InstallSeccomp(b.seccomp); err != nil {
			return b, err
		}
		// The filter is installed without no_new_privs (setuid binaries
		// must work, as in docker), with CAP_SYS_ADMIN that no command
		// may have: drop it now, before anything is served.
		if err := dropSysAdmin(); err != nil {
			return b, err
		}
	}
	return b, nil
}

// CommandsIdle reports whether the agent's commands run under SCHED_IDLE
// (Config.CommandsIdle).
func (b *Boot) CommandsIdle() bool { return b.idle }

// Pooled reports whether the agent waits for a claim.
func (b *Boot) Pooled() bool { return b.pooled }

// Ready tells the backend that the agent serves (err == nil) or why it
// cannot; it closes the pipe. It does nothing when no pipe was given.
func (b *Boot) Ready(err error) {
	if b == nil || b.ready == nil {
		return
	}
	msg := "ok\n"
	if err != nil {
		msg = "error: " + err.Error() + "\n"
	}
	b.ready.WriteString(msg)
	b.ready.Close()
	b.ready = nil
}

func envFD(name, s string) (int, error) {
	fd, err := strconv.Atoi(s)
	if err != nil || fd < 3 {
		return -1, fmt.Errorf("%s=%q: want a file descriptor number >= 3", name, s)
	}
	return fd, nil
}

// readAllAt reads a small file from offset 0 (the descriptor may be shared).
func readAllAt(f *os.File) ([]byte, error) {
	var out []byte
	buf := make([]byte, 8<<10)
	for off := int64(0); ; {
		n, err := f.ReadAt(buf, off)
		out = append(out, buf[:n]...)
		off += int64(n)
		if err != nil {
			if errors.Is(err, os.ErrClosed) || n == 0 {
				if len(out) == 0 {
					return nil, err
				}
				return out, nil
			}
			return out, nil // io.EOF
		}
		if len(out) > 8*bpfMaxInsns {
			return nil, errors.New("seccomp filter too large")
		}
	}
}

const bpfMaxInsns = 4096

func decodeFilter(b []byte) ([]unix.SockFilter, error) {
	if len(b) == 0 || len(b)%8 != 0 || len(b)/8 > bpfMaxInsns {
		return nil, fmt.Errorf("seccomp filter of %d bytes: want 8 to %d bytes, a multiple of 8", len(b), 8*bpfMaxInsns)
	}
	p := make([]unix.SockFilter, len(b)/8)
	for i := range p {
		p[i] = unix.SockFilter{
			Code: binary.NativeEndian.Uint16(b[8*i:]),
			Jt:   b[8*i+2],
			Jf:   b[8*i+3],
			K:    binary.NativeEndian.Uint32(b[8*i+4:]),
		}
	}
	return p, nil
}

// InstallSeccomp installs a filter on every thread of the process
// (SECCOMP_FILTER_FLAG_TSYNC); threads started later inherit it, and so do
// all children. The process needs no_new_privs or CAP_SYS_ADMIN.
func InstallSeccomp(prog []unix.SockFilter) error {
	if len(prog) == 0 {
		return errors.New("install seccomp filter: empty program")
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	r, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(prog)
	if errno != 0 {
		return fmt.Errorf("install seccomp filter: %w", errno)
	}
	if r != 0 {
		// TSYNC reports the thread it could not synchronize.
		return fmt.Errorf("install seccomp filter: thread %d could not be synchronized", r)
	}
	return nil
}
