package agent

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The agent runs above its commands.
//
// The agent shares its sandbox's CPU with the commands it runs. Were they
// equals, a command that keeps a thousand tasks runnable (a fork bomb held
// at the pids limit) would leave the agent's threads one slice in a
// thousand: too little for its runtime to stop the world for a collection,
// so the timeout that would kill the command did not fire for minutes
// (seen in CI: the agent got 0.5% of a CPU). So the agent's threads run at
// nice AgentNice, within its sandbox's own CPU group (the group's weight,
// not its members' nice values, is what the host's other groups compete
// with), and every command is forked from one thread (spawner) that first
// raises its own nice value to 0, which the command inherits, and for a
// best-effort sandbox puts itself under SCHED_IDLE: neither needs a
// privilege. Lowering the agent's nice value does: the host sets it for a
// container's agent (which has no CAP_SYS_NICE over the host), the agent
// itself as the init of a VM: both with Prioritize.
//
// Where the host can, it does better for a container: it moves the
// spawner's thread (named SpawnerThread) into a CPU group of its own under
// the sandbox's, so that every command is born in that group, and leaves
// the agent at nice 0. Then the commands, however many, weigh as one task
// against each of the agent's threads within the sandbox's share, and the
// agent's threads do not weigh twenty nice levels more than other
// sandboxes' commands on the host's per-CPU split of their groups'
// weights, which slowed busy latency-sensitive sandboxes' execs (see the
// container backend's commandsGroup).
const AgentNice = -20

// SpawnerThread names the spawner's thread (its comm), which the host
// finds in /proc to move it into the commands' CPU group.
const SpawnerThread = "shoal-spawner"

// commandNice is the nice value commands start with.
const commandNice = 0

// Prioritize sets every thread of the agent whose pid is given to nice
// (AgentNice, or 0 when the host put its commands in a CPU group of their
// own). Lowering it needs CAP_SYS_NICE: a VM's init has it over itself; a
// container's agent does not, and its host does it instead.
func Prioritize(pid, nice int) error {
	return eachThread(pid, func(tid int) (bool, error) {
		prio, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
		if err != nil || 20-prio == nice { // getpriority returns 20-nice
			return true, err
		}
		return false, unix.Setpriority(unix.PRIO_PROCESS, tid, nice)
	})
}

// eachThread applies fix to every thread of process pid until two passes
// in a row find every thread as wanted: fix reports whether tid already
// was (and sets it when not). A thread inherits its creator's scheduling
// attributes, so once every thread is as wanted, none can appear
// otherwise, but for one whose creation was under way while its creator
// was being fixed (it copied the old attributes, and shows in /proc only
// at its end): the second pass is for it (seen once in a loaded test run:
// a prewarmed thread left at the commands' nice value). A thread gone
// meanwhile (ESRCH) is skipped.
func eachThread(pid int, fix func(tid int) (ok bool, err error)) error {
	clean := 0
	for range 12 {
		ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
		if err != nil {
			return fmt.Errorf("agent priority: %w", err)
		}
		done := true
		for _, e := range ents {
			tid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			ok, err := fix(tid)
			if errors.Is(err, unix.ESRCH) {
				continue
			}
			if err != nil {
				return fmt.Errorf("agent priority: %w", err)
			}
			done = done && ok
		}
		if !done {
			clean = 0
			continue
		}
		if clean++; clean == 2 {
			return nil
		}
	}
	return errors.New("agent priority: threads keep appearing")
}

// spawner forks every command of a server from one OS thread kept at the
// commands' scheduling (see AgentNice). It is made when the server is, so
// that its thread exists before any command could fill the sandbox's pids
// limit (a thread the runtime cannot create is fatal).
type spawner struct {
	reqs chan func()
	idle atomic.Bool // commands run under SCHED_IDLE (a best-effort sandbox)
}

func newSpawner() *spawner {
	s := &spawner{reqs: make(chan func())}
	ready := make(chan struct{})
	// Not on the process's main thread, whose nice value ps and
	// /proc/PID show as the agent's.
	goLocked(func() {
		// Its name, for the host (and what a forked command shows until
		// it executes).
		name := append([]byte(SpawnerThread), 0)
		unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(&name[0])), 0, 0, 0)
		runtime.KeepAlive(name)
		close(ready)
		for f := range s.reqs {
			commandSched(s.idle.Load())
			f()
		}
	})
	<-ready
	return s
}

// goLocked runs fn in a new goroutine locked to an OS thread that is not
// the process's main thread, and never unlocked: the thread ends with fn
// (the runtime cannot end the main thread: it would park it, still as fn
// left it). Landing on the main thread, it starts again from there and
// holds the main thread until the new goroutine has locked another.
func goLocked(fn func()) {
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			moved := make(chan struct{})
			goLocked(func() {
				close(moved)
				fn()
			})
			<-moved
			runtime.UnlockOSThread()
			return
		}
		fn()
	}()
}

// fork runs fork on the spawner's thread.
func (s *spawner) fork(fork func() (int, error)) (pid int, err error) {
	done := make(chan struct{})
	s.reqs <- func() { pid, err = fork(); close(done) }
	<-done
	return pid, err
}

// commandSched sets the calling thread's scheduling to what a command
// starts with: nice commandNice, and SCHED_IDLE when idle. Raising the nice
// value and entering SCHED_IDLE need no privilege. A value above
// commandNice (a pooled agent still at the pool's 19, before the host set
// it) cannot be lowered: it stays, and commands inherit it.
func commandSched(idle bool) {
	if prio, err := unix.Getpriority(unix.PRIO_PROCESS, 0); err == nil && 20-prio < commandNice {
		unix.Setpriority(unix.PRIO_PROCESS, 0, commandNice)
	}
	if idle {
		if attr, err := unix.SchedGetAttr(0, 0); err == nil && attr.Policy != unix.SCHED_IDLE {
			unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0)
		}
	}
}
