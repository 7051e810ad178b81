package fncall

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Setting up a pool sandbox: its cgroups on the host, its agent's pid, and
// the tmpfs mounts that hold everything a call can write.

// sandboxCgroups returns the sandbox's own cgroup directory per controller
// (<hierarchy>/<parent>/<runc id>), checking they exist.
func sandboxCgroups(h hierarchies, parent, runcID string) (map[string]string, error) {
	out := map[string]string{}
	for _, c := range controllers {
		d := filepath.Join(h[c], parent, runcID)
		if _, err := os.Stat(filepath.Join(d, "tasks")); err != nil {
			return nil, fmt.Errorf("sandbox cgroup %s: %w (is the container backend's cgroup parent %q?)", d, err, parent)
		}
		out[c] = d
	}
	return out, nil
}

// agentPid finds the host pid of the sandbox's init (its agent): the
// process of the sandbox's cgroup that is pid 1 in its own pid namespace.
func agentPid(cg map[string]string) (int, error) {
	b, err := os.ReadFile(filepath.Join(cg["pids"], "cgroup.procs"))
	if err != nil {
		return 0, err
	}
	for _, f := range strings.Fields(string(b)) {
		st, err := os.ReadFile("/proc/" + f + "/status")
		if err != nil {
			continue
		}
		_, rest, ok := bytes.Cut(st, []byte("\nNSpid:"))
		if !ok {
			continue
		}
		line, _, _ := bytes.Cut(rest, []byte("\n"))
		ids := strings.Fields(string(line))
		if len(ids) >= 2 && ids[len(ids)-1] == "1" {
			return strconv.Atoi(f)
		}
	}
	return 0, fmt.Errorf("no init process in %s", cg["pids"])
}

// tmpfsMount is a tmpfs to mount in a sandbox.
type tmpfsMount struct {
	path   string // absolute, in the sandbox
	mode   uint32
	create bool // create the mount point if missing (else skip the mount)
}

// mountTmpfs mounts tmpfs file systems in the mount namespace of the
// process pid (a sandbox's agent, before any call ran in it). It runs on
// an OS thread of its own that leaves our file system context
// (unshare(CLONE_FS)), enters the sandbox's mount namespace and is thrown
// away afterwards (never given back to the Go scheduler), so nothing else
// of this process ever runs in the sandbox's namespace. Paths resolve in
// the sandbox: setns makes its root the thread's root. owner, if not nil,
// is the sandbox's user namespace range: the mounts are then its root's
// (else they would belong to host root, whom the sandbox cannot act for).
func mountTmpfs(pid int, size int64, owner *sandbox.IDMap, mounts []tmpfsMount) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with this goroutine
		errc <- func() error {
			ns, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("open mount namespace: %w", err)
			}
			defer unix.Close(ns)
			if err := unix.Unshare(unix.CLONE_FS); err != nil {
				return fmt.Errorf("unshare fs: %w", err)
			}
			if err := unix.Setns(ns, unix.CLONE_NEWNS); err != nil {
				return fmt.Errorf("enter mount namespace: %w", err)
			}
			for _, m := range mounts {
				var st unix.Stat_t
				err := unix.Lstat(m.path, &st)
				if errors.Is(err, unix.ENOENT) && m.create {
					err = unix.Mkdir(m.path, 0o755)
					if err == nil {
						err = unix.Lstat(m.path, &st)
					}
				}
				if errors.Is(err, unix.ENOENT) {
					continue
				}
				if err != nil {
					return fmt.Errorf("mount point %s: %w", m.path, err)
				}
				if st.Mode&unix.S_IFMT != unix.S_IFDIR {
					return fmt.Errorf("mount point %s is not a directory", m.path)
				}
				opts := fmt.Sprintf("size=%d,nr_inodes=65536,mode=%o", size, m.mode)
				if owner != nil {
					opts += fmt.Sprintf(",uid=%d,gid=%d", owner.HostUID, owner.HostGID)
				}
				if err := unix.Mount("tmpfs", m.path, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
					return fmt.Errorf("mount tmpfs on %s: %w", m.path, err)
				}
			}
			return nil
		}()
	}()
	return <-errc
}
