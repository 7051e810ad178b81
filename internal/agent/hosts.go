package agent

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// maxHostsFile bounds what is read of a layer's /etc/hosts; a larger one is
// left as it is.
const maxHostsFile = 64 << 10

// BindHosts makes the sandbox's host name resolve, as docker's /etc/hosts
// does: tools such as sudo look it up and complain when they cannot (there
// is no DNS in a sandbox without network). When the root has a regular
// /etc/hosts (of at most 64 KiB) that does not name the host, a copy of it
// with a "127.0.1.1 HOSTNAME" line (Debian's convention) is bound over it:
// a file on the sandbox's /dev tmpfs (unlinked once bound), charged to the
// sandbox, so the layers and the sandbox's upper stay as they are (commits
// do not see it), and the workload may still edit it. Without /etc/hosts,
// or when it is a symlink, nothing is done.
//
// It needs CAP_SYS_ADMIN and runs before any command exists (at boot or on
// claim, before the seccomp filter), so nothing of the workload can change
// the file under it; the bind is made on the descriptor opened, not on the
// path.
func BindHosts(hostname string) error {
	if hostname == "" {
		return nil
	}
	fd, err := unix.Open("/etc/hosts", unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil // none, or a symlink (ELOOP): left alone
	}
	f := os.NewFile(uintptr(fd), "/etc/hosts")
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() || fi.Size() > maxHostsFile {
		return nil
	}
	old, err := io.ReadAll(io.LimitReader(f, maxHostsFile+1))
	if err != nil || len(old) > maxHostsFile {
		return nil
	}
	if namesHost(old, hostname) {
		return nil
	}
	content := old
	if len(content) > 0 && content[len(content)-1] != '\n' {
		content = append(content, '\n')
	}
	content = append(content, "127.0.1.1\t"+hostname+"\n"...)
	// A file on the sandbox's /dev tmpfs, unlinked once bound (neither a
	// memfd, on no mount of ours, nor an O_TMPFILE file may be bound).
	name := "/dev/.shoal-hosts"
	mfd, err := unix.Open(name, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return fmt.Errorf("/etc/hosts: a file on /dev: %w", err)
	}
	defer unix.Unlink(name)
	m := os.NewFile(uintptr(mfd), "hosts")
	defer m.Close()
	if _, err := m.Write(content); err != nil {
		return fmt.Errorf("/etc/hosts: %w", err)
	}
	if err := m.Chmod(0o644); err != nil {
		return fmt.Errorf("/etc/hosts: %w", err)
	}
	src := "/proc/self/fd/" + strconv.Itoa(int(m.Fd()))
	dst := "/proc/self/fd/" + strconv.Itoa(int(f.Fd()))
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("/etc/hosts: bind: %w", err)
	}
	return nil
}

// namesHost reports whether a hosts file names the host (any field after
// the address of an uncommented line).
func namesHost(hosts []byte, hostname string) bool {
	for _, line := range bytes.Split(hosts, []byte("\n")) {
		if i := bytes.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		fields := bytes.Fields(line)
		for _, name := range fields[min(1, len(fields)):] {
			if string(name) == hostname {
				return true
			}
		}
	}
	return false
}
