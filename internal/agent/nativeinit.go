package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Native start: the container backend's launcher without runc.
//
// With `serve --launcher native` the backend starts a pool container's
// agent itself, in new user, pid, mount, ipc, uts and network namespaces
// (clone flags; the uid and gid maps written by the host), and lets the
// agent do what `runc init` would have done before it executes the agent:
// the agent binary is started with $SHOAL_NATIVE_INIT set and, before
// anything else (NativeInit, from the binary's init), waits until the host
// has put it into the container's cgroups, then on one locked thread:
//
//  1. enters a new cgroup namespace (rooted at the container's cgroups);
//  2. makes every mount private and binds the blank root onto itself;
//  3. mounts /proc, /dev (tmpfs, with null, zero, full, random, urandom
//     and tty: made with mknod, or the host's bound in within a user
//     namespace, as runc does; the usual symlinks, devpts, shm, mqueue),
//     /sys read-only with the container's cgroups bound read-only under a
//     tmpfs at /sys/fs/cgroup, as runc mounts them for the same spec (the
//     agent binary was bound read-only at /.shoal/agent where this process
//     was cloned: in the node's fork server, or the node itself);
//  4. pivots into the root and detaches the old one;
//  5. masks and makes read-only docker's paths of /proc and /sys;
//  6. sets the host name, brings up lo;
//  7. drops from the bounding set every capability not asked for, clears
//     the inheritable and ambient sets (no no_new_privs, as under runc:
//     the claim installs the filter with CAP_SYS_ADMIN, then drops it);
//  8. executes /.shoal/agent (the read-only bind) with the environment
//     minus the SHOAL_NATIVE_* variables: the agent then boots as a pooled
//     agent does under runc (StartBoot, claim, seccomp on claim).
//
// Any failure is written to the ready pipe ($SHOAL_READY_FD) and the
// process exits: the host destroys the container.
const (
	// EnvNativeInit is the descriptor of the start pipe: the host writes
	// one byte once the process is in the container's cgroups.
	EnvNativeInit = "SHOAL_NATIVE_INIT"
	// EnvNativeRoot is the host path of the blank root.
	EnvNativeRoot = "SHOAL_NATIVE_ROOT"
	// EnvNativeAgent is the descriptor of the agent binary this process
	// was executed from (closed before the agent executes again).
	EnvNativeAgent = "SHOAL_NATIVE_AGENT"
	// EnvNativeHostname is the host name to set.
	EnvNativeHostname = "SHOAL_NATIVE_HOSTNAME"
	// EnvNativeCaps is the capability set to keep, a hex bit mask.
	EnvNativeCaps = "SHOAL_NATIVE_CAPS"
	// EnvNativeCgroups lists the container's cgroup directories on the
	// host, one per v1 hierarchy, as NAME=PATH separated by newlines: each
	// is bound read-only at /sys/fs/cgroup/NAME.
	EnvNativeCgroups = "SHOAL_NATIVE_CGROUPS"
	// EnvNativeMasked and EnvNativeReadonly: the masked and read-only
	// paths, separated by newlines.
	EnvNativeMasked   = "SHOAL_NATIVE_MASKED"
	EnvNativeReadonly = "SHOAL_NATIVE_READONLY"
)

// NativeInit runs the native start when $SHOAL_NATIVE_INIT is set, and
// never returns then; otherwise it returns at once.
func NativeInit() {
	s, ok := os.LookupEnv(EnvNativeInit)
	if !ok {
		return
	}
	runtime.LockOSThread() // namespaces, capabilities and exec: one thread
	err := nativeInit(s)
	// Only reached on failure: tell the host why.
	msg := "error: native start: " + err.Error() + "\n"
	if fd, ferr := envFD(EnvReadyFD, os.Getenv(EnvReadyFD)); ferr == nil {
		unix.Write(fd, []byte(msg))
	}
	os.Stderr.WriteString("shoal-agent: " + msg)
	os.Exit(1)
}

func nativeInit(syncFD string) error {
	fd, err := envFD(EnvNativeInit, syncFD)
	if err != nil {
		return err
	}
	// Wait for the host: in the container's cgroups, with its limits.
	var b [1]byte
	for {
		n, err := unix.Read(fd, b[:])
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("wait for the host: %w", err)
		}
		if n != 1 {
			return errors.New("the host gave up")
		}
		break
	}
	unix.Close(fd)
	root := os.Getenv(EnvNativeRoot)
	if !filepath.IsAbs(root) {
		return fmt.Errorf("root %q must be an absolute path", root)
	}
	afd, err := envFD(EnvNativeAgent, os.Getenv(EnvNativeAgent))
	if err != nil {
		return err
	}
	unix.CloseOnExec(afd)
	keep, err := strconv.ParseUint(os.Getenv(EnvNativeCaps), 16, 64)
	if err != nil {
		return fmt.Errorf("%s: %w", EnvNativeCaps, err)
	}
	if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
		return fmt.Errorf("unshare cgroup namespace: %w", err)
	}
	if err := nativeMounts(root); err != nil {
		return err
	}
	if err := pivotInto(root); err != nil {
		return err
	}
	for _, p := range splitList(os.Getenv(EnvNativeMasked)) {
		if err := maskPath(p); err != nil {
			return err
		}
	}
	for _, p := range splitList(os.Getenv(EnvNativeReadonly)) {
		if err := readonlyPath(p); err != nil {
			return err
		}
	}
	if h := os.Getenv(EnvNativeHostname); h != "" {
		if err := unix.Sethostname([]byte(h)); err != nil {
			return fmt.Errorf("set host name: %w", err)
		}
	}
	if err := LoopbackUp(); err != nil {
		return err
	}
	if err := limitCaps(keep); err != nil {
		return err
	}
	if err := closeOthers(); err != nil {
		return err
	}
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "SHOAL_NATIVE_") {
			env = append(env, kv)
		}
	}
	err = unix.Exec(agentPath, []string{agentPath}, env)
	return fmt.Errorf("execute %s: %w", agentPath, err)
}

// agentPath is where the agent binary is bound in the root.
const agentPath = "/.shoal/agent"

func splitList(s string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l != "" {
			out = append(out, l)
		}
	}
	return out
}

type nativeMount struct {
	src, dst, fstype string
	flags            uintptr
	data             string
}

// nativeMounts makes the mounts of a pool container under root (a host
// path: the old root is still ours). The agent binary is bound read-only at
// root/.shoal/agent already: the host did it before the clone, so the bind
// came with the copy of its mounts (and is locked read-only in it).
func nativeMounts(root string) error {
	if err := unix.Mount("", "/", "", unix.MS_PRIVATE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := unix.Mount(root, root, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind root: %w", err)
	}
	const common = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	in := func(p string) string { return filepath.Join(root, p) }
	for _, m := range []nativeMount{
		{"proc", in("proc"), "proc", common, ""},
		{"tmpfs", in("dev"), "tmpfs", unix.MS_NOSUID | unix.MS_STRICTATIME, "mode=755,size=65536k"},
	} {
		if err := mountAt(m); err != nil {
			return err
		}
	}
	for _, d := range []struct {
		name string
		mode uint32
	}{{"pts", 0o755}, {"shm", 0o1777}, {"mqueue", 0o1777}} {
		if err := os.Mkdir(in("dev/"+d.name), os.FileMode(d.mode&0o777)); err != nil {
			return fmt.Errorf("create /dev/%s: %w", d.name, err)
		}
	}
	for _, m := range []nativeMount{
		{"devpts", in("dev/pts"), "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5"},
		{"shm", in("dev/shm"), "tmpfs", common, "mode=1777,size=65536k"},
		{"mqueue", in("dev/mqueue"), "mqueue", common, ""},
	} {
		if err := mountAt(m); err != nil {
			return err
		}
	}
	// runc's device nodes: made outside a user namespace (mode 0666 whatever
	// the umask), bound from the host's inside one, where mknod is refused.
	for _, d := range []struct {
		name         string
		major, minor uint32
	}{{"null", 1, 3}, {"random", 1, 8}, {"full", 1, 7}, {"tty", 5, 0}, {"zero", 1, 5}, {"urandom", 1, 9}} {
		dev, p := d.name, in("dev/"+d.name)
		err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(d.major, d.minor)))
		if err == nil {
			if err := unix.Chmod(p, 0o666); err != nil {
				return fmt.Errorf("create /dev/%s: %w", dev, err)
			}
			continue
		}
		if !errors.Is(err, unix.EPERM) {
			return fmt.Errorf("create /dev/%s: %w", dev, err)
		}
		f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o666)
		if err != nil {
			return fmt.Errorf("create /dev/%s: %w", dev, err)
		}
		f.Close()
		if err := unix.Mount("/dev/"+dev, p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind /dev/%s: %w", dev, err)
		}
	}
	for _, l := range [][2]string{{"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"}, {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"}, {"pts/ptmx", "ptmx"}} {
		if err := os.Symlink(l[0], in("dev/"+l[1])); err != nil {
			return fmt.Errorf("create /dev/%s: %w", l[1], err)
		}
	}
	if err := mountAt(nativeMount{"sysfs", in("sys"), "sysfs", common | unix.MS_RDONLY, ""}); err != nil {
		return err
	}
	cg := in("sys/fs/cgroup")
	if err := mountAt(nativeMount{"tmpfs", cg, "tmpfs", common, "mode=755"}); err != nil {
		return err
	}
	// The bind of the agent came with the copy of the mounts of the
	// namespace this process was cloned from, locked
	// (a less privileged namespace may not take it apart): a bind of it,
	// read-only as it is, is ours to move on claim.
	if err := bindReadonly(in(agentPath), in(agentPath), unix.MS_NOSUID|unix.MS_NODEV); err != nil {
		return err
	}
	for _, l := range splitList(os.Getenv(EnvNativeCgroups)) {
		name, src, ok := strings.Cut(l, "=")
		if !ok || name == "" || strings.ContainsAny(name, "/") || name == "." || name == ".." {
			return fmt.Errorf("%s: bad entry %q", EnvNativeCgroups, l)
		}
		dst := filepath.Join(cg, name)
		if err := os.Mkdir(dst, 0o755); err != nil {
			return fmt.Errorf("create /sys/fs/cgroup/%s: %w", name, err)
		}
		if err := bindReadonly(src, dst, common); err != nil {
			return err
		}
	}
	return nil
}

func mountAt(m nativeMount) error {
	if err := unix.Mount(m.src, m.dst, m.fstype, m.flags, m.data); err != nil {
		return fmt.Errorf("mount %s on %s: %w", m.fstype, m.dst, err)
	}
	return nil
}

// bindReadonly binds src at dst and makes the bind read-only with flags.
func bindReadonly(src, dst string, flags uintptr) error {
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %w", dst, err)
	}
	if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|flags, ""); err != nil {
		return fmt.Errorf("make %s read-only: %w", dst, err)
	}
	return nil
}

// pivotInto makes root the root and detaches the old one.
func pivotInto(root string) error {
	if err := unix.Chdir(root); err != nil {
		return fmt.Errorf("enter root: %w", err)
	}
	return pivotHere()
}

// pivotHere makes the working directory the root: pivot_root(".", ".")
// stacks the old root on the new one, which is then detached.
func pivotHere() error {
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return fmt.Errorf("chdir /: %w", err)
	}
	return nil
}

// maskPath hides p: an empty read-only tmpfs over a directory, /dev/null
// over anything else; a path that does not exist is skipped (as runc).
func maskPath(p string) error {
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("mask %s: %w", p, err)
	}
	var err error
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		err = unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY, "")
	} else {
		err = unix.Mount("/dev/null", p, "", unix.MS_BIND, "")
	}
	if err != nil {
		return fmt.Errorf("mask %s: %w", p, err)
	}
	return nil
}

// readonlyPath makes p read-only, keeping the flags the kernel locks in a
// user namespace (nosuid, nodev, noexec) as they are.
func readonlyPath(p string) error {
	if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("read-only %s: %w", p, err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(p, &sfs); err != nil {
		return fmt.Errorf("read-only %s: %w", p, err)
	}
	flags := uintptr(sfs.Flags) & (unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_NOATIME | unix.MS_NODIRATIME | unix.MS_RELATIME)
	if err := unix.Mount("", p, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_REC|flags, ""); err != nil {
		return fmt.Errorf("read-only %s: %w", p, err)
	}
	return nil
}

// LoopbackUp brings up the network namespace's loopback interface (a new
// namespace, or a VM's kernel, starts with lo down: 127.0.0.1 is then
// unreachable).
func LoopbackUp() error {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("bring up lo: %w", err)
	}
	defer unix.Close(s)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(s, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bring up lo: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bring up lo: %w", err)
	}
	return nil
}

// limitCaps drops from this thread's bounding set every capability not in
// keep and empties its inheritable and ambient sets. What the agent runs
// with after the exec (as root) is then keep, as runc sets it.
func limitCaps(keep uint64) error {
	last := lastCap()
	for c := 0; c <= last; c++ {
		if keep&(1<<c) != 0 {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	data[0].Inheritable, data[1].Inheritable = 0, 0
	if _, _, e := syscall.RawSyscall(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0); e != 0 {
		return fmt.Errorf("clear inheritable capabilities: %w", e)
	}
	return nil
}

// closeOthers marks close-on-exec every descriptor above 2 that is not one
// the agent is handed (as runc closes all but --preserve-fds): whatever
// the host process had open without the flag stays out of the sandbox.
func closeOthers() error {
	keep := map[int]bool{}
	for _, name := range []string{"SHOAL_AGENT_FD", EnvSeccompFD, EnvReadyFD, EnvLifeline} {
		if s, ok := os.LookupEnv(name); ok {
			fd, err := envFD(name, s)
			if err != nil {
				return err
			}
			keep[fd] = true
		}
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return fmt.Errorf("list descriptors: %w", err)
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil || fd < 3 || keep[fd] {
			continue
		}
		unix.CloseOnExec(fd)
	}
	return nil
}

// lastCap is the highest capability number the kernel knows.
func lastCap() int {
	data, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && n >= 0 && n < 64 {
			return n
		}
	}
	return unix.CAP_LAST_CAP
}
