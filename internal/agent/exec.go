package agent

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// command is one process started by exec. Its process is the leader of its
// own process group (pgid == pid), so signals and kills reach everything it
// started that did not leave the group.
type command struct {
	id   string
	pid  int           // set by reaper.start under reaper.mu, constant after
	done chan struct{} // closed once the process has been reaped
	// forker: the agent thread that joined a fncall run's cgroups to fork
	// it (startFn), 0 otherwise; set and read by the run's goroutine.
	forker int

	// Guarded by reaper.mu.
	reaped   bool
	timedOut bool
	status   syscall.WaitStatus
}

// exited is called by the reaper, under reaper.mu, with the wait status.
func (c *command) exited(ws syscall.WaitStatus) {
	c.reaped = true
	c.status = ws
	close(c.done)
}

// bufPool holds frame buffers: header space plus one data chunk.
var bufPool = sync.Pool{New: func() any {
	b := make([]byte, headerSize+MaxDataChunk)
	return &b
}}

// exec starts req and streams the command over c until it has exited; see
// the protocol in protocol.go. It returns when the exit frame has been sent
// (or the client is gone and the command is dead).
func (s *Server) exec(c net.Conn, req *wireExecRequest) {
	if req.Durable {
		s.execDurable(c, req)
		return
	}
	if req.PTY != nil {
		sendError(c, CodeInvalid, "a pty needs a durable command")
		return
	}
	cmd := &command{done: make(chan struct{})}
	files, werr := s.startCommand(cmd, req)
	if werr != nil {
		writeJSONFrame(c, FrameError, werr)
		return
	}
	stdin, stdout, stderr := files[0], files[1], files[2]
	s.mu.Lock()
	s.cmds[cmd.id] = cmd
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.cmds, cmd.id)
		s.mu.Unlock()
	}()

	// The client going away (connection closed or broken) kills the
	// command's process group, unless the command has already exited.
	gone := func() { s.reaper.signalGroup(cmd, syscall.SIGKILL, false) }
	if req.TimeoutNs > 0 {
		t := time.AfterFunc(time.Duration(req.TimeoutNs), func() {
			s.reaper.signalGroup(cmd, syscall.SIGKILL, true)
		})
		defer t.Stop()
	}

	var wmu sync.Mutex // serializes frames written to c
	if err := writeJSONFrame(c, FrameReply, wireExecReply{ID: cmd.id, Pid: cmd.pid}); err != nil {
		gone()
	}

	var closeStdin func()
	if stdin != nil {
		var once sync.Once
		closeStdin = func() { once.Do(func() { stdin.Close() }) }
	} else {
		closeStdin = func() {}
	}
	go s.execReader(c, cmd, stdin, closeStdin, gone)

	var wg sync.WaitGroup
	pump := func(f *os.File, typ byte) {
		defer wg.Done()
		bp := bufPool.Get().(*[]byte)
		defer bufPool.Put(bp)
		buf := *bp
		broken := false
		for {
			n, err := f.Read(buf[headerSize:])
			if n > 0 && !broken {
				wmu.Lock()
				werr := writeDataFrame(c, typ, buf, n)
				wmu.Unlock()
				if werr != nil {
					// Keep draining so the process never blocks on a full
					// pipe while it is being killed.
					broken = true
					gone()
				}
			}
			if err != nil {
				return
			}
		}
	}
	wg.Add(2)
	go pump(stdout, FrameStdout)
	go pump(stderr, FrameStderr)
	pumped := make(chan struct{})
	go func() { wg.Wait(); close(pumped) }()

	<-cmd.done
	// What the pipes still hold (left there while a pump waited for a slow
	// client) is read for up to maxOutputDrain: a background process that
	// writes without end would otherwise keep the command going.
	drainEnd := time.Now().Add(maxOutputDrain)
	awaitOutput(pumped, s.cfg.OutputGrace, []*os.File{stdout, stderr}, func(pending bool) bool {
		return pending && time.Now().Before(drainEnd)
	})
	stdout.Close()
	stderr.Close()
	closeStdin()

	s.reaper.mu.Lock()
	ws, timedOut := cmd.status, cmd.timedOut
	s.reaper.mu.Unlock()
	ex := exitOf(ws, timedOut)
	wmu.Lock()
	writeJSONFrame(c, FrameExit, ex)
	wmu.Unlock()
	// serveConn closes c, which ends execReader.
}

// maxOutputDrain bounds how long, after its process exited, an exec keeps
// reading the output its pipes still hold (see awaitOutput).
var maxOutputDrain = 30 * time.Second

// awaitOutput waits, once a command has exited, for its output pumps to
// end (pumped): background processes may hold the pipes open forever, so
// every grace it asks keep, given whether a pipe of outs still holds bytes
// (what is in a pipe is the command's output, which closing it would
// lose), whether to wait on; when not, it closes outs (the pumps end;
// writers left get EPIPE/SIGPIPE) and waits for the pumps. The caller
// still closes outs after.
func awaitOutput(pumped <-chan struct{}, grace time.Duration, outs []*os.File, keep func(pending bool) bool) {
	t := time.NewTimer(grace)
	defer t.Stop()
	for {
		select {
		case <-pumped:
			return
		case <-t.C:
			held := false
			for _, f := range outs {
				held = held || pending(f) > 0
			}
			if keep(held) {
				t.Reset(grace)
				continue
			}
			for _, f := range outs {
				f.Close()
			}
			<-pumped
			return
		}
	}
}

// execReader reads the client's side of an exec stream: stdin data and
// stdin EOF. A read error means the client closed the connection (or we
// did, after the exit frame): gone kills the command if it still runs.
func (s *Server) execReader(c net.Conn, cmd *command, stdin *os.File, closeStdin, gone func()) {
	var hdr [headerSize]byte
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	feeding := stdin != nil
	for {
		typ, n, err := readHeader(c, &hdr)
		if err != nil {
			gone()
			return
		}
		if n > MaxDataChunk {
			s.log.Warn("exec: oversized frame from client", "cmd", cmd.id, "len", n)
			gone()
			return
		}
		if _, err := io.ReadFull(c, buf[:n]); err != nil {
			gone()
			return
		}
		switch typ {
		case FrameData:
			if !feeding {
				continue
			}
			if err := writeStdin(stdin, buf[:n], c); err != nil {
				if err == errPeerGone {
					gone()
					return
				}
				// The process closed its stdin or exited: drop the rest.
				feeding = false
			}
		case FrameEOF:
			feeding = false
			closeStdin()
		}
	}
}

var errPeerGone = errors.New("peer closed the connection")

// writeStdin writes b to the command's stdin pipe. While the pipe is full it
// checks every 250ms whether the client has hung up, so that a command that
// does not read its stdin cannot keep a closed connection (and itself)
// alive: this goroutine is the one that would notice the hang-up.
func writeStdin(f *os.File, b []byte, c net.Conn) error {
	for len(b) > 0 {
		f.SetWriteDeadline(time.Now().Add(250 * time.Millisecond))
		n, err := f.Write(b)
		b = b[n:]
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			if peerClosed(c) {
				return errPeerGone
			}
			continue
		}
		return err
	}
	return nil
}

// peerClosed reports whether the other end of c has closed, without reading
// (POLLRDHUP is set even while unread data is queued).
func peerClosed(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	closed := false
	rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		n, _ := unix.Poll(fds, 0)
		closed = n > 0 && fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
	})
	return closed
}

// startCommand validates req, forks the process and returns our ends of its
// pipes: stdin (nil when req.Stdin is false), stdout, stderr.
func (s *Server) startCommand(cmd *command, req *wireExecRequest) ([3]*os.File, *wireError) {
	var files [3]*os.File
	fail := func(code ErrorCode, msg string) ([3]*os.File, *wireError) {
		return files, &wireError{Code: code, Msg: msg}
	}
	if len(req.Args) == 0 || req.Args[0] == "" {
		return fail(CodeInvalid, "empty command line")
	}
	for _, a := range req.Args {
		if strings.IndexByte(a, 0) >= 0 {
			return fail(CodeInvalid, "argument contains a NUL byte")
		}
	}
	var cred *syscall.Credential
	over, cwd := req.Env, req.Cwd
	if req.User != "" {
		// The user's identity, environment and home (users.go); the
		// request's own env entries and cwd still win.
		u, werr := lookupUser(req.User)
		if werr != nil {
			return files, requestUserErr(werr)
		}
		cred = u.credential()
		over = append(u.env(), req.Env...)
		if cwd == "" {
			if fi, err := os.Stat(u.Home); err == nil && fi.IsDir() {
				cwd = u.Home
			}
		}
	}
	env, err := mergeEnv(s.env, over)
	if err != nil {
		return fail(CodeInvalid, err.Error())
	}
	if cwd == "" {
		cwd = "/"
	}
	if !filepath.IsAbs(cwd) || strings.IndexByte(cwd, 0) >= 0 {
		return fail(CodeInvalid, "cwd "+strconv.Quote(cwd)+": must be an absolute path")
	}
	if fi, err := os.Stat(cwd); err != nil {
		return fail(codeOf(err), "cwd "+cwd+": "+reason(err))
	} else if !fi.IsDir() {
		return fail(CodeNotDir, "cwd "+cwd+": not a directory")
	}
	path, werr := lookPath(req.Args[0], env, cwd)
	if werr != nil {
		return files, werr
	}

	if req.PTY != nil {
		return s.startPTY(cmd, req, path, cwd, env, cred)
	}
	// Our ends are non-blocking (pollable *os.File, so reads and writes can
	// be interrupted by Close and deadlines); the child's ends stay blocking.
	child := [3]int{-1, -1, -1}
	var ours []int
	cleanup := func() {
		for _, fd := range child {
			if fd >= 0 {
				syscall.Close(fd)
			}
		}
		for _, fd := range ours {
			syscall.Close(fd)
		}
	}
	if req.Stdin {
		r, w, err := pipe()
		if err != nil {
			cleanup()
			return fail(CodeIO, "pipe: "+err.Error())
		}
		child[0], ours = r, append(ours, w)
	} else if fd, err := syscall.Open("/dev/null", syscall.O_RDONLY|syscall.O_CLOEXEC, 0); err == nil {
		child[0] = fd
	} else {
		// No /dev (a bare VM init): an empty pipe reads as EOF just the same.
		r, w, err := pipe()
		if err != nil {
			cleanup()
			return fail(CodeIO, "pipe: "+err.Error())
		}
		syscall.Close(w)
		child[0] = r
	}
	for i := 1; i <= 2; i++ {
		r, w, err := pipe()
		if err != nil {
			cleanup()
			return fail(CodeIO, "pipe: "+err.Error())
		}
		child[i], ours = w, append(ours, r)
	}
	for _, fd := range ours {
		syscall.SetNonblock(fd, true)
	}

	cmd.id = s.nextID()

	attr := &syscall.ProcAttr{
		Dir:   cwd,
		Env:   env,
		Files: []uintptr{uintptr(child[0]), uintptr(child[1]), uintptr(child[2])},
		Sys:   s.sysProcAttr(&syscall.SysProcAttr{Setpgid: true, Credential: cred}),
	}
	pid, err := s.reaper.start(cmd, func() (int, error) {
		return s.spawn.fork(func() (int, error) { return syscall.ForkExec(path, req.Args, attr) })
	})
	if err == nil {
		raiseOOMScore(pid)
	}
	for i, fd := range child {
		syscall.Close(fd)
		child[i] = -1
	}
	if err != nil {
		cleanup()
		return fail(codeOf(err), "exec "+path+": "+reason(err))
	}
	i := 0
	if req.Stdin {
		files[0] = os.NewFile(uintptr(ours[0]), "stdin")
		i = 1
	}
	files[1] = os.NewFile(uintptr(ours[i]), "stdout")
	files[2] = os.NewFile(uintptr(ours[i+1]), "stderr")
	return files, nil
}

// startPTY forks a command whose stdin, stdout and stderr are the slave of
// a new pseudo-terminal, in a session of its own with that terminal as its
// controlling tty. Our end (the master) is returned as both files[0] and
// files[1]; files[2] is nil (a terminal merges the two streams).
func (s *Server) startPTY(cmd *command, req *wireExecRequest, path, cwd string, env []string, cred *syscall.Credential) ([3]*os.File, *wireError) {
	var files [3]*os.File
	master, slave, err := openPTY(*req.PTY)
	if err != nil {
		return files, &wireError{Code: codeOf(err), Msg: "open pty: " + reason(err)}
	}
	if cred != nil {
		syscall.Fchown(slave, int(cred.Uid), -1) // the user's terminal, as login gives it
	}
	cmd.id = s.nextID()
	attr := &syscall.ProcAttr{
		Dir:   cwd,
		Env:   env,
		Files: []uintptr{uintptr(slave), uintptr(slave), uintptr(slave)},
		Sys:   s.sysProcAttr(&syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0, Credential: cred}),
	}
	pid, err := s.reaper.start(cmd, func() (int, error) {
		return s.spawn.fork(func() (int, error) { return syscall.ForkExec(path, req.Args, attr) })
	})
	syscall.Close(slave)
	if err != nil {
		master.Close()
		return files, &wireError{Code: codeOf(err), Msg: "exec " + path + ": " + reason(err)}
	}
	raiseOOMScore(pid)
	files[0], files[1] = master, master
	return files, nil
}

// nextID returns a new command ID.
func (s *Server) nextID() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	return s.boot + "-" + strconv.FormatUint(s.seq, 10)
}

// commandOOMScoreAdj is the oom_score_adj of every command. The agent is
// the sandbox's init and its death ends the sandbox, so the OOM killer must
// pick a command first. Lowering the agent's own score would need
// CAP_SYS_RESOURCE; raising a child's needs no privilege, and the child
// cannot lower it again.
const commandOOMScoreAdj = "500"

func raiseOOMScore(pid int) {
	if f, err := os.OpenFile("/proc/"+strconv.Itoa(pid)+"/oom_score_adj", os.O_WRONLY, 0); err == nil {
		f.WriteString(commandOOMScoreAdj)
		f.Close()
	}
}

func pipe() (r, w int, err error) {
	var p [2]int
	if err := syscall.Pipe2(p[:], syscall.O_CLOEXEC); err != nil {
		return -1, -1, err
	}
	return p[0], p[1], nil
}

// reason is the OS error text without the operation and path.
func reason(err error) string {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}

// mergeEnv returns base with over applied: a KEY=VALUE in over replaces the
// same KEY in base or is appended. PATH gets a default if neither sets it.
func mergeEnv(base, over []string) ([]string, error) {
	env := make([]string, 0, len(base)+len(over)+1)
	idx := make(map[string]int, len(base)+len(over))
	add := func(kv string) {
		k, _, _ := strings.Cut(kv, "=")
		if i, ok := idx[k]; ok {
			env[i] = kv
			return
		}
		idx[k] = len(env)
		env = append(env, kv)
	}
	for _, kv := range base {
		if i := strings.IndexByte(kv, '='); i > 0 {
			add(kv)
		}
	}
	for _, kv := range over {
		if i := strings.IndexByte(kv, '='); i <= 0 || strings.IndexByte(kv, 0) >= 0 {
			return nil, errors.New("env entry " + strconv.Quote(kv) + ": want KEY=VALUE")
		}
		add(kv)
	}
	if _, ok := idx["PATH"]; !ok {
		env = append(env, "PATH="+defaultPath)
	}
	return env, nil
}

// lookPath resolves argv0 like execvp, but against the PATH of the merged
// environment env (not the agent's own), with relative entries taken
// relative to cwd. A name with a slash is used as is.
func lookPath(argv0 string, env []string, cwd string) (string, *wireError) {
	if strings.Contains(argv0, "/") {
		return argv0, nil
	}
	pathEnv := defaultPath
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathEnv = v
		}
	}
	for _, dir := range filepath.SplitList(pathEnv) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, argv0)
		abs := p
		if !filepath.IsAbs(abs) {
			abs = filepath.Join(cwd, abs)
		}
		if fi, err := os.Stat(abs); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return abs, nil
		}
	}
	return "", &wireError{Code: CodeNotExist, Msg: "executable file not found in $PATH"}
}
