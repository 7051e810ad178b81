package container

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// The agent binary is bound into every sandbox at /.shoal/agent. A bind's
// line in /proc/*/mountinfo shows its source's path inside the source's
// file system: bound from where the node keeps it (/usr/local/bin/…, a
// build directory, the data directory), that would tell the workload a
// host path. So the sandboxes' binds come from a copy of the binary on a
// tmpfs of the backend's own (source "shoal"), at its root under a name
// that says nothing but the copy's number: "/agent-1". One copy per binary
// (path, inode, size, change time): the sandboxes still share its pages.
//
// The tmpfs is mounted at New, before any fork server starts and copies
// the node's mounts (a private fork server sheds only those below the
// state and pool directories); files added to it later are seen in every
// mount namespace that holds it. Close detaches it; sandboxes keep their
// binds (each one holds the tmpfs).

// agentCopyFS is the tmpfs's source name in mountinfo.
const agentCopyFS = "shoal"

// agentCopies is the backend's private copies of agent binaries.
type agentCopies struct {
	dir string // where the tmpfs is mounted

	mu   sync.Mutex         // guards byID
	byID map[agentID]string // the copy of each binary
}

// agentID identifies one version of a binary at a path.
type agentID struct {
	path       string
	dev, ino   uint64
	size       int64
	ctimeNanos int64
}

// mountAgentCopies mounts an empty tmpfs at dir, in place of one left by
// an earlier process.
func mountAgentCopies(dir string) (*agentCopies, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	for range 4 {
		if unix.Unmount(dir, unix.MNT_DETACH) != nil {
			break
		}
	}
	// Room for a few versions of a static binary (tens of MiB each);
	// root's only, and nothing on it runs as set-id or is a device.
	if err := unix.Mount(agentCopyFS, dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=512m,nr_inodes=64,mode=0700"); err != nil {
		return nil, fmt.Errorf("mount the agent's tmpfs at %s: %w", dir, err)
	}
	return &agentCopies{dir: dir, byID: map[agentID]string{}}, nil
}

// path returns the path on the host of the private copy of binary host,
// copying it there the first time.
func (a *agentCopies) path(host string) (string, error) {
	f, err := os.Open(host)
	if err != nil {
		return "", fmt.Errorf("open agent binary: %w", err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return "", fmt.Errorf("stat agent binary: %w", err)
	}
	id := agentID{path: host, dev: st.Dev, ino: st.Ino, size: st.Size, ctimeNanos: st.Ctim.Nano()}
	a.mu.Lock()
	defer a.mu.Unlock()
	if p, ok := a.byID[id]; ok {
		return p, nil
	}
	p := filepath.Join(a.dir, "agent-"+strconv.Itoa(len(a.byID)+1))
	out, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o700)
	if err != nil {
		return "", fmt.Errorf("copy agent binary: %w", err)
	}
	_, err = io.Copy(out, f)
	if err == nil {
		// The binary's own permission bits: one the node cannot run is
		// not made runnable by the copy.
		err = out.Chmod(os.FileMode(st.Mode & 0o555))
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(p)
		return "", fmt.Errorf("copy agent binary: %w", err)
	}
	a.byID[id] = p
	return p, nil
}

// close detaches the tmpfs (sandboxes keep their binds of it).
func (a *agentCopies) close() {
	unix.Unmount(a.dir, unix.MNT_DETACH)
}
