package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/cgroups"
	"github.com/shoal-sandbox/shoal/internal/procfs"
)

// cgroupMount is one mounted cgroup hierarchy (cgroups.Mount).
type cgroupMount struct {
	dir     string   // mount point, e.g. /sys/fs/cgroup/memory
	v2      bool     // cgroup2 (the unified hierarchy)
	options []string // super options: the v1 controllers, "name=systemd", ...
}

// cgroupMounts lists the cgroup hierarchies mounted in our mount namespace.
func cgroupMounts() ([]cgroupMount, error) {
	ms, err := cgroups.Mounts()
	mounts := make([]cgroupMount, len(ms))
	for i, m := range ms {
		mounts[i] = cgroupMount{dir: m.Dir, v2: m.V2, options: m.Options}
	}
	return mounts, err
}

// cgroupMounts returns the host's cgroup hierarchies, read once (they are
// mounted at boot, and reading mountinfo on every create and delete cost
// the node ~0.5 ms of CPU each time), the pids and freezer hierarchies
// first. The slice is shared: callers must not modify it.
func (b *Backend) cgroupMounts() ([]cgroupMount, error) {
	b.cgroupOnce.Do(func() {
		b.cgroups, b.cgroupsErr = cgroupMounts()
		rank := func(m cgroupMount) int {
			switch {
			case slices.Contains(m.options, "pids"):
				return 0
			case slices.Contains(m.options, "freezer"):
				return 1
			case m.v2:
				return 3
			}
			return 2
		}
		slices.SortStableFunc(b.cgroups, func(a, b cgroupMount) int { return rank(a) - rank(b) })
	})
	return b.cgroups, b.cgroupsErr
}

var unescapeMountinfo = procfs.UnescapeMountinfo

// cgroupDirs returns the sandbox's cgroup directory in every hierarchy,
// whether or not it exists; the pids and freezer hierarchies come first,
// and a best-effort sandbox's group under the idle parent (see idleParent)
// last; in the v1 cpu hierarchy its commands' group (commandsGroup) comes
// before its own.
func (b *Backend) cgroupDirs(id string) ([]string, error) {
	mounts, err := b.cgroupMounts()
	if err != nil {
		return nil, err
	}
	dirs := make([]string, 0, len(mounts)+3)
	for _, m := range mounts {
		if isV1CPU(m) { // its commands' group first: it goes first
			dirs = append(dirs, filepath.Join(m.dir, b.cgroupParent, id, commandsGroupName))
		}
		dirs = append(dirs, filepath.Join(m.dir, b.cgroupParent, id))
	}
	for _, m := range mounts {
		if isV1CPU(m) {
			dirs = append(dirs, filepath.Join(m.dir, b.idleParent(), id, commandsGroupName),
				filepath.Join(m.dir, b.idleParent(), id))
		}
	}
	return dirs, nil
}

// isV1CPU tells whether m is the cgroup v1 hierarchy of the cpu controller.
func isV1CPU(m cgroupMount) bool { return !m.v2 && slices.Contains(m.options, "cpu") }

// isV1Freezer tells whether m is the cgroup v1 hierarchy of the freezer.
func isV1Freezer(m cgroupMount) bool { return !m.v2 && slices.Contains(m.options, "freezer") }

// killCgroup SIGKILLs every task of the sandbox's cgroup, thaws it if it is
// frozen (frozen tasks do not die) and waits until they have exited. It is
// faster than `runc delete --force`, which sleeps 100 ms after its SIGKILL.
// The container has its own PID namespace, so a task forked meanwhile dies
// with its init; a few rounds catch tasks that entered by other means.
func (b *Backend) killCgroup(ctx context.Context, id string) error {
	dirs, err := b.cgroupDirs(id)
	if err != nil {
		return err
	}
	var procs string
	for _, d := range dirs {
		if _, err := os.Stat(d); err == nil {
			procs = filepath.Join(d, "cgroup.procs")
			break
		}
	}
	if procs == "" {
		return nil // no cgroup: nothing runs
	}
	for range 5 {
		pids, err := readPids(procs)
		if errors.Is(err, os.ErrNotExist) || (err == nil && len(pids) == 0) {
			return nil
		}
		if err != nil {
			return err
		}
		var pidfds []int
		for _, pid := range pids {
			fd, err := unix.PidfdOpen(pid, 0)
			if errors.Is(err, unix.ESRCH) {
				continue
			}
			if err != nil {
				closeAll(pidfds)
				return fmt.Errorf("pidfd_open %d: %w", pid, err)
			}
			pidfds = append(pidfds, fd)
			if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
				closeAll(pidfds)
				return fmt.Errorf("kill %d: %w", pid, err)
			}
		}
		b.thawToKill(id)
		err = waitPidfds(ctx, pidfds)
		closeAll(pidfds)
		if err != nil {
			return err
		}
	}
	return fmt.Errorf("tasks keep appearing in %s", procs)
}

// thawToKill thaws the sandbox's cgroup (frozen tasks do not die). One
// write to its freezer, whatever its state (thawing a thawed cgroup does
// nothing): reading both freezer files in each of the sandbox's dozen
// cgroup directories cost a delete ~0.6 ms of CPU in a burst.
func (b *Backend) thawToKill(id string) {
	if f, err := b.freezer(id); err == nil {
		f.thaw()
	}
}

var readPids = cgroups.ReadPids

// waitPidfds waits until every process behind pidfds has exited.
func waitPidfds(ctx context.Context, pidfds []int) error {
	pfds := make([]unix.PollFd, len(pidfds))
	for i, fd := range pidfds {
		pfds[i] = unix.PollFd{Fd: int32(fd), Events: unix.POLLIN}
	}
	for len(pfds) > 0 {
		timeout := 1000
		if dl, ok := ctx.Deadline(); ok {
			timeout = int(min(time.Until(dl), time.Second).Milliseconds())
		}
		if err := ctx.Err(); err != nil || timeout <= 0 {
			return fmt.Errorf("wait for %d tasks to exit: %w", len(pfds), context.DeadlineExceeded)
		}
		if _, err := unix.Poll(pfds, timeout); err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("poll pidfds: %w", err)
		}
		pfds = slices.DeleteFunc(pfds, func(p unix.PollFd) bool { return p.Revents != 0 })
	}
	return nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// removeCgroups removes the sandbox's cgroup directories that the runtime
// left behind and fails if one cannot be removed.
func (b *Backend) removeCgroups(id string) error {
	dirs, err := b.cgroupDirs(id)
	if err != nil {
		return err
	}
	var errs []error
	for _, d := range dirs {
		errs = append(errs, cgroups.Remove(d, 5*time.Second))
	}
	return errors.Join(errs...)
}

// setParentPidsMax writes pids.max of the parent cgroup of all sandboxes in
// every hierarchy that has the pids controller (v1 "pids", or v2 when it is
// enabled for us), creating the parent if no sandbox made it yet.
func (b *Backend) setParentPidsMax(n int64) error {
	mounts, err := b.cgroupMounts()
	if err != nil {
		return err
	}
	set := false
	for _, m := range mounts {
		if !m.v2 && !slices.Contains(m.options, "pids") {
			continue
		}
		dir := filepath.Join(m.dir, b.cgroupParent)
		if m.v2 {
			if _, err := os.Stat(filepath.Join(dir, "pids.max")); err != nil {
				continue // the controller is not enabled for us
			}
		} else if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.FormatInt(n, 10)), 0); err != nil {
			return fmt.Errorf("set %s/pids.max: %w", dir, err)
		}
		set = true
	}
	if !set {
		return errors.New("no pids cgroup controller")
	}
	return nil
}
