package agent

import (
	"os"
	"os/signal"
	"syscall"
)

// The workload runs as root in its sandbox and may signal the agent, its
// init: `kill -TERM 1`, `kill -HUP 1`, a process group kill that reaches
// PID 1, an RL policy's stray `pkill`. The kernel drops a signal sent to
// the init of a pid namespace from inside it only while the signal's
// action is the default one; the Go runtime installs a handler for every
// signal, and dies of HUP, INT, TERM (exit), QUIT, ABRT, TRAP, STKFLT, SYS
// (with a stack dump) and of a SEGV, BUS, FPE or ILL sent with kill(2),
// unless the program asked for them. SIGKILL and SIGSTOP from inside never
// reach an init.
//
// So the agent catches them all (caught, not ignored: an ignored signal
// would stay ignored in the commands it starts, across execve) and does
// nothing with them. The node never stops a sandbox with a signal to its
// agent: it kills the sandbox's cgroup, or the pid namespace's init, with
// SIGKILL, which the kernel delivers from outside.
var workloadSignals = []os.Signal{
	syscall.SIGHUP, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGILL, syscall.SIGTRAP, syscall.SIGABRT,
	syscall.SIGBUS, syscall.SIGFPE, syscall.SIGSEGV, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGPIPE,
	syscall.SIGALRM, syscall.SIGTERM, syscall.SIGSTKFLT, syscall.SIGXCPU, syscall.SIGXFSZ, syscall.SIGVTALRM,
	syscall.SIGIO, syscall.SIGPWR, syscall.SIGSYS,
}

// WorkloadSignals returns the signals HandleSignals catches.
func WorkloadSignals() []os.Signal { return append([]os.Signal(nil), workloadSignals...) }

// HandleSignals catches every signal the workload could end the agent
// with (see workloadSignals) and drops it. With stop non-nil (an agent
// that is not a sandbox's init: a test, a dev run, a full system's
// service stopped by its systemd), SIGTERM and SIGINT call stop instead.
// A (real, synchronous) fault of the agent itself still crashes it.
func HandleSignals(log Logger, stop func()) {
	c := make(chan os.Signal, 16)
	signal.Notify(c, workloadSignals...)
	go func() {
		logged := false
		for sig := range c {
			if stop != nil && (sig == syscall.SIGTERM || sig == syscall.SIGINT) {
				stop()
				continue
			}
			if !logged {
				// Once: the workload may send them in a loop.
				log.Warn("signal ignored (the agent is the sandbox's init)", "signal", sig.String())
				logged = true
			}
		}
	}()
}
