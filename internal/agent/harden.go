package agent

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"
)

// The agent is the sandbox's PID 1 and runs as root with the sandbox's
// capabilities, like every command it starts: without more, any command
// could ptrace it, read and write its memory (/proc/1/mem,
// process_vm_writev) and so forge what it reports, or write to the
// descriptors it holds (/proc/1/fd/N). Two defences, either sufficient:
//
//   - SetNotDumpable: the kernel then requires CAP_SYS_PTRACE, which no
//     sandbox has, for ptrace, /proc/1/mem, /proc/1/environ, what
//     /proc/1/fd/N, cwd, root and exe point to (the fd numbers can still be
//     listed), process_vm_readv/writev, kcmp and pidfd_getfd on the agent.
//     execve makes a process dumpable again, so commands are unaffected.
//   - the sandbox's seccomp filter denies ptrace, process_vm_readv/writev,
//     kcmp and pidfd_getfd altogether (internal/backend/container,
//     seccomp.go); the agent needs none of them.

// SetNotDumpable makes the process non-dumpable (prctl PR_SET_DUMPABLE 0):
// no core dump, and no process without CAP_SYS_PTRACE may trace it or look
// into it through /proc (see above). Call it first thing; StartBoot calls it
// too.
func SetNotDumpable() error {
	return unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
}

// The agent's log: standard error.
//
// The container backend gives the agent /dev/null as stdin and stdout and,
// as stderr, the write end of a pipe whose read end the node drains into a
// size-capped log file (the agent's start-up errors, Go runtime crashes and
// the few warnings of Logger). Nobody may be reading it: after a restart of
// the node until it reopens the pipe, or once the log reached its cap. The
// agent must neither block nor die on its log, so PrepareStderr gives fd 2
// a non-blocking file description of its own (a line that does not fit is
// dropped) and makes a write to a closed pipe (EPIPE) harmless: Go kills a
// program on EPIPE on fd 1 or 2 unless SIGPIPE is notified. Only ever write
// to the log with StderrLogger (one atomic write(2) per line), never through
// os.Stderr, which would fail with EAGAIN or write half lines.

// PrepareStderr makes logging on fd 2 safe for the agent, as described
// above, when fd 2 is a pipe; otherwise (a terminal or a file, in tests and
// dev runs) it changes nothing. StartBoot calls it.
func PrepareStderr() {
	var st unix.Stat_t
	if unix.Fstat(2, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFIFO {
		return
	}
	// Caught, not ignored: an ignored SIGPIPE would stay ignored in
	// commands across execve. The channel is never read; a notified signal
	// merely makes the runtime not die of it.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	// A new open file description of the same pipe, so that O_NONBLOCK does
	// not reach whoever shares the one we inherited (runc's, a test's).
	fd, err := unix.Open("/proc/self/fd/2", unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	switch {
	case err == nil:
	case err == unix.ENXIO:
		// No reader. Nothing would be read, and a reader that comes later
		// must not make the agent's writes block: give up the log.
		if fd, err = unix.Open("/dev/null", unix.O_WRONLY|unix.O_CLOEXEC, 0); err != nil {
			unix.SetNonblock(2, true)
			return
		}
	default:
		// No /proc: the shared description then, as the lesser evil.
		unix.SetNonblock(2, true)
		return
	}
	unix.Dup3(fd, 2, 0)
	unix.Close(fd)
}

// maxLogLine bounds a log line: a pipe write of at most PIPE_BUF bytes is
// atomic, whole or not at all.
const maxLogLine = 1024

// StderrLogger is a Logger writing "shoal-agent: msg key=value ..." lines
// to fd 2, each with one write(2) that is dropped if it cannot be done now
// (see PrepareStderr). It stands in for log/slog, which would cost the
// agent about 370 KiB of RSS.
type StderrLogger struct{}

// Warn logs one line.
func (StderrLogger) Warn(msg string, args ...any) {
	b := make([]byte, 0, 128)
	b = append(b, "shoal-agent: "...)
	b = append(b, msg...)
	for i := 0; i+1 < len(args); i += 2 {
		b = fmt.Appendf(b, " %v=%v", args[i], args[i+1])
	}
	if len(b) > maxLogLine-1 {
		b = append(b[:maxLogLine-4], "..."...)
	}
	b = append(b, '\n')
	unix.Write(2, b)
}
