package agent

// The commands' cgroup of a VM's guest (Config.CommandsCgroup).
//
// In a VM the agent is its guest's init, and the guest's kernel is the
// sandbox's own: the host's cgroups bound QEMU, not the guest's tasks. So
// the guest's init (vminit) makes a cgroup v2 group for the commands, with
// the sandbox's pids limit, and every command is born in it (clone3's
// CLONE_INTO_CGROUP: no moment outside it). The agent stays in the root
// group, above the limit: a fork bomb at the limit cannot keep the agent
// from forking its own threads or from killing it. An export of the
// writable layer (commit.go) freezes the group (cgroup.freeze): its
// processes stop where they are, with no signal they could see (a
// SIGSTOP and SIGCONT reach a process's handlers and a shell's job
// control), and a command started meanwhile is born frozen. The workload
// is root in its guest and may move its processes out of the group or lift
// the limit: the bound is against runaway programs, not against the
// guest's own root (the VM is the boundary the host relies on); a process
// found outside the group is stopped with SIGSTOP for the export, as
// before the group existed.

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/procfs"
)

// sysProcAttr completes a command's attributes with what every command of
// s gets: its birth in the commands' cgroup, if there is one.
func (s *Server) sysProcAttr(a *syscall.SysProcAttr) *syscall.SysProcAttr {
	if s.cfg.CommandsCgroup != nil {
		a.UseCgroupFD = true
		a.CgroupFD = int(s.cfg.CommandsCgroup.Fd())
	}
	return a
}

// freezeWait bounds how long an export waits for the commands' group to
// report itself frozen (a task in an uninterruptible sleep freezes when it
// returns from it); the export goes on either way, as it does when a
// process does not stop.
var freezeWait = 5 * time.Second

// stopWorkload stops the guest's workload for an export and returns the
// function that lets it go on.
func (s *Server) stopWorkload() (cont func(), err error) {
	if s.cfg.CommandsCgroup == nil {
		return stopOthers(s.cfg.SystemService)
	}
	thaw, err := freezeCgroup(s.cfg.CommandsCgroup, freezeWait)
	if err != nil {
		return nil, err
	}
	if os.Getpid() != 1 && !s.cfg.SystemService {
		return thaw, nil // tests: the host's other processes are not ours
	}
	contOut := stopOutside(s.cfg.CommandsCgroupPath)
	return func() { contOut(); thaw() }, nil
}

// freezeCgroup freezes the cgroup v2 group open as dir and waits, at most
// wait, until the kernel reports it frozen (cgroup.events); thaw undoes
// it. A freeze that was on before (the guest's own) is left on.
func freezeCgroup(dir *os.File, wait time.Duration) (thaw func(), err error) {
	was, err := cgroupFileAt(dir, "cgroup.freeze")
	if err != nil {
		return nil, err
	}
	if strings.TrimSpace(was) == "1" {
		return func() {}, nil
	}
	if err := writeCgroupAt(dir, "cgroup.freeze", "1"); err != nil {
		return nil, err
	}
	thaw = func() { writeCgroupAt(dir, "cgroup.freeze", "0") }
	deadline := time.Now().Add(wait)
	for {
		ev, err := cgroupFileAt(dir, "cgroup.events")
		if err != nil {
			thaw()
			return nil, err
		}
		if cgroupKey(ev, "frozen") == "1" || time.Now().After(deadline) {
			return thaw, nil
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// cgroupKey returns the value of key in a flat-keyed cgroup file ("key
// value" lines).
func cgroupKey(doc, key string) string {
	for line := range strings.Lines(doc) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), " "); ok && k == key {
			return v
		}
	}
	return ""
}

func cgroupFileAt(dir *os.File, name string) (string, error) {
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return "", fmt.Errorf("cgroup %s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	var b bytes.Buffer
	if _, err := b.ReadFrom(f); err != nil {
		return "", fmt.Errorf("cgroup %s: %w", name, err)
	}
	return b.String(), nil
}

func writeCgroupAt(dir *os.File, name, value string) error {
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("cgroup %s: %w", name, err)
	}
	defer unix.Close(fd)
	if _, err := unix.Write(fd, []byte(value)); err != nil {
		return fmt.Errorf("cgroup %s: write %q: %w", name, value, err)
	}
	return nil
}

// inCgroup tells whether process pid is in the cgroup v2 group path or
// one below it (its /proc/PID/cgroup "0::" line).
func inCgroup(pid int, path string) bool {
	g, err := procfs.Cgroup2(strconv.Itoa(pid))
	return err == nil && (g == path || strings.HasPrefix(g, path+"/"))
}

// stopOutside stops with SIGSTOP every process of the guest outside the
// cgroup path but init, the agent and kernel threads, and those stopped
// already; it waits (bounded) until they are stopped and returns the
// function that continues them, the youngest first. Each pass stops what
// the one before found still running (a process forked meanwhile), up to
// a bound.
func stopOutside(path string) (cont func()) {
	var stopped []procInfo
	seen := map[string]bool{}
	deadline := time.Now().Add(5 * time.Second)
	for pass := 0; pass < 100 && time.Now().Before(deadline); pass++ {
		running := false
		for _, p := range listProcs() {
			if p.pid == 1 || p.kthread || strings.ContainsRune("TtZXx", rune(p.state)) || inCgroup(p.pid, path) {
				continue
			}
			running = true
			if !seen[p.key()] {
				seen[p.key()] = true
				if unix.Kill(p.pid, unix.SIGSTOP) == nil {
					stopped = append(stopped, p)
				}
			}
		}
		if !running {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	return func() {
		// Those whose pid is not another process's by now.
		continueYoungestFirst(slices.DeleteFunc(stopped, func(p procInfo) bool {
			q, ok := readProc(p.pid)
			return !ok || q.start != p.start
		}))
	}
}
