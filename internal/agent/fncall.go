package agent

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// FnCall: judge-style runs for the fncall backend (internal/fncall).
//
// A sandbox of the fncall pool serves one call at a time. Every process of
// a call runs as an unprivileged uid that owns nothing outside the call's
// box (a tmpfs the host mounted), so what a call can change is exactly: the
// box, the shared writable places (/tmp, /var/tmp, /dev/shm ... also tmpfs
// or emptied), its processes and System V IPC objects. The host resets all
// of that between calls with fnprepare, and runs each process with fnrun
// inside cgroups it created for that process alone:
//
//	fnprepare: Q(wireFnPrepare) then, per file of the request, D* F
//	           → R(wireFnPrepared) | X
//	fnrun:     Q(wireFnRun) [then one byte carrying wireFnRun.NFDs cgroup
//	           "tasks" files, SCM_RIGHTS] → R({"id","pid"}) | X;
//	           then agent→client O/E (each stream capped at out_limit)
//	           … exactly one Z (wireFnExit) and close;
//	           client→agent D (stdin) … F; closing the connection before Z
//	           kills the run.
//
// fnprepare first kills every process of the uid, then empties the box and
// the wipe directories, hands the box to the uid and writes the files. It
// reports what it could not clean (System V IPC objects, which only their
// owner may remove, processes that would not die); the host then throws
// the sandbox away instead of reusing it.
//
// fnrun joins the cgroups from a dedicated OS thread that is never given
// back to the Go scheduler: the thread writes "0" to each tasks file (a
// thread, not the agent process, moves; cgroup v1 moves a single thread
// without the global threadgroup lock), forks the command, which is born
// in those cgroups (no instant of it runs elsewhere), and dies with its
// goroutine. The Go runtime never clones a new thread from a locked one
// (it asks its template thread), so nothing else of the agent lands in a
// run's cgroups; its memory stays charged to the agent (memory cgroup v1
// charges the process's mm owner, the main thread). When the command's process exits, every other process of the
// uid is killed at once (a call's background processes never outlive the
// run, and their open pipes never delay the result).

type wireFnPrepare struct {
	Box   string       `json:"box"`            // working directory: emptied, then owned by uid
	Wipe  []string     `json:"wipe,omitempty"` // directories emptied, not re-owned (/tmp, ...)
	UID   int          `json:"uid"`
	GID   int          `json:"gid"`
	Files []wireFnFile `json:"files,omitempty"`
	Quick bool         `json:"quick,omitempty"` // reset already: skip the kill, the wipe dirs and the IPC check
}

type wireFnFile struct {
	Path string `json:"path"` // relative to the box
	Mode uint32 `json:"mode"` // permission bits
}

type wireFnPrepared struct {
	Killed  int      `json:"killed,omitempty"`  // processes of uid that were still there
	Removed int      `json:"removed,omitempty"` // entries removed from the box and wipe dirs
	Dirty   []string `json:"dirty,omitempty"`   // what could not be cleaned
}

type wireFnRun struct {
	Args      []string `json:"args"`
	Env       []string `json:"env"` // the whole environment (PATH gets a default)
	Cwd       string   `json:"cwd"`
	UID       int      `json:"uid"`
	GID       int      `json:"gid"`
	Stdin     bool     `json:"stdin,omitempty"`
	TimeoutNs int64    `json:"timeout_ns,omitempty"` // wall clock; 0 = none
	OutLimit  int64    `json:"out_limit,omitempty"`  // bytes kept per stream; 0 = none
	Stack     int64    `json:"stack,omitempty"`      // RLIMIT_STACK; 0 = inherited
	NFDs      int      `json:"nfds,omitempty"`       // cgroup files that follow: tasks files, then pids.max if Pids > 0
	Pids      int      `json:"pids,omitempty"`       // written to the last file once the process exists
}

type wireFnExit struct {
	Code     int    `json:"code"`
	Signal   string `json:"signal,omitempty"`
	TimedOut bool   `json:"timed_out,omitempty"`
	OutOver  bool   `json:"out_over,omitempty"` // stdout passed out_limit: the run was killed
	ErrOver  bool   `json:"err_over,omitempty"` // stderr passed out_limit: the rest was dropped
	WallNs   int64  `json:"wall_ns"`
	Leftover int    `json:"leftover,omitempty"` // processes still running when the command exited
}

// fnForkMu serializes forks that change the agent's own RLIMIT_STACK
// around them (rlimits are per process; the child inherits them).
var fnForkMu sync.Mutex

// fnPrepare serves OpFnPrepare.
func (s *Server) fnPrepare(c net.Conn, req *wireFnPrepare) {
	if req.UID <= 0 || req.GID <= 0 {
		sendError(c, CodeInvalid, "fnprepare: uid and gid must be > 0")
		return
	}
	box, ok := cleanPath(req.Box)
	if !ok || box == "/" {
		sendError(c, CodeInvalid, "fnprepare: bad box "+strconv.Quote(req.Box))
		return
	}
	var wipe []string
	for _, w := range req.Wipe {
		p, ok := cleanPath(w)
		if !ok || p == "/" {
			sendError(c, CodeInvalid, "fnprepare: bad wipe dir "+strconv.Quote(w))
			return
		}
		wipe = append(wipe, p)
	}
	for _, f := range req.Files {
		if !validBoxPath(f.Path) {
			sendError(c, CodeInvalid, "fnprepare: file path "+strconv.Quote(f.Path)+" must be relative, without .. or empty elements")
			return
		}
	}
	var rep wireFnPrepared
	if req.Quick {
		wipe = nil
	} else {
		killed, err := killUID(req.UID, 2*time.Second)
		rep.Killed = killed
		if err != nil {
			rep.Dirty = append(rep.Dirty, err.Error())
		}
		if ipc := sysvIPCLeft(); ipc != "" {
			rep.Dirty = append(rep.Dirty, ipc)
		}
	}
	for _, d := range append([]string{box}, wipe...) {
		n, err := emptyDir(d)
		rep.Removed += n
		if err != nil {
			rep.Dirty = append(rep.Dirty, err.Error())
		}
	}
	if err := os.MkdirAll(box, 0o755); err != nil {
		sendOSError(c, err, box)
		return
	}
	if err := os.Lchown(box, req.UID, req.GID); err != nil {
		sendOSError(c, err, box)
		return
	}
	if err := os.Chmod(box, 0o755); err != nil {
		sendOSError(c, err, box)
		return
	}
	// The files' bytes: D* F per file, in order.
	for _, f := range req.Files {
		if err := receiveBoxFile(c, box, f, req.UID, req.GID); err != nil {
			sendError(c, codeOf(err), "fnprepare "+f.Path+": "+reason(err))
			return
		}
	}
	writeJSONFrame(c, FrameReply, rep)
}

// validBoxPath accepts a clean relative path.
func validBoxPath(p string) bool {
	if p == "" || strings.HasPrefix(p, "/") || strings.IndexByte(p, 0) >= 0 || len(p) > 1024 {
		return false
	}
	for _, el := range strings.Split(p, "/") {
		if el == "" || el == "." || el == ".." {
			return false
		}
	}
	return true
}

// receiveBoxFile writes the next file of the request into the box. The
// box was just emptied and only root wrote in it since, so no path element
// can be a symlink planted by a call.
func receiveBoxFile(c net.Conn, box string, f wireFnFile, uid, gid int) error {
	p := filepath.Join(box, f.Path)
	if dir := filepath.Dir(p); dir != box {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		for d := dir; d != box; d = filepath.Dir(d) {
			os.Lchown(d, uid, gid)
		}
	}
	mode := f.Mode & 0o777
	if mode == 0 {
		mode = 0o644
	}
	out, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, os.FileMode(mode))
	if err != nil {
		return err
	}
	defer out.Close()
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	var hdr [headerSize]byte
	for {
		c.SetReadDeadline(time.Now().Add(requestTimeout))
		typ, n, err := readHeader(c, &hdr)
		if err != nil {
			return unexpectedEOF(err)
		}
		if n > MaxDataChunk {
			return errFrameTooLarge
		}
		if _, err := io.ReadFull(c, buf[:n]); err != nil {
			return unexpectedEOF(err)
		}
		switch typ {
		case FrameData:
			if _, err := out.Write(buf[:n]); err != nil {
				return err
			}
		case FrameEOF:
			c.SetReadDeadline(time.Time{})
			if err := out.Chmod(os.FileMode(mode)); err != nil { // exactly, umask aside
				return err
			}
			return out.Chown(uid, gid)
		default:
			return fmt.Errorf("unexpected frame %q", typ)
		}
	}
}

// emptyDir removes everything inside dir (not dir itself, which may be a
// mount point). A missing dir is not an error.
func emptyDir(dir string) (int, error) {
	f, err := os.Open(dir)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("empty %s: %w", dir, err)
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return 0, fmt.Errorf("empty %s: %w", dir, err)
	}
	var errs []error
	for _, n := range names {
		if err := os.RemoveAll(filepath.Join(dir, n)); err != nil {
			errs = append(errs, fmt.Errorf("empty %s: %w", dir, err))
		}
	}
	return len(names), errors.Join(errs...)
}

// sysvIPCLeft describes the System V IPC objects that exist in the
// sandbox's IPC namespace ("" if none). Only their owner (or
// CAP_SYS_ADMIN, which nobody in a sandbox has) may remove them.
func sysvIPCLeft() string {
	var parts []string
	for _, kind := range []string{"shm", "sem", "msg"} {
		b, err := os.ReadFile("/proc/sysvipc/" + kind)
		if err != nil {
			continue
		}
		if n := bytes.Count(bytes.TrimSpace(b), []byte("\n")); n > 0 { // the first line is a header
			parts = append(parts, fmt.Sprintf("%d %s", n, kind))
		}
	}
	if len(parts) == 0 {
		return ""
	}
	return "System V IPC objects left: " + strings.Join(parts, ", ")
}

// killUID SIGKILLs every process whose real or effective uid is uid, and
// waits until none is left (the reaper collects them: the agent is the
// sandbox's init). It returns how many it signalled.
func killUID(uid int, wait time.Duration) (int, error) {
	if uid <= 0 {
		return 0, errors.New("kill: refusing uid " + strconv.Itoa(uid))
	}
	self := os.Getpid()
	seen := map[int]bool{}
	deadline := time.Now().Add(wait)
	for delay := 50 * time.Microsecond; ; delay = min(delay*2, 5*time.Millisecond) {
		pids := pidsOfUID(uid, self)
		if len(pids) == 0 {
			return len(seen), nil
		}
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
			seen[pid] = true
		}
		if time.Now().After(deadline) {
			return len(seen), fmt.Errorf("%d processes of uid %d survived SIGKILL", len(pids), uid)
		}
		time.Sleep(delay)
	}
}

// pidsOfUID lists the live processes whose real or effective uid is uid.
// Zombies are left out: they are dead, hold no memory, and no longer
// count in their cgroups' task lists (the reaper collects them).
func pidsOfUID(uid, self int) []int {
	d, err := os.Open("/proc")
	if err != nil {
		return nil
	}
	names, _ := d.Readdirnames(-1)
	d.Close()
	var out []int
	want := strconv.Itoa(uid)
	for _, n := range names {
		pid, err := strconv.Atoi(n)
		if err != nil || pid == self {
			continue
		}
		f, err := os.Open("/proc/" + n + "/status")
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			line := sc.Text()
			if st, ok := strings.CutPrefix(line, "State:"); ok && strings.HasPrefix(strings.TrimSpace(st), "Z") {
				break
			}
			if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
				if ids := strings.Fields(rest); len(ids) >= 2 && (ids[0] == want || ids[1] == want) {
					out = append(out, pid)
				}
				break
			}
		}
		f.Close()
	}
	return out
}

// fnRun serves OpFnRun.
func (s *Server) fnRun(c net.Conn, req *wireFnRun) {
	var fds []int
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	if req.NFDs < 0 || req.NFDs > 16 {
		sendError(c, CodeInvalid, "fnrun: bad number of cgroup files")
		return
	}
	if req.NFDs > 0 {
		uc, ok := c.(*net.UnixConn)
		if !ok {
			sendError(c, CodeProtocol, "fnrun: not a unix socket connection")
			return
		}
		c.SetReadDeadline(time.Now().Add(requestTimeout))
		var err error
		fds, err = recvFDs(uc, req.NFDs)
		c.SetReadDeadline(time.Time{})
		if err != nil {
			sendError(c, CodeProtocol, "fnrun: "+err.Error())
			return
		}
	}
	if req.UID <= 0 || req.GID <= 0 {
		sendError(c, CodeInvalid, "fnrun: uid and gid must be > 0")
		return
	}
	tasks, pidsMax := fds, -1
	if req.Pids > 0 {
		if len(fds) < 2 {
			sendError(c, CodeInvalid, "fnrun: pids needs a tasks file and the pids.max file")
			return
		}
		tasks, pidsMax = fds[:len(fds)-1], fds[len(fds)-1]
	}
	cmd := &command{done: make(chan struct{})}
	files, werr := s.startFn(cmd, req, tasks, pidsMax)
	if werr != nil {
		writeJSONFrame(c, FrameError, werr)
		return
	}
	start := time.Now()
	stdin, stdout, stderr := files[0], files[1], files[2]
	s.mu.Lock()
	s.cmds[cmd.id] = cmd
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.cmds, cmd.id)
		s.mu.Unlock()
	}()

	// Killing a run kills the whole uid: its process group is not enough
	// (a call may start new sessions and groups). No kill may start once
	// the run is over (the host's next run of the uid may be starting):
	// finished is set, and every kill in flight waited for, before Z.
	var timedOut, outOver, errOver atomic.Bool
	var kmu sync.Mutex
	var kills sync.WaitGroup
	finished := false
	killAll := func() {
		s.reaper.signalGroup(cmd, syscall.SIGKILL, false)
		kmu.Lock()
		defer kmu.Unlock()
		if !finished {
			kills.Add(1)
			go func() { defer kills.Done(); killUID(req.UID, 5*time.Second) }()
		}
	}
	stopTimer := func() bool { return true }
	if req.TimeoutNs > 0 {
		t := time.AfterFunc(time.Duration(req.TimeoutNs), func() {
			timedOut.Store(true)
			killAll()
		})
		stopTimer = t.Stop
		defer t.Stop()
	}
	var wmu sync.Mutex
	if err := writeJSONFrame(c, FrameReply, wireExecReply{ID: cmd.id, Pid: cmd.pid}); err != nil {
		killAll()
	}
	closeStdin := func() {}
	if stdin != nil {
		var once sync.Once
		closeStdin = func() { once.Do(func() { stdin.Close() }) }
	}
	go s.execReader(c, cmd, stdin, closeStdin, killAll)

	var wg sync.WaitGroup
	pump := func(f *os.File, typ byte, over *atomic.Bool, onOver func()) {
		defer wg.Done()
		bp := bufPool.Get().(*[]byte)
		defer bufPool.Put(bp)
		buf := *bp
		var sent int64
		broken := false
		for {
			n, err := f.Read(buf[headerSize:])
			if n > 0 && !broken && !over.Load() {
				if req.OutLimit > 0 && sent+int64(n) > req.OutLimit {
					n = int(req.OutLimit - sent)
					over.Store(true)
					if onOver != nil {
						onOver()
					}
				}
				sent += int64(n)
				if n > 0 {
					wmu.Lock()
					werr := writeDataFrame(c, typ, buf, n)
					wmu.Unlock()
					if werr != nil {
						broken = true
						killAll()
					}
				}
			}
			if err != nil {
				return
			}
		}
	}
	wg.Add(2)
	go pump(stdout, FrameStdout, &outOver, killAll)
	go pump(stderr, FrameStderr, &errOver, nil)

	<-cmd.done
	wall := time.Since(start)
	// The time limit is the process's: what the run does after its exit
	// (killing leftovers, waiting for the forking thread to leave the
	// cgroups, which a loaded host can delay for seconds) is not timed.
	stopTimer()
	kmu.Lock()
	finished = true
	kmu.Unlock()
	kills.Wait()
	// The command is gone: so is everything it started. Then the pipes
	// have no writer left and the pumps end.
	leftover, _ := killUID(req.UID, 5*time.Second)
	// The thread that forked it joined the run's cgroups and exits with its
	// goroutine, soon after the fork but not at once on a loaded host: the
	// run ends when it is gone, so that the cgroups hold nothing of the
	// agent when the host looks at them. (5 s was not enough once, with
	// two test suites at once on 2 cores; a thread's exit always comes.)
	waitThreadGone(cmd.forker, 30*time.Second)
	pumped := make(chan struct{})
	go func() { wg.Wait(); close(pumped) }()
	select {
	case <-pumped:
	case <-time.After(time.Second):
		stdout.Close()
		stderr.Close()
		<-pumped
	}
	stdout.Close()
	stderr.Close()
	closeStdin()

	s.reaper.mu.Lock()
	ws := cmd.status
	s.reaper.mu.Unlock()
	ex := wireFnExit{WallNs: int64(wall), TimedOut: timedOut.Load(), OutOver: outOver.Load(), ErrOver: errOver.Load(), Leftover: leftover}
	if ws.Signaled() {
		ex.Code = 128 + int(ws.Signal())
		ex.Signal = unix.SignalName(ws.Signal())
		if ex.Signal == "" {
			ex.Signal = "SIG" + strconv.Itoa(int(ws.Signal()))
		}
	} else {
		ex.Code = ws.ExitStatus()
	}
	wmu.Lock()
	writeJSONFrame(c, FrameExit, ex)
	wmu.Unlock()
}

// recvFDs receives one byte carrying exactly n file descriptors.
func recvFDs(uc *net.UnixConn, n int) ([]int, error) {
	buf := make([]byte, 1)
	oob := make([]byte, unix.CmsgSpace(4*n))
	got, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, fmt.Errorf("receive cgroup files: %w", err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return nil, fmt.Errorf("receive cgroup files: %w", err)
	}
	var fds []int
	for _, m := range msgs {
		if r, err := unix.ParseUnixRights(&m); err == nil {
			fds = append(fds, r...)
		}
	}
	for _, fd := range fds {
		unix.CloseOnExec(fd)
	}
	if got != 1 || len(fds) != n {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, fmt.Errorf("receive cgroup files: want one byte and %d descriptors, got %d and %d", n, got, len(fds))
	}
	return fds, nil
}

// startFn forks req as uid:gid (no supplementary groups), in the cgroups
// whose tasks files are cgfds, and returns our ends of its pipes: stdin
// (nil without req.Stdin), stdout, stderr. The forking thread counts in
// the pids cgroup until it exits, so the host leaves room for it; right
// after the fork req.Pids is written to pidsMax (when >= 0), from the
// same thread: the run's own limit, exact from then on.
func (s *Server) startFn(cmd *command, req *wireFnRun, cgfds []int, pidsMax int) ([3]*os.File, *wireError) {
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
	env, err := mergeEnv(nil, req.Env)
	if err != nil {
		return fail(CodeInvalid, err.Error())
	}
	if !filepath.IsAbs(req.Cwd) {
		return fail(CodeInvalid, "cwd "+strconv.Quote(req.Cwd)+": must be an absolute path")
	}
	path, werr := lookPath(req.Args[0], env, req.Cwd)
	if werr != nil {
		return files, werr
	}
	child := [3]int{-1, -1, -1}
	var ours [3]int
	ours = [3]int{-1, -1, -1}
	cleanup := func() {
		for _, fd := range append(child[:], ours[:]...) {
			if fd >= 0 {
				syscall.Close(fd)
			}
		}
	}
	if req.Stdin {
		child[0], ours[0], err = pipe()
	} else {
		child[0], err = syscall.Open("/dev/null", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	}
	for i := 1; i <= 2 && err == nil; i++ {
		ours[i], child[i], err = pipe()
	}
	if err != nil {
		cleanup()
		return fail(CodeIO, "pipe: "+err.Error())
	}
	for _, fd := range ours {
		if fd >= 0 {
			syscall.SetNonblock(fd, true)
		}
	}
	cmd.id = s.nextID()
	attr := &syscall.ProcAttr{
		Dir:   req.Cwd,
		Env:   env,
		Files: []uintptr{uintptr(child[0]), uintptr(child[1]), uintptr(child[2])},
		Sys: &syscall.SysProcAttr{
			Setpgid:    true,
			Credential: &syscall.Credential{Uid: uint32(req.UID), Gid: uint32(req.GID), Groups: []uint32{}},
		},
	}
	fork := func() (int, error) {
		fnForkMu.Lock()
		defer fnForkMu.Unlock()
		unix.Prlimit(0, unix.RLIMIT_CORE, &unix.Rlimit{}, nil) // no core files in the box
		if req.Stack > 0 {
			var old unix.Rlimit
			if err := unix.Prlimit(0, unix.RLIMIT_STACK, nil, &old); err == nil {
				lim := unix.Rlimit{Cur: min(uint64(req.Stack), old.Max), Max: old.Max}
				if unix.Prlimit(0, unix.RLIMIT_STACK, &lim, nil) == nil {
					defer unix.Prlimit(0, unix.RLIMIT_STACK, &old, nil)
				}
			}
		}
		return s.reaper.start(cmd, func() (int, error) { return syscall.ForkExec(path, req.Args, attr) })
	}
	var pid int
	if len(cgfds) == 0 {
		pid, err = s.spawn.fork(fork)
	} else {
		type forked struct {
			pid, tid int
			err      error
		}
		ch := make(chan forked, 1)
		// This thread joins the run's cgroups, so it must not run
		// anything else, and ends with fn; never the main thread, which
		// would stay in them, the agent's whole process listed there.
		goLocked(func() {
			tid := unix.Gettid()
			for _, fd := range cgfds {
				if _, err := unix.Write(fd, []byte("0")); err != nil {
					ch <- forked{tid: tid, err: fmt.Errorf("join cgroup: %w", err)}
					return
				}
			}
			commandSched(s.spawn.idle.Load()) // this thread ends with the goroutine
			pid, err := fork()
			if err == nil && pidsMax >= 0 {
				if _, werr := unix.Write(pidsMax, []byte(strconv.Itoa(req.Pids))); werr != nil {
					s.reaper.signalGroup(cmd, syscall.SIGKILL, false)
					err = fmt.Errorf("set pids.max: %w", werr)
				}
			}
			ch <- forked{pid, tid, err}
		})
		r := <-ch
		pid, err = r.pid, r.err
		cmd.forker = r.tid
	}
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
	if req.Stdin {
		files[0] = os.NewFile(uintptr(ours[0]), "stdin")
	}
	files[1] = os.NewFile(uintptr(ours[1]), "stdout")
	files[2] = os.NewFile(uintptr(ours[2]), "stderr")
	return files, nil
}

// waitThreadGone waits until the agent's thread tid has exited, or d has
// passed. tid 0: nothing to wait for.
func waitThreadGone(tid int, d time.Duration) {
	if tid == 0 {
		return
	}
	path := "/proc/self/task/" + strconv.Itoa(tid)
	deadline := time.Now().Add(d)
	for sleep := 50 * time.Microsecond; time.Now().Before(deadline); sleep = min(2*sleep, 10*time.Millisecond) {
		if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
			return
		}
		time.Sleep(sleep)
	}
}
