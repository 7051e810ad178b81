package container

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/forkserver"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// The native launcher (Config.Launcher = LauncherNative).
//
// A pool container costs a `runc run`: runc's own start, its config, a
// re-executed `runc init` (a second Go runtime, and nsexec's clones), the
// mounts, then the agent's exec; about 25 ms of CPU on a 2-core host, most
// of it runc starting twice. The native launcher starts the agent binary
// itself, with the same namespaces (clone flags, the user namespace's maps
// written by Go's exec as runc writes them), puts it into the container's
// cgroups (created and limited here, as runc does for the same spec:
// memory and memory+swap, pids, CPU weight, the devices list runc allows,
// cpuset copied from the parent), sets its NOFILE limit, and lets the agent
// do the rest of `runc init`'s work before it executes itself inside the
// container (agent.NativeInit: cgroup namespace, the same mounts, pivot,
// masked and read-only paths, host name, lo, capability bounding set).
// The result is checked against a runc pool container by
// TestNativeLikeRunc; claims, seccomp and everything after are the same
// code for both launchers.
//
// Only pool containers are started natively; with the native launcher a
// create that finds the pool empty starts one and claims it at once
// instead of running runc around its root. The container has no runc state:
// the launcher records its init's pid and start time in
// PoolDir/native/<runc id>.json (what Recover, the agent log and egress read
// from runc's state otherwise), and Delete kills it through its cgroups.
const (
	LauncherRunc   = "runc"
	LauncherNative = "native"
	nativeStateDir = "native"
)

// devicesAllowed is what runc (1.1) allows in a container's devices cgroup
// besides the spec's (which denies all): mknod of any node, and the nodes
// it sets up in /dev.
var devicesAllowed = []string{
	"c *:* m", "b *:* m",
	"c 1:3 rwm", "c 1:8 rwm", "c 1:7 rwm", "c 5:0 rwm", "c 1:5 rwm", "c 1:9 rwm",
	"c 136:* rwm", "c 5:2 rwm", "c 10:200 rwm",
}

// nativeState is what the native launcher records of a container.
type nativeState struct {
	Pid   int    `json:"init_process_pid"`
	Start uint64 `json:"init_process_start"`
}

func (b *Backend) nativeStatePath(id string) string {
	return filepath.Join(b.poolDir, nativeStateDir, id+".json")
}

// isNative reports whether id was started by the native launcher and not
// yet destroyed.
func (b *Backend) isNative(id string) bool {
	_, err := os.Stat(b.nativeStatePath(id))
	return err == nil
}

// known reports whether a container id exists, for either launcher.
func (b *Backend) known(id string) bool {
	return b.hasState(id) || b.isNative(id)
}

// nativeAlive reports whether the init of native container id still runs.
func (b *Backend) nativeAlive(id string) (bool, error) {
	pid, start, err := b.initProcess(id)
	if err != nil {
		return false, err
	}
	now, dead, err := processStart(pid)
	if err != nil {
		return false, err
	}
	return !dead && now == start, nil
}

// unmountAgentBind removes the host's bind of the agent binary in the
// blank root of the container dir dir, which a node that died while
// starting a native container itself (without its fork server, whose bind
// dies with it) leaves behind.
func unmountAgentBind(dir string) {
	p := filepath.Join(dir, blankRoot, ".shoal", "agent")
	for range 4 {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
			return // EINVAL: not a mount point (any more); ENOENT: no file
		}
	}
}

// capMask turns capability names into a bit mask.
func capMask(names []string) (uint64, error) {
	var m uint64
	for _, n := range names {
		c, ok := capNumbers[n]
		if !ok {
			return 0, fmt.Errorf("unknown capability %s", n)
		}
		m |= 1 << c
	}
	return m, nil
}

var capNumbers = map[string]int{
	"CAP_CHOWN": unix.CAP_CHOWN, "CAP_DAC_OVERRIDE": unix.CAP_DAC_OVERRIDE, "CAP_FSETID": unix.CAP_FSETID,
	"CAP_FOWNER": unix.CAP_FOWNER, "CAP_MKNOD": unix.CAP_MKNOD, "CAP_NET_RAW": unix.CAP_NET_RAW,
	"CAP_SETGID": unix.CAP_SETGID, "CAP_SETUID": unix.CAP_SETUID, "CAP_SETFCAP": unix.CAP_SETFCAP,
	"CAP_SETPCAP": unix.CAP_SETPCAP, "CAP_NET_BIND_SERVICE": unix.CAP_NET_BIND_SERVICE,
	"CAP_SYS_CHROOT": unix.CAP_SYS_CHROOT, "CAP_KILL": unix.CAP_KILL, "CAP_AUDIT_WRITE": unix.CAP_AUDIT_WRITE,
	"CAP_SYS_ADMIN": unix.CAP_SYS_ADMIN,
}

// nativeCgroups creates the container's cgroups with a pool container's
// limits and returns the v1 directories to bind inside it (NAME=PATH).
func (b *Backend) nativeCgroups(id string, urgent bool) ([]string, error) {
	mounts, err := b.cgroupMounts()
	if err != nil {
		return nil, err
	}
	var binds []string
	for _, m := range mounts {
		dir := filepath.Join(m.dir, b.cgroupParent, id)
		if m.v2 {
			// A hybrid host's v2 hierarchy (systemd's, no controllers) or
			// a v2 host: the container needs its own cgroup there too.
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return nil, fmt.Errorf("create cgroup: %w", err)
			}
			continue
		}
		if slices.Contains(m.options, "cpuset") {
			if err := mkCpuset(m.dir, filepath.Join(b.cgroupParent, id)); err != nil {
				return nil, err
			}
		} else if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("create cgroup: %w", err)
		}
		if slices.Contains(m.options, "devices") {
			if err := writeCgroup(filepath.Join(dir, "devices.deny"), "a"); err != nil {
				return nil, err
			}
			for _, d := range devicesAllowed {
				if err := writeCgroup(filepath.Join(dir, "devices.allow"), d); err != nil {
					return nil, err
				}
			}
		}
		binds = append(binds, filepath.Base(m.dir)+"="+dir)
	}
	if err := b.setLimits(id, sandbox.Resources{}); err != nil {
		return nil, err
	}
	if !urgent {
		// The lowest CPU weight until the claim, as containerSpec asks runc.
		for _, m := range mounts {
			dir := filepath.Join(m.dir, b.cgroupParent, id)
			switch {
			case m.v2:
				if err := writeIfExists(filepath.Join(dir, "cpu.weight"), "1"); err != nil {
					return nil, err
				}
			case slices.Contains(m.options, "cpu"):
				if err := writeCgroup(filepath.Join(dir, "cpu.shares"), strconv.Itoa(poolCPUShares)); err != nil {
					return nil, err
				}
			}
		}
	}
	return binds, nil
}

// mkCpuset creates rel under the cpuset hierarchy at root, each new level
// with its parent's cpus and mems (a v1 cpuset starts empty, and refuses
// tasks until they are set).
func mkCpuset(root, rel string) error {
	dir := root
	for _, part := range strings.Split(rel, "/") {
		parent := dir
		dir = filepath.Join(dir, part)
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("create cgroup: %w", err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			cur, err := os.ReadFile(filepath.Join(dir, f))
			if err != nil {
				return fmt.Errorf("read %s: %w", filepath.Join(dir, f), err)
			}
			if strings.TrimSpace(string(cur)) != "" {
				continue
			}
			val, err := os.ReadFile(filepath.Join(parent, f))
			if err != nil {
				return fmt.Errorf("read %s: %w", filepath.Join(parent, f), err)
			}
			if err := writeCgroup(filepath.Join(dir, f), strings.TrimSpace(string(val))); err != nil {
				return err
			}
		}
	}
	return nil
}

// startNative starts the pool container id over the blank root natively
// and waits until its agent is ready (see the top of the file). The caller
// destroys the container if this fails.
func (b *Backend) startNative(ctx context.Context, id, dir, root, agentBinary string, ln *os.File, idmap *sandbox.IDMap, caps []string, urgent bool) error {
	keep, err := capMask(caps)
	if err != nil {
		return err
	}
	nofile, err := nofileLimit(b.nofile)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(b.poolDir, nativeStateDir), 0o700); err != nil {
		return err
	}
	// Mount points in the blank root, the container root's.
	for _, d := range []string{"proc", "dev", "sys", ".shoal/agent"} {
		p := filepath.Join(root, d)
		var err error
		if d == ".shoal/agent" {
			err = os.WriteFile(p, nil, 0o755)
		} else {
			err = os.Mkdir(p, 0o755)
		}
		if err == nil {
			err = chownToRoot(p, idmap)
		}
		if err != nil {
			return fmt.Errorf("mount point %s: %w", d, err)
		}
	}
	binds, err := b.nativeCgroups(id, urgent)
	if err != nil {
		return err
	}
	// The agent binary, read-only in the blank root: the clone copies this
	// mount into the container's mount namespace (spawn binds it where the
	// clone happens).
	// From the backend's private copy: its path in mountinfo says nothing
	// of the host (agentcopy.go).
	agentCopy, err := b.agents.path(agentBinary)
	if err != nil {
		return err
	}
	agentMount := &forkserver.Bind{Source: agentCopy, Target: filepath.Join(root, ".shoal", "agent")}

	devNull, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer devNull.Close()
	// Executed and bound through this descriptor: the container's root
	// may not be able to reach the binary's path.
	agentFile, err := os.Open(agentCopy)
	if err != nil {
		return fmt.Errorf("open agent binary: %w", err)
	}
	defer agentFile.Close()
	logPath := filepath.Join(dir, agentLogName)
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("ready pipe: %w", err)
	}
	defer readyR.Close()
	defer readyW.Close()
	syncR, syncW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("start pipe: %w", err)
	}
	defer syncR.Close()
	defer syncW.Close()
	logR, logW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("log pipe: %w", err)
	}
	drain, err := drainAgentLog(logR, logPath)
	if err != nil {
		logW.Close()
		return fmt.Errorf("agent log: %w", err)
	}
	b.drains.add(id, drain)
	extra := b.agentFiles(ln, readyW, true)
	fdEnv := []string{
		"SHOAL_AGENT_FD=" + strconv.Itoa(fdSocket),
		agent.EnvReadyFD + "=" + strconv.Itoa(b.readyFD()),
		agent.EnvPool + "=1",
	}
	if b.filter != nil {
		fdEnv = append(fdEnv, agent.EnvSeccompFD+"="+strconv.Itoa(fdSeccomp))
	}
	if b.lifeline != nil {
		fdEnv = append(fdEnv, agent.EnvLifeline+"="+strconv.Itoa(b.readyFD()+1))
	}
	extra = append(extra, syncR)
	syncFD := 2 + len(extra)
	extra = append(extra, agentFile)
	agentFD := 2 + len(extra)
	fdEnv = append(fdEnv,
		agent.EnvNativeInit+"="+strconv.Itoa(syncFD),
		agent.EnvNativeRoot+"="+root,
		agent.EnvNativeAgent+"="+strconv.Itoa(agentFD),
		agent.EnvNativeHostname+"=pool",
		agent.EnvNativeCaps+"="+strconv.FormatUint(keep, 16),
		agent.EnvNativeCgroups+"="+strings.Join(binds, "\n"),
		agent.EnvNativeMasked+"="+strings.Join(dockerMaskedPaths, "\n"),
		agent.EnvNativeReadonly+"="+strings.Join(dockerReadonlyPaths, "\n"),
	)
	cmd := &exec.Cmd{
		Path:       "/proc/self/fd/" + strconv.Itoa(agentFD),
		Args:       []string{agentPath},
		Env:        mergeEnv(baseEnv, fdEnv),
		Dir:        "/",
		Stdin:      devNull,
		Stdout:     devNull,
		Stderr:     logW,
		ExtraFiles: extra,
		SysProcAttr: &syscall.SysProcAttr{
			Setsid:     true,
			Cloneflags: unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS | unix.CLONE_NEWNET,
		},
	}
	if idmap != nil {
		cmd.SysProcAttr.Cloneflags |= unix.CLONE_NEWUSER
		cmd.SysProcAttr.UidMappings, cmd.SysProcAttr.GidMappings = idMaps(*idmap)
		cmd.SysProcAttr.GidMappingsEnableSetgroups = true
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: 0, Gid: 0}
	}
	nice := 19
	if urgent {
		nice = 0
	}
	pid, kill, release, err := b.spawn(ctx, cmd, agentBinary, agentMount, nice)
	logW.Close() // now only the container holds it
	syncR.Close()
	if err != nil {
		drain.settle(time.Second)
		return fmt.Errorf("start agent: %w", err)
	}
	defer release()
	fail := func(err error) error {
		kill()
		return err
	}
	// Into its cgroups before it does anything.
	mounts, err := b.cgroupMounts()
	if err != nil {
		return fail(err)
	}
	for _, m := range mounts {
		if err := writeCgroup(filepath.Join(m.dir, b.cgroupParent, id, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
			return fail(err)
		}
	}
	rl := unix.Rlimit{Cur: nofile, Max: nofile}
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &rl, nil); err != nil {
		return fail(fmt.Errorf("set NOFILE limit: %w", err))
	}
	start, dead, err := processStart(pid)
	if err == nil && dead {
		err = errors.New("exited")
	}
	if err != nil {
		return fail(fmt.Errorf("agent: %w", err))
	}
	st, _ := json.Marshal(nativeState{Pid: pid, Start: start})
	if err := os.WriteFile(b.nativeStatePath(id), st, 0o600); err != nil {
		return fail(err)
	}
	if err := os.WriteFile(filepath.Join(dir, pidFileName), []byte(strconv.Itoa(pid)), 0o600); err != nil {
		return fail(err)
	}
	if _, err := syncW.Write([]byte{1}); err != nil {
		return fail(fmt.Errorf("start agent: %w", err))
	}
	readyW.Close() // now only the agent holds it: EOF if it dies
	if err := waitReady(ctx, readyR); err != nil {
		drain.settle(time.Second)
		return fail(fmt.Errorf("agent: %w: %s", err, tail(logPath, 0)))
	}
	return nil
}

// spawn starts cmd at the given nice value, with bind (read-only) in the
// mount namespace it is cloned from, and returns its pid, a function that
// kills it and one that releases what pins it. The fork server of
// agentBinary starts it (forkserver: a child in a user namespace of its
// own would make the node fork without vfork, and the server reaps every
// child in one thread where the node would block one per agent; the
// server's mount namespace holds none of the node's sandboxes' mounts,
// which a child would copy); with os/exec when there is no fork server.
func (b *Backend) spawn(ctx context.Context, cmd *exec.Cmd, agentBinary string, bind *forkserver.Bind, nice int) (pid int, kill, release func(), err error) {
	attr := cmd.SysProcAttr
	if attr == nil {
		attr = &syscall.SysProcAttr{}
	}
	files := []*os.File{}
	for _, s := range []any{cmd.Stdin, cmd.Stdout, cmd.Stderr} {
		f, ok := s.(*os.File)
		if !ok {
			return 0, nil, nil, errors.New("spawn: stdio must be files")
		}
		files = append(files, f)
	}
	files = append(files, cmd.ExtraFiles...)

	req := forkserver.Request{
		Path: cmd.Path, Args: cmd.Args, Env: cmd.Env, Dir: cmd.Dir,
		Setsid: attr.Setsid, Cloneflags: attr.Cloneflags,
		UidMappings: attr.UidMappings, GidMappings: attr.GidMappings,
		GidMappingsEnableSetgroups: attr.GidMappingsEnableSetgroups,
		Credential:                 attr.Credential,
		Nice:                       nice,
		Bind:                       bind, // made by the server, in its namespace, for this start
	}
	p, err := b.forkServer(agentBinary).Start(ctx, req, files)
	if errors.Is(err, forkserver.ErrUnavailable) {
		b.log.Warn("no fork server: the node starts the agent itself", "err", err)
		if bind != nil {
			undo, err := bind.Mount()
			if err != nil {
				return 0, nil, nil, err
			}
			defer undo()
		}
		if err := forkserver.StartNiced(cmd, nice); err != nil {
			return 0, nil, nil, err
		}
		go cmd.Wait() // reap it should it exit while we run
		return cmd.Process.Pid, func() { cmd.Process.Kill() }, func() {}, nil
	}
	if err != nil {
		return 0, nil, nil, err
	}
	return p.Pid, func() { p.Kill() }, p.Close, nil
}

// forkServer returns the fork server of an agent binary, started on its
// first Start: a private one, without the mounts of the pool's and runc's
// directories (the sandboxes' disks and roots, which every agent's mount
// namespace would copy otherwise).
func (b *Backend) forkServer(agentBinary string) *forkserver.Client {
	b.forksMu.Lock()
	defer b.forksMu.Unlock()
	if b.forks == nil {
		b.forks = map[string]*forkserver.Client{}
	}
	f, ok := b.forks[agentBinary]
	if !ok {
		f = forkserver.NewPrivateClient(agentBinary, b.poolDir, b.stateDir)
		b.forks[agentBinary] = f
	}
	return f
}
