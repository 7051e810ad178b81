package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Claim: a pre-started blank sandbox receives its root.
//
// The container backend keeps a pool of containers whose agent already runs
// in fresh namespaces and cgroups, over an empty root, with CAP_SYS_ADMIN
// and without a seccomp filter (nothing but the agent runs in it yet). To
// hand one to a sandbox, the host composes the sandbox's overlay root as a
// detached mount (fsopen/fsmount) and sends the mount's file descriptor
// with a claim request:
//
//	claim: Q(hostname, env) then one byte carrying the mount fd (SCM_RIGHTS)
//	       → R(what a ping answers, but the RSS) | X
//
// The agent then, in order:
//
//  1. attaches the mount at /.shoal/newroot (move_mount);
//  2. moves /proc, /dev and /sys under it with their submounts, so the
//     masked and read-only paths runc set up stay as they are, and the
//     read-only bind of its own binary at /.shoal/agent;
//  3. pivots into it and detaches the old root;
//  4. sets the host name (resolvable: BindHosts) and the environment of
//     commands;
//  5. installs the sandbox's seccomp filter on all threads (docker's
//     profile for docker's capabilities: no mount, unshare, setns,
//     CLONE_NEW* …), which also forbids everything above from now on;
//  6. drops CAP_SYS_ADMIN from the effective, permitted and inheritable
//     sets of every thread, so no command ever has it (a pooled agent
//     dropped it from every thread's bounding set before it reported
//     ready, DropBoundingSysAdmin: the claim needs it effective only);
//  7. answers, and from then on serves every operation.
//
// A claim that fails once the root mount has arrived makes the agent exit
// after answering: a half-claimed sandbox never serves. Until the claim,
// only ping and claim are served.

// wireClaimRequest is the JSON part of a claim.
type wireClaimRequest struct {
	Hostname   string   `json:"hostname"`
	Env        []string `json:"env"`                   // the environment of every command
	BestEffort bool     `json:"best_effort,omitempty"` // commands under SCHED_IDLE (see AgentNice)
}

// claimState is the claim state of a pooled server.
type claimState struct {
	seccomp  []unix.SockFilter
	mu       sync.Mutex  // serializes claims
	claimed  atomic.Bool // set once the claim succeeded; read by admit
	exit     func(code int)
	lifeline *os.File // see Boot; closed by the watch once claimed
	// stopR, stopW: a pipe whose write end a successful claim closes, to
	// end the lifeline watch; -1 without a lifeline.
	stopR, stopW int
}

func newClaimState(seccomp []unix.SockFilter, lifeline *os.File, exit func(int)) (*claimState, error) {
	st := &claimState{seccomp: seccomp, exit: exit, lifeline: lifeline, stopR: -1, stopW: -1}
	if lifeline != nil {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			return nil, err
		}
		st.stopR, st.stopW = p[0], p[1]
	}
	return st, nil
}

// stopWatch ends the lifeline watch of a claimed agent (st.mu held): the
// sandbox outlives the node from now on. The watch closes the lifeline once
// st.mu is released.
func (st *claimState) stopWatch() {
	if st.stopW >= 0 {
		unix.Close(st.stopW)
		st.stopW = -1
	}
}

// claimStates holds the state of pooled servers (one per process in
// practice: a Server owns its process's children).
var claimStates sync.Map // *Server -> *claimState

// AcceptClaims makes s a pooled server: until a claim succeeds it serves
// only ping and claim. b must be a pooled boot (b.Pooled()).
func (s *Server) AcceptClaims(b *Boot) error {
	if b == nil || !b.pooled {
		return errors.New("accept claims: not a pooled agent")
	}
	if len(b.seccomp) == 0 {
		return errors.New("accept claims: no seccomp filter for the sandbox")
	}
	st, err := newClaimState(b.seccomp, b.lifeline, os.Exit)
	if err != nil {
		return fmt.Errorf("accept claims: %w", err)
	}
	claimStates.Store(s, st)
	warmCodecs()
	if st.lifeline != nil {
		go s.watchLifeline(st)
	}
	return nil
}

// watchLifeline exits the process when the node's end of the lifeline
// closes before a claim (see Boot). A claim stops the watch (st.stopW).
//
// It polls for the hang-up and never reads the lifeline. The pipe's open
// file description is shared by the node and every pool container, and its
// O_NONBLOCK flag with it: the node's start of each new pool container
// clears the flag (os/exec calls File.Fd on what it passes, which sets the
// description blocking). A read here could then block in the kernel, and
// the claim, which used to Close the lifeline, waited on that read forever:
// the claim that was never answered (about 1 create in 400 under load).
func (s *Server) watchLifeline(st *claimState) {
	lfd := int(st.lifeline.Fd())
	fds := []unix.PollFd{
		{Fd: int32(lfd), Events: unix.POLLIN},
		{Fd: int32(st.stopR), Events: unix.POLLIN},
	}
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		if _, err := unix.Poll(fds, -1); err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			s.log.Warn("watch the lifeline", "err", err)
			return
		}
		if fds[0].Revents != 0 || fds[1].Revents != 0 {
			break // the node never writes: any event is its end closing, or the claim's stop
		}
	}
	st.mu.Lock() // a claim in progress decides first
	defer st.mu.Unlock()
	if !st.claimed.Load() {
		s.log.Warn("the node that started this pool container is gone: exiting")
		st.exit(0)
		return
	}
	st.lifeline.Close()
	unix.Close(st.stopR)
}

// admit reports whether op may be served now; if not, it answers c.
func (s *Server) admit(c net.Conn, op Op) bool {
	v, ok := claimStates.Load(s)
	if !ok {
		return true
	}
	st := v.(*claimState)
	if st.claimed.Load() || op == OpPing || op == OpClaim {
		return true
	}
	sendError(c, CodeUnsupported, "op "+op.String()+": this sandbox has not been claimed yet")
	return false
}

// claimNewRoot is where the root is attached in a pooled container's blank
// root (the host created the directory).
const claimNewRoot = "/.shoal/newroot"

// claim serves OpClaim.
func (s *Server) claim(c net.Conn, body []byte) {
	v, ok := claimStates.Load(s)
	if !ok {
		sendError(c, CodeUnsupported, "claim: this agent is not a pooled sandbox")
		return
	}
	st := v.(*claimState)
	var req wireClaimRequest
	if !decode(c, body, &req) {
		return
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.claimed.Load() {
		sendError(c, CodeInvalid, "claim: already claimed")
		return
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		sendError(c, CodeProtocol, "claim: not a unix socket connection")
		return
	}
	c.SetReadDeadline(time.Now().Add(requestTimeout))
	fd, err := recvFD(uc)
	c.SetReadDeadline(time.Time{})
	if err != nil {
		// Nothing was changed yet: the sandbox may still be claimed.
		sendError(c, CodeProtocol, "claim: "+err.Error())
		return
	}
	err = s.becomeSandbox(st, fd, &req)
	unix.Close(fd)
	if err != nil {
		sendError(c, CodeIO, "claim: "+err.Error())
		s.log.Warn("claim failed, exiting", "err", err)
		st.exit(1)
		return
	}
	// What the node would ask first (Client.Learn).
	writeJSONFrame(c, FrameReply, hello())
}

// recvFD receives the one file descriptor of a claim.
func recvFD(uc *net.UnixConn) (int, error) {
	buf := make([]byte, 1)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return -1, fmt.Errorf("receive root mount: %w", err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return -1, fmt.Errorf("receive root mount: %w", err)
	}
	var fds []int
	for _, m := range msgs {
		if got, err := unix.ParseUnixRights(&m); err == nil {
			fds = append(fds, got...)
		}
	}
	for _, fd := range fds {
		unix.CloseOnExec(fd)
	}
	if n != 1 || len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return -1, fmt.Errorf("receive root mount: want one byte and one file descriptor, got %d and %d", n, len(fds))
	}
	return fds[0], nil
}

// becomeSandbox does steps 1-6 of a claim.
func (s *Server) becomeSandbox(st *claimState, mfd int, req *wireClaimRequest) error {
	env, err := mergeEnv(nil, req.Env)
	if err != nil {
		return fmt.Errorf("environment: %w", err)
	}
	if err := SwitchRoot(mfd, claimNewRoot); err != nil {
		return err
	}
	if req.Hostname != "" {
		if err := unix.Sethostname([]byte(req.Hostname)); err != nil {
			return fmt.Errorf("set host name: %w", err)
		}
		if err := BindHosts(req.Hostname); err != nil {
			s.log.Warn("the host name will not resolve", "err", err)
		}
	}
	if err := InstallSeccomp(st.seccomp); err != nil {
		return err
	}
	if err := dropSysAdmin(); err != nil {
		return err
	}
	// Published to exec by st.claimed (admit loads it before any exec).
	s.env = env
	s.spawn.idle.Store(req.BestEffort)
	st.claimed.Store(true)
	st.stopWatch()
	return nil
}

// SwitchRoot makes the detached mount mfd the root of the calling
// thread's mount namespace, attached at the empty directory at, with
// /proc, /dev, /sys and the agent binary moved into it: pivot_root moves
// every process of the namespace whose root was the old one (the agent's,
// when the node's reset calls it from a thread that entered the
// namespace) to the new root, and the old root is detached. It needs
// CAP_SYS_ADMIN over the namespace (the agent's claim, before it drops it).
func SwitchRoot(mfd int, at string) error {
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, at, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach root: %w", err)
	}
	root, err := unix.Open(at, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open new root: %w", err)
	}
	defer unix.Close(root)
	if err := ensureMountPoint(root, ".shoal", true, 0o755); err != nil {
		return err
	}
	for _, m := range []struct {
		path string
		dir  bool
		mode uint32
	}{
		{"proc", true, 0o555},
		{"dev", true, 0o755},
		{"sys", true, 0o555},
		{".shoal/agent", false, 0o755},
	} {
		if err := ensureMountPoint(root, m.path, m.dir, m.mode); err != nil {
			return err
		}
		to, err := unix.Openat2(root, m.path, &unix.OpenHow{
			Flags:   unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: resolveBeneath,
		})
		if err != nil {
			return fmt.Errorf("open /%s in the new root: %w", m.path, err)
		}
		// With its submounts (/dev/pts, /sys/fs/cgroup, the masks on /proc).
		err = unix.MoveMount(unix.AT_FDCWD, "/"+m.path, to, "", unix.MOVE_MOUNT_T_EMPTY_PATH)
		unix.Close(to)
		if err != nil {
			return fmt.Errorf("move /%s into the new root: %w", m.path, err)
		}
	}
	if err := unix.Fchdir(root); err != nil {
		return fmt.Errorf("enter new root: %w", err)
	}
	return pivotHere()
}

// resolveBeneath resolves a path inside the new root only: no symlink, no
// other mount, no escape.
const resolveBeneath = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_XDEV | unix.RESOLVE_NO_MAGICLINKS

// ensureMountPoint makes sure path (relative to root, no symlink on the
// way) exists as a directory (dir) or a regular file, creating it if
// missing. The image's own content is refused when it is of the wrong type
// (a symlink /proc, say): the host then falls back to a cold create, where
// runc resolves such paths its own way.
func ensureMountPoint(root int, path string, dir bool, mode uint32) error {
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: resolveBeneath}
	fd, err := unix.Openat2(root, path, how)
	if err == nil {
		var st unix.Stat_t
		err = unix.Fstat(fd, &st)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("stat /%s in the new root: %w", path, err)
		}
		isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
		if isDir != dir || (!dir && st.Mode&unix.S_IFMT != unix.S_IFREG) {
			return fmt.Errorf("/%s in the new root is not a %s", path, map[bool]string{true: "directory", false: "regular file"}[dir])
		}
		return nil
	}
	if !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("open /%s in the new root: %w", path, err)
	}
	// Missing: create it (in the sandbox's upper layer, as runc would).
	if dir {
		err = unix.Mkdirat(root, path, mode)
	} else {
		var fd int
		fd, err = unix.Openat(root, path, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
		if err == nil {
			unix.Close(fd)
		}
	}
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("create /%s in the new root: %w", path, err)
	}
	return nil
}

// warmCodecs encodes and decodes, once, the messages of a claim and of a
// first command: encoding/json describes a type on its first use, which a
// fresh agent would otherwise do during its claim (~0.4 ms of CPU on a
// 2-core host, in a profile of a burst of creates).
func warmCodecs() {
	for _, v := range []any{
		&wireClaimRequest{Hostname: "h", Env: []string{"A=1"}},
		&wireExecRequest{Args: []string{"true"}, Env: []string{"A=1"}, Durable: true, PTY: &wireWinsize{}},
		&wireAttachRequest{ID: "c"},
		&wireStdinRequest{ID: "c"},
	} {
		if b, err := json.Marshal(v); err == nil {
			json.Unmarshal(b, v)
		}
	}
	for _, v := range []any{hello(), wireExecReply{ID: "c"}, wireExit{Signal: "x"}, wireError{Msg: "x"}} {
		json.Marshal(v)
	}
}

// DropBoundingSysAdmin removes CAP_SYS_ADMIN from every thread's bounding
// set: what no command may gain by execve (as root, or through a setuid or
// file-capability binary). A pooled agent does it before it reports ready,
// with its thread reserve started (threads started later inherit the set):
// its claim needs the capability effective, not in the bounding set, and
// the visit of every thread is then not the claim's to pay (~0.6 ms of CPU
// on a 2-core host). Capabilities are per thread, hence AllThreadsSyscall
// (which needs a binary built without cgo, as the agent is; it fails with
// ENOTSUP otherwise).
func DropBoundingSysAdmin() error {
	if _, _, e := syscall.AllThreadsSyscall(unix.SYS_PRCTL, unix.PR_CAPBSET_DROP, unix.CAP_SYS_ADMIN, 0); e != 0 {
		return fmt.Errorf("drop CAP_SYS_ADMIN from the bounding set: %w", e)
	}
	return nil
}

// dropSysAdmin removes CAP_SYS_ADMIN from every thread's bounding set (if
// DropBoundingSysAdmin did not) and from its effective, permitted and
// inheritable sets: a thread that kept the capability could start a
// command with it.
func dropSysAdmin() error {
	if in, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, unix.CAP_SYS_ADMIN, 0, 0, 0); err != nil || in != 0 {
		if err := DropBoundingSysAdmin(); err != nil {
			return err
		}
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	bit := uint32(1) << (unix.CAP_SYS_ADMIN % 32)
	i := unix.CAP_SYS_ADMIN / 32
	data[i].Effective &^= bit
	data[i].Permitted &^= bit
	data[i].Inheritable &^= bit
	// Every thread has the same sets (they all descend from the agent's
	// first thread, and nothing changed them since), so one data block
	// fits all.
	if _, _, e := syscall.AllThreadsSyscall(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0); e != 0 {
		return fmt.Errorf("drop CAP_SYS_ADMIN: %w", e)
	}
	return nil
}
