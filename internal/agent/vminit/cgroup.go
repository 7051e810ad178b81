package vminit

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
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
	if err := os.Mkdir(CommandsCgroup, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("the commands' cgroup: %w", err)
	}
	limit := "max"
	if pids > 0 {
		limit = strconv.FormatInt(pids, 10)
	}
	if err := os.WriteFile(CommandsCgroup+"/pids.max", []byte(limit), 0); err != nil {
		return nil, fmt.Errorf("the commands' pids limit: %w", err)
	}
	return os.OpenFile(CommandsCgroup, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
}
