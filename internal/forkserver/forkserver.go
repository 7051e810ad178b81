// Package forkserver starts processes in new user namespaces for the node
// from a small process of its own, so that the node never forks without
// vfork.
//
// Go's os/exec starts a child with vfork (CLONE_VM|CLONE_VFORK: nothing of
// the parent is copied) unless the child gets a user namespace of its own:
// the parent must then write the child's uid and gid maps while the child
// waits, which a vfork parent cannot, so Go forks for real. A fork copies
// the parent's page tables and marks every private page of it
// copy-on-write: the node (hundreds of MiB of heap, many threads) then
// takes a write fault, and a TLB flush on every CPU, on each page it
// writes next. Measured on a 2-core host with the native launcher, a pool
// refill that forked the node itself cost ~50 ms more of CPU per sandbox
// than one without a user namespace, most of it in such faults.
//
// The fork server is the agent binary (a few MiB) started once with vfork
// and [EnvFD] set; it serves Start requests on a SOCK_SEQPACKET socket:
// the request (JSON) with the child's descriptors (SCM_RIGHTS), the answer
// with its pid and a pidfd. Its children are its own: it reaps them (one thread for all). It
// exits when the node closes its end of the socket.
//
// A private server ([NewPrivateClient]) runs in a mount namespace of its
// own, its mounts private (no mount the node makes later reaches it), with
// the mounts below the directories it was given (the node's sandboxes'
// disks and roots) detached at its start. A child in a new mount namespace
// copies its parent's every mount, and a node's grow with its sandboxes
// (each one's disk is a mount): `unshare -m` took 4.2 ms with a quiet
// host's mounts and 9.1 ms with 3,000 more. What a child needs of the
// node's later mounts is bound for its start only ([Request].Bind).
package forkserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shoal-sandbox/shoal/internal/procfs"
)

// EnvFD, in the fork server's environment, is its socket's descriptor.
const EnvFD = "SHOAL_FORKSERVER_FD"

// EnvShed, in a private fork server's environment, lists (newline
// separated) the directories whose mounts it detaches at its start.
const EnvShed = "SHOAL_FORKSERVER_SHED"

// ErrUnavailable: no fork server could be started (the binary does not
// call Serve, or does not run). A caller with another way to start its
// process may use it.
var ErrUnavailable = errors.New("fork server unavailable")

// hello is the server's first message: it serves.
const hello = "forkserver"

// Bounds of one request: what a child is given is the node's, but the
// server checks what it reads all the same.
const (
	maxRequest = 256 << 10 // bytes of JSON
	maxFiles   = 64        // descriptors of one child
	// startTimeout bounds one Start when the caller's context has no
	// deadline: a fork and an exec take milliseconds.
	startTimeout = 30 * time.Second
	// helloTimeout bounds the server's start (a Go binary's); retryAfter
	// is how long a client whose server did not start says
	// ErrUnavailable before it tries again.
	helloTimeout = 10 * time.Second
	retryAfter   = time.Minute
)

// Request describes a process to start: exec.Cmd's fields and the
// SysProcAttr fields the node uses. The descriptors given with it become
// the child's 0, 1, 2, 3, ... in order.
type Request struct {
	Path                       string                 `json:"path"`
	Args                       []string               `json:"args"`
	Env                        []string               `json:"env"`
	Dir                        string                 `json:"dir,omitempty"`
	Setsid                     bool                   `json:"setsid,omitempty"`
	Cloneflags                 uintptr                `json:"cloneflags,omitempty"`
	UidMappings                []syscall.SysProcIDMap `json:"uid_mappings,omitempty"`
	GidMappings                []syscall.SysProcIDMap `json:"gid_mappings,omitempty"`
	GidMappingsEnableSetgroups bool                   `json:"gid_mappings_enable_setgroups,omitempty"`
	Credential                 *syscall.Credential    `json:"credential,omitempty"`
	// Nice is the child's nice value (inherited by its children).
	Nice int `json:"nice,omitempty"`
	// Bind, if set, is bound read-only (nosuid, nodev) for the start:
	// a child with a mount namespace of its own (CLONE_NEWNS) keeps it in
	// its copy; the server's goes once the child exists.
	Bind *Bind `json:"bind,omitempty"`
}

// Bind is a bind mount of Source (a file or directory) on Target.
type Bind struct {
	Source string `json:"source"`
	Target string `json:"target"`
}

// Mount binds b.Source on b.Target read-only (nosuid, nodev) in the
// caller's mount namespace, and returns what detaches it.
func (b *Bind) Mount() (undo func(), err error) {
	if err := unix.Mount(b.Source, b.Target, "", unix.MS_BIND, ""); err != nil {
		return nil, fmt.Errorf("bind %s: %w", b.Source, err)
	}
	undo = func() { unix.Unmount(b.Target, unix.MNT_DETACH) }
	if err := unix.Mount("", b.Target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		undo()
		return nil, fmt.Errorf("bind %s: %w", b.Source, err)
	}
	return undo, nil
}

type reply struct {
	Pid int    `json:"pid"`
	Err string `json:"err,omitempty"`
}

// StartNiced starts cmd with the given nice value, which its children
// inherit: the clone happens on a thread of its own, set to nice first, and
// that thread dies with it (never unlocked), so no other goroutine runs at
// that priority.
func StartNiced(cmd *exec.Cmd, nice int) error {
	if nice == 0 {
		return cmd.Start()
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		if err := unix.Setpriority(unix.PRIO_PROCESS, 0, nice); err != nil {
			errc <- fmt.Errorf("set priority: %w", err)
			return
		}
		errc <- cmd.Start()
	}()
	return <-errc
}

// Serve runs the fork server when the process was started as one (EnvFD
// set) and never returns then; otherwise it returns at once. Call it first
// thing in main (or init).
func Serve() {
	s, ok := os.LookupEnv(EnvFD)
	if !ok {
		return
	}
	fd, err := strconv.Atoi(s)
	if err != nil || fd < 3 {
		fmt.Fprintf(os.Stderr, "forkserver: bad %s %q\n", EnvFD, s)
		os.Exit(2)
	}
	os.Unsetenv(EnvFD)
	if shed, ok := os.LookupEnv(EnvShed); ok {
		os.Unsetenv(EnvShed)
		if err := privateMounts(strings.Split(shed, "\n")); err != nil {
			fmt.Fprintf(os.Stderr, "forkserver: %v\n", err)
			os.Exit(2)
		}
	}
	// No child may inherit the node's socket, nor a descriptor the node
	// itself inherited without close-on-exec (its own parent's): a child
	// gets what its request lists, nothing else.
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		fmt.Fprintf(os.Stderr, "forkserver: close-on-exec: %v\n", err)
		os.Exit(2)
	}
	c, err := net.FileConn(os.NewFile(uintptr(fd), "forkserver"))
	if err != nil {
		fmt.Fprintf(os.Stderr, "forkserver: %v\n", err)
		os.Exit(2)
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		fmt.Fprintln(os.Stderr, "forkserver: not a unix socket")
		os.Exit(2)
	}
	started := make(chan struct{}, 1)
	go reap(started)
	if _, err := uc.Write([]byte(hello)); err != nil {
		os.Exit(0)
	}
	buf := make([]byte, maxRequest)
	oob := make([]byte, unix.CmsgSpace(4*maxFiles))
	for {
		n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
		if err != nil || n == 0 {
			os.Exit(0) // the node is gone (or closed its end)
		}
		files, ferr := receivedFiles(oob[:oobn])
		var rep reply
		pidfd := -1
		switch {
		case ferr != nil:
			rep.Err = ferr.Error()
		case flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0:
			rep.Err = "request or descriptors truncated"
		default:
			var req Request
			if err := json.Unmarshal(buf[:n], &req); err != nil {
				rep.Err = "decode request: " + err.Error()
			} else {
				rep.Pid, pidfd, err = start(&req, files)
				if err != nil {
					rep.Err = err.Error()
				} else {
					select {
					case started <- struct{}{}:
					default:
					}
				}
			}
		}
		for _, f := range files {
			f.Close()
		}
		b, _ := json.Marshal(rep)
		var rights []byte
		if pidfd >= 0 {
			rights = unix.UnixRights(pidfd)
		}
		_, _, err = uc.WriteMsgUnix(b, rights, nil)
		if pidfd >= 0 {
			unix.Close(pidfd)
		}
		if err != nil {
			os.Exit(0)
		}
	}
}

// privateMounts makes the server's mount namespace its own: every mount
// private, and those strictly below the shed directories detached. It
// refuses to run in its parent's mount namespace (the node's: the client
// asks for a new one when it starts the server), where it would change the
// host's.
func privateMounts(shed []string) error {
	var self, parent unix.Stat_t
	if err := unix.Stat("/proc/self/ns/mnt", &self); err != nil {
		return fmt.Errorf("own mount namespace: %w", err)
	}
	if err := unix.Stat("/proc/"+strconv.Itoa(os.Getppid())+"/ns/mnt", &parent); err != nil {
		return fmt.Errorf("parent's mount namespace: %w", err)
	}
	if self.Ino == parent.Ino && self.Dev == parent.Dev {
		return errors.New("started in its parent's mount namespace: refusing to change it")
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	mounts, err := procfs.Mountinfo("self")
	if err != nil {
		return err
	}
	var points []string
	for _, m := range mounts {
		for _, d := range shed {
			if d != "" && strings.HasPrefix(m.Point, strings.TrimRight(d, "/")+"/") {
				points = append(points, m.Point)
				break
			}
		}
	}
	// Deepest first; a point mounted over twice is listed twice.
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	for _, p := range points {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("detach %s: %w", p, err)
		}
	}
	return nil
}

// receivedFiles turns the descriptors of a message into files (close-on-exec:
// a child gets only those its request lists, at the numbers it lists).
func receivedFiles(oob []byte) ([]*os.File, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("descriptors: %w", err)
	}
	var files []*os.File
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			unix.CloseOnExec(fd)
			files = append(files, os.NewFile(uintptr(fd), "fd"+strconv.Itoa(len(files))))
		}
	}
	return files, nil
}

// reap reaps the server's children as they exit, all of them in one
// goroutine (one thread blocked in wait4, not one per child: a node runs
// thousands of sandboxes). started says a child was started since wait4
// last found none. os/exec's own wait for a child whose exec failed may
// find it reaped here: it ignores that.
func reap(started <-chan struct{}) {
	for {
		var ws unix.WaitStatus
		_, err := unix.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, unix.ECHILD) {
			<-started
		}
	}
}

// start starts req's process with files as its descriptors; it returns
// its pid and a pidfd (reap reaps it).
func start(req *Request, files []*os.File) (int, int, error) {
	if len(files) < 3 {
		return 0, -1, fmt.Errorf("%d descriptors: want at least stdin, stdout and stderr", len(files))
	}
	pidfd := -1
	cmd := &exec.Cmd{
		Path: req.Path, Args: req.Args, Env: req.Env, Dir: req.Dir,
		Stdin: files[0], Stdout: files[1], Stderr: files[2], ExtraFiles: files[3:],
		SysProcAttr: &syscall.SysProcAttr{
			Setsid:                     req.Setsid,
			Cloneflags:                 req.Cloneflags,
			UidMappings:                req.UidMappings,
			GidMappings:                req.GidMappings,
			GidMappingsEnableSetgroups: req.GidMappingsEnableSetgroups,
			Credential:                 req.Credential,
			PidFD:                      &pidfd,
		},
	}
	if req.Bind != nil {
		undo, err := req.Bind.Mount()
		if err != nil {
			return 0, -1, err
		}
		defer undo()
	}
	if err := StartNiced(cmd, req.Nice); err != nil {
		return 0, -1, err
	}
	return cmd.Process.Pid, pidfd, nil
}

// Client starts processes through a fork server running bin (a binary
// that calls Serve first). It starts the server on first use, and again
// after it died. Safe for concurrent use (requests take turns).
type Client struct {
	bin  string
	shed []string // a private server's (nil: the node's mount namespace)

	mu       sync.Mutex
	conn     *net.UnixConn // nil: no server running
	proc     *os.Process
	failedAt time.Time // the last start that failed (ErrUnavailable until retryAfter)
}

// NewClient returns a client of a fork server running bin; nothing is
// started yet.
func NewClient(bin string) *Client { return &Client{bin: bin} }

// NewPrivateClient returns a client of a private fork server running bin
// (see the top of the file): in a mount namespace of its own, without the
// mounts below the shed directories. Its children see none of the node's
// mounts made after it started: a Request binds what a child needs.
func NewPrivateClient(bin string, shed ...string) *Client {
	return &Client{bin: bin, shed: append([]string{}, shed...)}
}

// Process is a started child: its pid, and a pidfd that pins it (the
// caller closes it).
type Process struct {
	Pid   int
	PidFD int
}

// Kill sends SIGKILL through the pidfd (never to another process that
// reused the pid).
func (p Process) Kill() error {
	if err := unix.PidfdSendSignal(p.PidFD, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return err
	}
	return nil
}

// Close closes the pidfd.
func (p Process) Close() { unix.Close(p.PidFD) }

// Start starts req's process with files as its descriptors 0, 1, 2, 3, ...
func (c *Client) Start(ctx context.Context, req Request, files []*os.File) (Process, error) {
	if len(files) < 3 || len(files) > maxFiles {
		return Process{}, fmt.Errorf("forkserver: %d descriptors: want 3 to %d", len(files), maxFiles)
	}
	b, err := json.Marshal(req)
	if err != nil {
		return Process{}, err
	}
	if len(b) > maxRequest {
		return Process{}, fmt.Errorf("forkserver: request of %d bytes: at most %d", len(b), maxRequest)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		if time.Since(c.failedAt) < retryAfter {
			return Process{}, fmt.Errorf("forkserver %s: %w (it did not start %v ago)", c.bin, ErrUnavailable, time.Since(c.failedAt).Round(time.Second))
		}
		if err := c.spawn(); err != nil {
			c.failedAt = time.Now()
			return Process{}, fmt.Errorf("forkserver %s: %w: %v", c.bin, ErrUnavailable, err)
		}
	}
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(startTimeout)
	}
	c.conn.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { c.conn.SetDeadline(time.Now()) })
	defer stop()
	fds := make([]int, len(files))
	for i, f := range files {
		fds[i] = int(f.Fd())
	}
	_, _, err = c.conn.WriteMsgUnix(b, unix.UnixRights(fds...), nil)
	for _, f := range files {
		runtime.KeepAlive(f)
	}
	if err != nil {
		c.stopLocked()
		return Process{}, fmt.Errorf("forkserver: send request: %w", err)
	}
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.conn.ReadMsgUnix(buf, oob)
	if err == nil && n == 0 {
		err = errors.New("the fork server exited")
	}
	if err != nil {
		// It may answer later, or hang: either way it is replaced, and
		// a child it started meanwhile has no pidfd here (its own
		// caller's cleanup, by cgroup, finds it).
		c.stopLocked()
		return Process{}, fmt.Errorf("forkserver: read answer: %w", err)
	}
	got, _ := receivedFiles(oob[:oobn])
	var rep reply
	if err := json.Unmarshal(buf[:n], &rep); err != nil {
		for _, f := range got {
			f.Close()
		}
		c.stopLocked()
		return Process{}, fmt.Errorf("forkserver: decode answer: %w", err)
	}
	if rep.Err != "" {
		for _, f := range got {
			f.Close()
		}
		return Process{}, errors.New(rep.Err)
	}
	if len(got) != 1 || rep.Pid <= 0 {
		for _, f := range got {
			f.Close()
		}
		c.stopLocked()
		return Process{}, fmt.Errorf("forkserver: answer with pid %d and %d descriptors", rep.Pid, len(got))
	}
	// The pidfd as a bare descriptor (no *os.File finalizer closes it).
	pidfd, err := unix.Dup(int(got[0].Fd()))
	got[0].Close()
	if err != nil {
		return Process{}, fmt.Errorf("forkserver: %w", err)
	}
	unix.CloseOnExec(pidfd)
	return Process{Pid: rep.Pid, PidFD: pidfd}, nil
}

// spawn starts the fork server: with vfork (no user namespace), the one
// fork the node pays.
func (c *Client) spawn() error {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socketpair: %w", err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "forkserver"), os.NewFile(uintptr(fds[1]), "forkserver-peer")
	// The flag names it in ps; a binary without Serve refuses it and
	// exits (the first Start then fails) rather than run as something else.
	cmd := exec.Command(c.bin, "--forkserver")
	cmd.Env = []string{EnvFD + "=3"}
	if c.shed != nil {
		// CLONE_NEWNS keeps the vfork (only CLONE_NEWUSER forbids it).
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWNS}
		cmd.Env = append(cmd.Env, EnvShed+"="+strings.Join(c.shed, "\n"))
	}
	cmd.Stderr = os.Stderr
	cmd.ExtraFiles = []*os.File{theirs}
	err = cmd.Start()
	theirs.Close() // the server's alone now: EOF here when it exits
	if err != nil {
		ours.Close()
		return fmt.Errorf("start %s: %w", c.bin, err)
	}
	go cmd.Wait()
	conn, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		cmd.Process.Kill()
		return err
	}
	uc := conn.(*net.UnixConn)
	uc.SetReadDeadline(time.Now().Add(helloTimeout))
	buf := make([]byte, 64)
	n, err := uc.Read(buf)
	if err == nil && string(buf[:n]) != hello {
		err = fmt.Errorf("said %q first, not %q", buf[:n], hello)
	}
	if err != nil {
		uc.Close()
		cmd.Process.Kill()
		return fmt.Errorf("no hello: %w", err)
	}
	uc.SetReadDeadline(time.Time{})
	c.conn, c.proc = uc, cmd.Process
	return nil
}

func (c *Client) stopLocked() {
	if c.conn == nil {
		return
	}
	c.conn.Close()
	c.proc.Kill()
	c.conn, c.proc = nil, nil
}

// Close stops the fork server; the processes it started keep running.
func (c *Client) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopLocked()
}
