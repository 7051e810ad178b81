package vminit

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/procfs"
)

// The guest's cgroups: Boot mounts the cgroup v2 hierarchy at CgroupRoot
// (where a system has it) and makes the group CommandsCgroup, which every
// command is born in, with the pids controller and the sandbox's pids
// limit (Config.Pids); the agent stays in the root group, above the limit
// (agent/cgroup.go says why and what the workload, root in its guest, can
// still do).
// (CommandsCgroupPath is its path in the hierarchy, as /proc/PID/cgroup
// shows it.)
const (
	CgroupRoot         = "/sys/fs/cgroup"
	CommandsCgroupPath = "/cmds"
	CommandsCgroup     = CgroupRoot + CommandsCgroupPath
)

// commandsCgroup mounts the hierarchy, makes CommandsCgroup with pids.max
// pids (0: "max") and returns it open.
func commandsCgroup(pids int64) (*os.File, error) {
	if pids < 0 {
		return nil, fmt.Errorf("config: pids limit %d", pids)
	}
	if err := os.MkdirAll(CgroupRoot, 0o755); err != nil {
		return nil, err
	}
	if err := unix.Mount("cgroup2", CgroupRoot, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil && !errors.Is(err, unix.EBUSY) {
		return nil, fmt.Errorf("mount the cgroup hierarchy: %w", err)
	}
	if err := os.WriteFile(CgroupRoot+"/cgroup.subtree_control", []byte("+pids"), 0); err != nil {
		return nil, fmt.Errorf("enable the pids controller: %w", err)
	}
	return makeCommandsGroup(CommandsCgroup, pids)
}

// makeCommandsGroup makes the group dir with pids.max pids (0: "max") and
// returns it open.
func makeCommandsGroup(dir string, pids int64) (*os.File, error) {
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("the commands' cgroup: %w", err)
	}
	limit := "max"
	if pids > 0 {
		limit = strconv.FormatInt(pids, 10)
	}
	if err := os.WriteFile(dir+"/pids.max", []byte(limit), 0); err != nil {
		return nil, fmt.Errorf("the commands' pids limit: %w", err)
	}
	return os.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
}

// A full system's agent is a service of its systemd, which owns the
// guest's cgroups; the initramfs's agent gives the service the pids
// controller of its own cgroup's subtree (a drop-in in /run: Delegate=,
// serviceDropIn), and the service makes the commands' group there
// (ServiceCgroup): SERVICE/agent for itself (a group with children has no
// processes of its own) and SERVICE/cmds, as a microVM's /cmds.
const (
	serviceDropInDir = "/run/systemd/system/shoal-agent.service.d"
	serviceDropIn    = "[Service]\nDelegate=pids\n"
)

// ServiceCgroup makes the commands' group of a full system's agent below
// the service's own cgroup, moves the agent into a sibling, and returns
// the group open and its path in the hierarchy.
func ServiceCgroup(pids int64) (*os.File, string, error) {
	if pids < 0 {
		return nil, "", fmt.Errorf("config: pids limit %d", pids)
	}
	own, err := procfs.Cgroup2("self")
	if err != nil {
		return nil, "", err
	}
	if own == "/" {
		return nil, "", errors.New("the service runs in the root cgroup (not delegated)")
	}
	dir := CgroupRoot + own
	if err := os.Mkdir(dir+"/agent", 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, "", fmt.Errorf("the agent's cgroup: %w", err)
	}
	if err := os.WriteFile(dir+"/agent/cgroup.procs", []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		return nil, "", fmt.Errorf("move the agent into its cgroup: %w", err)
	}
	if err := os.WriteFile(dir+"/cgroup.subtree_control", []byte("+pids"), 0); err != nil {
		return nil, "", fmt.Errorf("enable the pids controller (is the service's unit delegated?): %w", err)
	}
	f, err := makeCommandsGroup(dir+"/cmds", pids)
	if err != nil {
		return nil, "", err
	}
	return f, own + "/cmds", nil
}
