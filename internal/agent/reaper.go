package agent

import (
	"os"
	"os/signal"
	"sync"
	"syscall"
)

// reaper collects the exit statuses of child processes in one place.
//
// The agent is PID 1 of its sandbox, so every orphaned process is reparented
// to it and must be reaped, but the statuses of the agent's own commands must
// reach their waiters. Hence no exec.Cmd.Wait anywhere: a single SIGCHLD
// driven loop calls wait4 and dispatches each status by pid.
//
// With all set it calls wait4(-1, WNOHANG), reaping orphans too (PID 1, or a
// child subreaper). Without it (a server embedded in a process that has other
// children, as in tests) it only waits for the pids it started.
//
// Processes are started under mu, and wait4 is only called under mu, so a
// child that exits before its pid is registered is still dispatched to it:
// the reap pass that finds it runs after the registration.
type reaper struct {
	all  bool
	kick chan struct{} // cap 1: ask for a reap pass

	mu      sync.Mutex
	waiting map[int]*command // guarded by mu; started and not yet reaped
}

func newReaper(all bool) *reaper {
	r := &reaper{all: all, kick: make(chan struct{}, 1), waiting: make(map[int]*command)}
	sigc := make(chan os.Signal, 1)
	signal.Notify(sigc, syscall.SIGCHLD)
	go func() {
		r.reap() // zombies inherited before we started
		for {
			select {
			case <-sigc:
			case <-r.kick:
			}
			r.reap()
		}
	}()
	return r
}

// start runs fork (which must create exactly one child and return its pid)
// under the lock and registers c as the waiter of that pid.
func (r *reaper) start(c *command, fork func() (int, error)) (int, error) {
	r.mu.Lock()
	pid, err := fork()
	if err == nil {
		c.pid = pid
		r.waiting[pid] = c
	}
	r.mu.Unlock()
	if err == nil && !r.all {
		// SIGCHLD may have come and gone before the pid was registered.
		select {
		case r.kick <- struct{}{}:
		default:
		}
	}
	return pid, err
}

// signalGroup sends sig to c's process group if c has not been reaped yet.
// Once the leader is reaped its pid (the group id) may be reused by a new
// command, so the group is never signalled after that.
func (r *reaper) signalGroup(c *command, sig syscall.Signal, timeout bool) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c.reaped {
		return false
	}
	if timeout {
		c.timedOut = true
	}
	// ESRCH is impossible while the leader is unreaped (a zombie is still a
	// member of its group); other errors cannot happen for root.
	_ = syscall.Kill(-c.pid, sig)
	return true
}

// killAll SIGKILLs the process group of every command not yet reaped.
func (r *reaper) killAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for pid := range r.waiting {
		_ = syscall.Kill(-pid, syscall.SIGKILL)
	}
}

func (r *reaper) reap() {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ws syscall.WaitStatus
	if r.all {
		for {
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if err == syscall.EINTR {
				continue
			}
			if err != nil || pid <= 0 {
				return
			}
			if c := r.waiting[pid]; c != nil {
				delete(r.waiting, pid)
				c.exited(ws)
			}
			// Otherwise an orphan: its status is nobody's business.
		}
	}
	for pid, c := range r.waiting {
		got, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		for err == syscall.EINTR {
			got, err = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		}
		switch {
		case got == pid:
			delete(r.waiting, pid)
			c.exited(ws)
		case err == syscall.ECHILD: // reaped by someone else: status lost
			delete(r.waiting, pid)
			c.exited(syscall.WaitStatus(0xff << 8)) // report exit code 255
		}
	}
}
