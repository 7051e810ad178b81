package agent

import (
	"os"
	"os/signal"
	"slices"
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
// A fork is not done under mu: it runs on the spawner's thread, at the
// commands' priority (see AgentNice), and a kill must not wait for it. So
// with all set, a child that exits before its pid is registered may be
// reaped first: while forks are in flight, a status no one waits for is
// kept (early), with the count of statuses reaped before it, and the
// registration takes it from there. A fork can only have made a pid reaped
// after the fork began, so older statuses of the same pid (an orphan's,
// the pid reused since) are not taken; they are dropped once no fork that
// began before them is in flight. Without all, a child is only waited for
// once registered.
type reaper struct {
	all  bool
	kick chan struct{} // cap 1: ask for a reap pass

	mu      sync.Mutex
	waiting map[int]*command  // guarded by mu; started and not yet reaped
	reaped  uint64            // guarded by mu; statuses collected so far
	forking []uint64          // guarded by mu; reaped when each fork in flight began
	early   map[int]earlyExit // guarded by mu; see above
}

// earlyExit is the status of a pid reaped while forks were in flight and
// before any registered it; seq is the reaper's count once it was reaped.
type earlyExit struct {
	ws  syscall.WaitStatus
	seq uint64
}

func newReaper(all bool) *reaper {
	r := &reaper{all: all, kick: make(chan struct{}, 1), waiting: make(map[int]*command), early: make(map[int]earlyExit)}
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
// and registers c as the waiter of that pid (see reaper: not under mu).
func (r *reaper) start(c *command, fork func() (int, error)) (int, error) {
	r.mu.Lock()
	began := r.reaped
	r.forking = append(r.forking, began)
	r.mu.Unlock()

	pid, err := fork()

	r.mu.Lock()
	if i := slices.Index(r.forking, began); i >= 0 {
		r.forking = slices.Delete(r.forking, i, i+1)
	}
	if err == nil {
		c.pid = pid
		if e, ok := r.early[pid]; ok && e.seq > began {
			delete(r.early, pid)
			c.exited(e.ws)
		} else {
			r.waiting[pid] = c
		}
	}
	// Statuses no fork in flight can have made.
	oldest := r.reaped
	if len(r.forking) > 0 {
		oldest = slices.Min(r.forking)
	}
	for p, e := range r.early {
		if e.seq <= oldest {
			delete(r.early, p)
		}
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
	if c.reaped || c.pid == 0 { // 0: still forking (kill(0) would be the agent's own group)
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
			r.reaped++
			if c := r.waiting[pid]; c != nil {
				delete(r.waiting, pid)
				c.exited(ws)
			} else if len(r.forking) > 0 {
				// Maybe a command not registered yet (see reaper).
				r.early[pid] = earlyExit{ws, r.reaped}
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
