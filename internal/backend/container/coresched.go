package container

import (
	"fmt"
	"os"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Core scheduling (prctl PR_SCHED_CORE, Linux 5.14 built with
// CONFIG_SCHED_CORE): tasks whose cookies differ never run at the same
// time on the hardware threads of one core. A latency-sensitive sandbox
// gets a cookie of its own, inherited by everything it starts, so no other
// sandbox's task (a best-effort burner's above all) shares its core while
// it runs: it keeps the whole core's speed, and no SMT side channel
// reaches it from another sandbox. A host without SMT has nothing to
// share, and a kernel without it cannot: the node says which at start.
const (
	prSchedCore       = 62 // PR_SCHED_CORE
	prSchedCoreGet    = 0
	prSchedCoreCreate = 1
	pidtypeTGID       = 1 // PIDTYPE_TGID: the whole thread group
)

// probeCoreSched tells whether core scheduling can be used here, and why
// not if it cannot.
func probeCoreSched() (bool, string) {
	var cookie uint64
	_, _, errno := unix.Syscall6(unix.SYS_PRCTL, prSchedCore, prSchedCoreGet, 0, pidtypeTGID, uintptr(unsafe.Pointer(&cookie)), 0)
	switch errno {
	case 0:
	case unix.EINVAL:
		return false, "the kernel has no core scheduling (CONFIG_SCHED_CORE)"
	default:
		return false, fmt.Sprintf("prctl(PR_SCHED_CORE_GET): %v", errno)
	}
	if !smtActive() {
		return false, "no SMT on this host (one hardware thread per core): nothing to isolate"
	}
	return true, ""
}

// smtActive reads /sys/devices/system/cpu/smt/active (absent: assume one
// thread per core unless the topology says otherwise).
func smtActive() bool {
	if b, err := os.ReadFile("/sys/devices/system/cpu/smt/active"); err == nil {
		return strings.TrimSpace(string(b)) == "1"
	}
	b, err := os.ReadFile("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
	return err == nil && strings.ContainsAny(strings.TrimSpace(string(b)), ",-")
}

// setCoreCookie gives the process whose pid is in pidFile (a latency-
// sensitive sandbox's agent, before anything of the workload runs) and its
// threads a core scheduling cookie of their own, which what it starts
// inherits.
func setCoreCookie(pidFile string) error {
	pid, err := readPidFile(pidFile)
	if err != nil {
		return err
	}
	_, _, errno := unix.Syscall6(unix.SYS_PRCTL, prSchedCore, prSchedCoreCreate, uintptr(pid), pidtypeTGID, 0, 0)
	if errno != 0 {
		return fmt.Errorf("core scheduling cookie for pid %d: %w", pid, errno)
	}
	return nil
}
