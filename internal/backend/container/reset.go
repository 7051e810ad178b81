package container

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/layer"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Reset, in place: the sandbox keeps its container (namespaces, cgroups,
// network, limits) and its agent (PID 1); everything else of its state goes.
//
//  1. Every task of its cgroup but the agent is SIGKILLed while the cgroup
//     is frozen (nothing forks meanwhile), and Reset waits until the agent
//     has reaped them.
//  2. A new, empty upper and work directory are made beside the old ones
//     (on the sandbox's own disk image when it has one), and the overlay of
//     the same layers over them is composed as a detached mount.
//  3. On a thread of the node that has entered the container's mount, IPC
//     and UTS namespaces (a thread of its own: unshare(CLONE_FS), never
//     given back to the Go scheduler), the SysV IPC objects are removed,
//     the new root is attached, /proc, /dev, /sys and the agent binary are
//     moved into it, and pivot_root(".", ".") switches the root of every
//     process of the namespace whose root was the old one (the agent's)
//     to it; the old root is detached. /dev/shm and /dev/mqueue (tmpfs and
//     mqueue mounts, not in the upper) are emptied, and the host name is
//     bound in /etc/hosts again (agent.BindHosts).
//  4. The old upper and work directories are removed (their overlay is
//     detached and nothing can reach it).
//
// The handle's "upper" names the new upper: Reset returns the new handle.
// A reset that fails in step 1 or 2 leaves the sandbox as it was but for
// its processes; one that fails in step 3 may leave it without a usable
// root (the node reports the failure; the sandbox is to be deleted).

// resetWait bounds the wait for the killed tasks to be reaped.
const resetWait = 10 * time.Second

var _ sandbox.Resetter = (*Backend)(nil)

// Reset implements sandbox.Resetter.
func (b *Backend) Reset(ctx context.Context, h sandbox.Handle, spec sandbox.Spec) (sandbox.Handle, error) {
	id, err := b.runcID(h)
	if err != nil {
		return h, err
	}
	oldUpper := h.Data["upper"]
	if oldUpper == "" || !filepath.IsAbs(oldUpper) {
		return h, fmt.Errorf("reset sandbox %s: its handle names no writable layer: %w", h.ID, sandbox.ErrUnsupported)
	}
	pid, start, err := b.initProcess(id)
	if err != nil {
		return h, fmt.Errorf("reset sandbox %s: container init: %w", h.ID, err)
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return h, fmt.Errorf("reset sandbox %s: open its init: %w", h.ID, err)
	}
	defer unix.Close(pidfd)
	if now, dead, err := processStart(pid); err != nil || dead || now != start {
		return h, fmt.Errorf("reset sandbox %s: its init (pid %d) is gone: %w", h.ID, pid, sandbox.ErrNotFound)
	}

	// 1. Every process but the agent ends.
	if err := b.killAllBut(ctx, h, id, pid); err != nil {
		return h, fmt.Errorf("reset sandbox %s: %w", h.ID, err)
	}

	// 2. A new writable layer beside the old one.
	parent := filepath.Dir(oldUpper)
	gen, _ := strconv.Atoi(h.Data["reset_gen"])
	gen++
	upper := filepath.Join(parent, upperDir+"."+strconv.Itoa(gen))
	work := filepath.Join(parent, workDir+"."+strconv.Itoa(gen))
	for _, d := range []string{upper, work} {
		if err := os.RemoveAll(d); err != nil {
			return h, fmt.Errorf("reset sandbox %s: %w", h.ID, err)
		}
		if err := os.Mkdir(d, 0o755); err != nil {
			return h, fmt.Errorf("reset sandbox %s: writable layer: %w", h.ID, err)
		}
	}
	fail := func(err error) (sandbox.Handle, error) {
		removeAll(upper, work)
		return h, fmt.Errorf("reset sandbox %s: %w", h.ID, err)
	}
	if err := chownToRoot(upper, h.IDMap); err != nil {
		return fail(err)
	}
	lowers := lowerDirs(spec)
	if err := ensureTmpUpper(lowers, upper, h.IDMap); err != nil {
		return fail(err)
	}
	nsfd := -1
	if h.IDMap != nil {
		nsfd, err = unix.Open("/proc/"+strconv.Itoa(pid)+"/ns/user", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fail(fmt.Errorf("open its user namespace: %w", err))
		}
		defer unix.Close(nsfd)
	}
	mfd, err := layer.ComposeFDMapped(lowers, nsfd, upper, work, true)
	if err != nil {
		return fail(err)
	}
	defer unix.Close(mfd)

	// 3. The switch, in the container's namespaces.
	nsFiles := map[string]int{}
	for _, ns := range []string{"mnt", "ipc", "uts"} {
		fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/ns/"+ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fail(fmt.Errorf("open its %s namespace: %w", ns, err))
		}
		defer unix.Close(fd)
		nsFiles[ns] = fd
	}
	// The namespaces opened are those of the init the pidfd holds.
	if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil {
		return fail(fmt.Errorf("its init (pid %d) is gone: %w", pid, sandbox.ErrNotFound))
	}
	errc := make(chan error, 1)
	go func() {
		// This goroutine's thread enters the sandbox's namespaces and is
		// never given back: it ends with the goroutine (LockOSThread
		// without Unlock).
		runtime.LockOSThread()
		errc <- switchRootIn(nsFiles, mfd)
	}()
	if err := <-errc; err != nil {
		return fail(err)
	}

	// 4. The old writable layer goes.
	for _, p := range []string{oldUpper, filepath.Join(parent, strings.Replace(filepath.Base(oldUpper), upperDir, workDir, 1))} {
		if err := os.RemoveAll(p); err != nil {
			b.log.Warn("reset: remove the old writable layer", "sandbox_id", h.ID, "path", p, "err", err)
		}
	}
	if rootfs := h.Data["rootfs"]; rootfs != "" {
		// A cold sandbox's old root is mounted on the host too.
		if err := layer.Unmount(rootfs); err != nil {
			b.log.Warn("reset: unmount the old root", "sandbox_id", h.ID, "err", err)
		}
	}
	nh := h
	nh.Data = make(map[string]string, len(h.Data)+1)
	for k, v := range h.Data {
		nh.Data[k] = v
	}
	nh.Data["upper"] = upper
	nh.Data["reset_gen"] = strconv.Itoa(gen)
	return nh, nil
}

var _ sandbox.ProcessEnder = (*Backend)(nil)

// EndProcesses implements sandbox.ProcessEnder: every task of the
// sandbox's cgroup but its agent is SIGKILLed (killAllBut).
func (b *Backend) EndProcesses(ctx context.Context, h sandbox.Handle) error {
	id, err := b.runcID(h)
	if err != nil {
		return err
	}
	pid, start, err := b.initProcess(id)
	if err != nil {
		return fmt.Errorf("end the processes of sandbox %s: container init: %w", h.ID, err)
	}
	if now, dead, err := processStart(pid); err != nil || dead || now != start {
		return fmt.Errorf("end the processes of sandbox %s: its init (pid %d) is gone: %w", h.ID, pid, sandbox.ErrNotFound)
	}
	if err := b.killAllBut(ctx, h, id, pid); err != nil {
		return fmt.Errorf("end the processes of sandbox %s: %w", h.ID, err)
	}
	return nil
}

// killAllBut SIGKILLs every task of the sandbox's cgroup but the init pid,
// the cgroup frozen meanwhile, and waits until they are gone.
func (b *Backend) killAllBut(ctx context.Context, h sandbox.Handle, runcID string, init int) error {
	if err := b.Freeze(ctx, h); err != nil {
		return fmt.Errorf("freeze: %w", err)
	}
	pids, err := b.cgroupPids(runcID)
	if err == nil {
		for _, p := range pids {
			if p != init {
				syscall.Kill(p, syscall.SIGKILL)
			}
		}
	}
	if terr := b.Thaw(ctx, h); terr != nil {
		return fmt.Errorf("thaw: %w", terr)
	}
	if err != nil {
		return err
	}
	deadline := time.Now().Add(resetWait)
	for {
		pids, err := b.cgroupPids(runcID)
		if err != nil {
			return err
		}
		left := slices.DeleteFunc(pids, func(p int) bool { return p == init })
		if len(left) == 0 {
			return nil
		}
		// A task forked between the listing and the freeze: kill again.
		for _, p := range left {
			syscall.Kill(p, syscall.SIGKILL)
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("%d processes still there after SIGKILL", len(left))
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// switchRootIn runs on a locked thread that it never unlocks: it enters
// the namespaces and makes the detached mount mfd the root.
func switchRootIn(ns map[string]int, mfd int) error {
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare fs: %w", err)
	}
	for _, n := range []struct {
		name string
		flag int
	}{{"mnt", unix.CLONE_NEWNS}, {"ipc", unix.CLONE_NEWIPC}, {"uts", unix.CLONE_NEWUTS}} {
		if err := unix.Setns(ns[n.name], n.flag); err != nil {
			return fmt.Errorf("enter the sandbox's %s namespace: %w", n.name, err)
		}
	}
	if err := removeSysVIPC(); err != nil {
		return err
	}
	// The mount point, made in the old root (its upper goes).
	var rnd [8]byte
	rand.Read(rnd[:])
	at := "/.shoal-reset-" + hex.EncodeToString(rnd[:])
	if err := unix.Mkdir(at, 0o700); err != nil {
		return fmt.Errorf("mount point for the new root: %w", err)
	}
	if err := agent.SwitchRoot(mfd, at); err != nil {
		return err
	}
	for _, d := range []string{"/dev/shm", "/dev/mqueue"} {
		if err := emptyDir(d); err != nil {
			return err
		}
	}
	var uts unix.Utsname
	if err := unix.Uname(&uts); err == nil {
		if err := agent.BindHosts(unix.ByteSliceToString(uts.Nodename[:])); err != nil {
			return fmt.Errorf("bind /etc/hosts: %w", err)
		}
	}
	return nil
}

// emptyDir removes what is in dir (a mount of the sandbox's own, such as
// /dev/shm), if it exists, without following symbolic links.
func emptyDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("empty %s: %w", dir, err)
	}
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return fmt.Errorf("empty %s: %w", dir, err)
		}
	}
	return nil
}

// removeSysVIPC removes every SysV shared memory segment, semaphore set
// and message queue of the calling thread's IPC namespace (as listed in
// its /proc/sysvipc, which shows the reader's namespace).
func removeSysVIPC() error {
	for _, k := range []struct {
		file string
		rm   func(id int) error
	}{
		{"shm", func(id int) error { _, err := unix.SysvShmCtl(id, unix.IPC_RMID, nil); return err }},
		{"sem", func(id int) error {
			_, _, e := unix.Syscall6(unix.SYS_SEMCTL, uintptr(id), 0, unix.IPC_RMID, 0, 0, 0)
			return errnoErr(e)
		}},
		{"msg", func(id int) error {
			_, _, e := unix.Syscall(unix.SYS_MSGCTL, uintptr(id), unix.IPC_RMID, 0)
			return errnoErr(e)
		}},
	} {
		data, err := os.ReadFile("/proc/sysvipc/" + k.file)
		if err != nil {
			return fmt.Errorf("list SysV IPC: %w", err)
		}
		lines := strings.Split(string(data), "\n")
		for _, l := range lines[1:] { // a header first
			f := strings.Fields(l)
			if len(f) < 2 {
				continue
			}
			id, err := strconv.Atoi(f[1])
			if err != nil {
				continue
			}
			if err := k.rm(id); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.EIDRM) {
				return fmt.Errorf("remove SysV %s %d: %w", k.file, id, err)
			}
		}
	}
	return nil
}

func errnoErr(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}
