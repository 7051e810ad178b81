package agent

import (
	"syscall"
	"testing"
	"time"
)

// The reaper takes a status reaped before its command was registered (a
// fork is not done under its lock: see reaper), and only one reaped after
// that fork began. Run in a child process of its own: a reaper that reaps
// every child (wait4(-1)) would take the statuses of other tests'.
func TestReaperEarlyExit(t *testing.T) {
	if !inChildProcess(t, "SHOAL_REAPER_CHILD") {
		return
	}
	r := newReaper(true)
	wait := func(c *command) syscall.WaitStatus {
		t.Helper()
		select {
		case <-c.done:
		case <-time.After(30 * time.Second):
			t.Fatal("the command's status never came")
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		return c.status
	}
	attr := &syscall.ProcAttr{Files: []uintptr{0, 1, 2}}

	// Exited and reaped before start registers it.
	for i := range 20 {
		c := &command{done: make(chan struct{})}
		pid, err := r.start(c, func() (int, error) {
			pid, err := syscall.ForkExec("/bin/sh", []string{"sh", "-c", "exit 3"}, attr)
			if err != nil {
				return pid, err
			}
			for deadline := time.Now().Add(30 * time.Second); ; {
				r.mu.Lock()
				_, reaped := r.early[pid]
				r.mu.Unlock()
				if reaped {
					return pid, nil
				}
				if time.Now().After(deadline) {
					t.Fatalf("pid %d never reaped", pid)
				}
				time.Sleep(time.Millisecond)
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		if ws := wait(c); ws.ExitStatus() != 3 {
			t.Fatalf("run %d (pid %d): exit status %d, want 3", i, pid, ws.ExitStatus())
		}
	}
	// A status of the same pid reaped before the fork began (an orphan's,
	// the pid reused since) is not the command's.
	c := &command{done: make(chan struct{})}
	_, err := r.start(c, func() (int, error) {
		pid, err := syscall.ForkExec("/bin/sh", []string{"sh", "-c", "sleep 0.2; exit 4"}, attr)
		if err == nil {
			r.mu.Lock()
			r.early[pid] = earlyExit{ws: 9, seq: 0} // killed: as an orphan reaped long before
			r.mu.Unlock()
		}
		return pid, err
	})
	if err != nil {
		t.Fatal(err)
	}
	if ws := wait(c); ws.ExitStatus() != 4 {
		t.Fatalf("exit status %d (%v), want 4", ws.ExitStatus(), ws)
	}
	// And nothing stays kept once no fork is in flight.
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.early) != 0 || len(r.forking) != 0 {
		t.Fatalf("left: early %v, forking %v", r.early, r.forking)
	}
}
