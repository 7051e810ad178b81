package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Config configures a Server.
type Config struct {
	// ReapAll makes the server reap every child of the process
	// (wait4(-1)), not only its own commands. Set it when the agent is PID 1
	// or a child subreaper; leave it false when the server shares its process
	// with code that waits for children of its own (tests).
	ReapAll bool
	// OutputGrace is how long, after a command's process exits, the server
	// keeps reading stdout/stderr that are still held open by processes the
	// command left running in the background. Default 100ms.
	OutputGrace time.Duration
	// Env is the environment every command starts from (req.Env is merged
	// over it). Default: the agent's own environment.
	Env []string
	// IdleRelease: once no connection has been open for this long, the
	// server returns all free memory to the OS (debug.FreeOSMemory: a GC
	// of a heap this small takes well under a millisecond). The runtime's
	// own scavenger keeps freed pages up to its 4 MiB minimum heap goal;
	// releasing them measured ~300 KiB less idle RSS. Zero disables it (a
	// server sharing its process with other code).
	IdleRelease time.Duration
	// Logger receives warnings; nil discards them. A *slog.Logger fits.
	Logger Logger
	// MaxExited bounds the durable commands that have exited but whose end
	// the node has not acknowledged yet (see durable.go): past it, the
	// oldest is forgotten, with a warning. Default DefaultMaxExited.
	MaxExited int
	// MaxExitedBytes bounds the unacknowledged output those commands hold,
	// likewise. Default DefaultMaxExitedBytes.
	MaxExitedBytes int64
	// Upper is the overlay's upper directory, opened before any workload
	// ran (a VM's, inside the guest): OpExportUpper streams it for a
	// commit (commit.go). nil: the writable layer is the host's to read
	// (containers), and the op is refused.
	Upper *os.File
	// SystemService: the agent is a service of a full system whose init
	// (PID 1) is not the agent (the fullvm backend): an export stops every
	// process but init and the agent, as PID 1 of a microVM stops all but
	// itself.
	SystemService bool
	// CommandsIdle: commands run under SCHED_IDLE (a best-effort
	// sandbox's; a pooled agent learns it from its claim). See AgentNice.
	CommandsIdle bool
	// CommandsCgroup, if set, is a cgroup v2 directory every command is
	// born in (clone3's CLONE_INTO_CGROUP), and CommandsCgroupPath its
	// path in its hierarchy (as /proc/PID/cgroup shows it): a VM's guest
	// bounds its commands' tasks there and an export freezes them there
	// (cgroup.go). nil: commands are born in the agent's groups
	// (containers: the host's cgroups bound the whole sandbox).
	CommandsCgroup     *os.File
	CommandsCgroupPath string
}

// Defaults of Config.MaxExited and Config.MaxExitedBytes.
const (
	DefaultMaxExited      = 256
	DefaultMaxExitedBytes = 16 << 20
)

// Logger is what the server logs through: the Warn method of *slog.Logger.
// The agent binary does not link log/slog (about 370 KiB of RSS in a process
// that runs thousands of times per node); it passes a tiny stderr logger.
type Logger interface {
	Warn(msg string, args ...any)
}

type discardLogger struct{}

func (discardLogger) Warn(string, ...any) {}

// Server serves the agent protocol. One Server per process: it owns the
// process's children (see reaper).
type Server struct {
	cfg    Config
	log    Logger
	reaper *reaper
	spawn  *spawner // forks the commands (see AgentNice)
	env    []string

	active     atomic.Int64  // open connections
	idleTimer  *time.Timer   // fires IdleRelease after active drops to 0; nil if disabled
	idleSince  atomic.Int64  // when idleTimer was last set (monotonic ns since start)
	releasedAt atomic.Uint64 // heapAllocs at the end of the last releaseMemory

	mu       sync.Mutex
	cmds     map[string]*command // guarded by mu; running commands by ID
	durables map[string]*durable // guarded by mu; durable commands not yet forgotten
	exited   exitedList          // guarded by mu; those of durables that exited, oldest first
	seq      uint64              // guarded by mu; command ID counter
	boot     string              // prefix of command IDs, from the server's start time

	exportMu sync.Mutex // held by an export of the writable layer (commit.go)
}

// requestTimeout bounds how long a new connection may take to send its
// request frame.
const requestTimeout = 30 * time.Second

// NewServer returns a server; it starts the child reaper at once, so it must
// be created before any child process of the agent is started.
func NewServer(cfg Config) *Server {
	if cfg.OutputGrace <= 0 {
		cfg.OutputGrace = 100 * time.Millisecond
	}
	if cfg.Env == nil {
		cfg.Env = os.Environ()
	}
	if cfg.MaxExited <= 0 {
		cfg.MaxExited = DefaultMaxExited
	}
	if cfg.MaxExitedBytes <= 0 {
		cfg.MaxExitedBytes = DefaultMaxExitedBytes
	}
	log := cfg.Logger
	if log == nil {
		log = discardLogger{}
	}
	s := &Server{
		cfg:      cfg,
		log:      log,
		reaper:   newReaper(cfg.ReapAll),
		spawn:    newSpawner(),
		env:      cfg.Env,
		cmds:     make(map[string]*command),
		durables: make(map[string]*durable),
		boot:     strconv.FormatInt(time.Now().UnixNano()%(1<<32), 36),
	}
	s.spawn.idle.Store(cfg.CommandsIdle)
	if cfg.IdleRelease > 0 {
		s.idleTimer = time.AfterFunc(time.Hour, func() { s.idleRelease() })
		s.idleTimer.Stop()
	}
	return s
}

// thawed tells whether the idle timer fired late, long after it was set:
// the agent was frozen meanwhile (a paused sandbox; the monotonic clock
// goes on under the freezer). Its pause paged its memory out already, and
// a release now — a collection walking the whole heap — would read every
// page of it back in while the request that resumed it waits (measured:
// the collector was much of the agents' CPU over 200 resumes).
func (s *Server) thawed() bool {
	late := time.Duration(monoNow()-s.idleSince.Load()) - s.cfg.IdleRelease
	return late > thawedLate
}

// thawedLate is how late the idle timer must fire to be taken for a thaw:
// far more than a busy scheduler delays a timer.
const thawedLate = 5 * time.Second

// monoNow is the monotonic clock, in ns since the process started.
func monoNow() int64 { return int64(time.Since(processStart)) }

var processStart = time.Now()

// idleRelease is the idle timer's release, made unless a connection is
// open, the timer fired late from a thaw, or too little was allocated
// since the last release for one to be worth its collection. It reports
// whether it released.
func (s *Server) idleRelease() bool {
	if s.active.Load() != 0 || s.thawed() || s.allocatedSinceRelease() < releaseMinAlloc {
		return false
	}
	s.releaseMemory()
	return true
}

// releaseMinAlloc is how much the agent must have allocated since its last
// release for the idle release to run: a release returns at most that
// (the last one returned everything free), and costs a collection that
// walks the whole heap. A resumed sandbox's first commands allocate a few
// KiB each, so its agent, whose pages the pause moved to swap, is not
// collected (reading them all back in: ~9 ms of CPU each, measured over
// 150 resumes) a second after each resume for nothing.
const releaseMinAlloc = 512 << 10

// allocatedSinceRelease is what the heap allocated since the last release
// (everything, before the first).
func (s *Server) allocatedSinceRelease() uint64 {
	return heapAllocs() - s.releasedAt.Load()
}

func heapAllocs() uint64 {
	m := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(m)
	return m[0].Value.Uint64()
}

// releaseMemory returns all free memory to the OS. Two collections: the
// first moves bufPool's buffers to its victim cache, the second frees them.
func (s *Server) releaseMemory() {
	runtime.GC()
	debug.FreeOSMemory()
	s.releasedAt.Store(heapAllocs())
}

// Listen returns the agent's listener: the already-listening unix socket
// passed as the file descriptor named by $SHOAL_AGENT_FD (the host bound it
// and runc passed it with --preserve-fds), or else a new unix socket at path
// (a stale socket file there is replaced). SHOAL_AGENT_FD is removed from the
// environment so that commands do not inherit it.
func Listen(path string) (net.Listener, error) {
	if s, ok := os.LookupEnv("SHOAL_AGENT_FD"); ok {
		os.Unsetenv("SHOAL_AGENT_FD")
		fd, err := strconv.Atoi(s)
		if err != nil || fd < 3 {
			return nil, fmt.Errorf("SHOAL_AGENT_FD=%q: want a file descriptor number >= 3", s)
		}
		f := os.NewFile(uintptr(fd), "shoal-agent-socket")
		l, err := net.FileListener(f) // dups the fd with close-on-exec
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("listen on fd %d: %w", fd, err)
		}
		return l, nil
	}
	if path == "" {
		return nil, errors.New("no socket: set SHOAL_AGENT_FD or pass --listen PATH")
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		os.Remove(path)
	}
	// ListenUnix, not net.Listen: the latter links the DNS resolver into
	// the agent (about 100 KiB more RSS) for nothing.
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	return l, nil
}

// Serve accepts connections until l is closed, serving each on its own
// goroutine.
func (s *Server) Serve(l net.Listener) error {
	var delay time.Duration
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			// EMFILE and friends: back off and retry, as net/http does.
			if delay == 0 {
				delay = 5 * time.Millisecond
			} else if delay < time.Second {
				delay *= 2
			}
			s.log.Warn("accept", "err", err, "retry_in", delay)
			time.Sleep(delay)
			continue
		}
		delay = 0
		go s.serveConn(c)
	}
}

// Shutdown SIGKILLs the process group of every running command. It does not
// wait; the caller (main, on SIGTERM) exits right after.
func (s *Server) Shutdown() {
	s.reaper.killAll()
}

func (s *Server) serveConn(c net.Conn) {
	s.active.Add(1)
	defer func() {
		c.Close()
		if s.active.Add(-1) == 0 && s.idleTimer != nil {
			s.idleSince.Store(monoNow())
			s.idleTimer.Reset(s.cfg.IdleRelease)
		}
	}()
	c.SetReadDeadline(time.Now().Add(requestTimeout))
	typ, payload, err := readFrame(c)
	if err != nil {
		if err != io.EOF {
			s.log.Warn("read request", "err", err)
		}
		return
	}
	c.SetReadDeadline(time.Time{})
	if typ != FrameRequest || len(payload) == 0 {
		sendError(c, CodeProtocol, "first frame must be a request")
		return
	}
	op, body := Op(payload[0]), payload[1:]
	if !s.admit(c, op) { // a pooled sandbox serves nothing before its claim (claim.go)
		return
	}
	switch op {
	case OpPing:
		var req wirePingRequest
		if len(body) == 0 || decode(c, body, &req) {
			s.ping(c, req.Release)
		}
	case OpClaim:
		s.claim(c, body)
	case OpExec:
		var req wireExecRequest
		if decode(c, body, &req) {
			s.exec(c, &req)
		}
	case OpSignal:
		var req wireSignalRequest
		if decode(c, body, &req) {
			s.signal(c, &req)
		}
	case OpAttach:
		var req wireAttachRequest
		if decode(c, body, &req) {
			s.attach(c, &req)
		}
	case OpStdin:
		var req wireStdinRequest
		if decode(c, body, &req) {
			s.stdinOp(c, &req)
		}
	case OpResize:
		var req wireResizeRequest
		if decode(c, body, &req) {
			s.resize(c, &req)
		}
	case OpCommands:
		s.commands(c)
	case OpExportUpper:
		var req wireExportRequest
		if decode(c, body, &req) {
			s.exportUpper(c, &req)
		}
	case OpPortForward:
		var req wirePortRequest
		if decode(c, body, &req) {
			s.portForward(c, &req)
		}
	case OpWatch:
		var req wireWatchRequest
		if decode(c, body, &req) {
			s.watch(c, &req)
		}
	case OpFnPrepare:
		var req wireFnPrepare
		if decode(c, body, &req) {
			s.fnPrepare(c, &req)
		}
	case OpFnRun:
		var req wireFnRun
		if decode(c, body, &req) {
			s.fnRun(c, &req)
		}
	case OpListDir:
		var req wireListRequest
		if decode(c, body, &req) {
			asUser(c, req.User, func() { listOp(c, &req) })
		}
	case OpUser:
		var req wireUserRequest
		if decode(c, body, &req) {
			lookupUserOp(c, &req)
		}
	case OpStat, OpReadFile, OpWriteFile, OpMakeDir, OpRemove:
		var req wirePathRequest
		if !decode(c, body, &req) {
			return
		}
		path, ok := cleanPath(req.Path)
		if !ok {
			sendError(c, CodeInvalid, errBadPath)
			return
		}
		var owner *userInfo
		if req.Owner != "" {
			if req.User != "" || (op != OpWriteFile && op != OpMakeDir) {
				sendError(c, CodeInvalid, "owner is taken by write and mkdir only, and not with user")
				return
			}
			u, werr := lookupUser(req.Owner)
			if werr != nil {
				writeJSONFrame(c, FrameError, requestUserErr(werr))
				return
			}
			owner = u
		}
		asUser(c, req.User, func() {
			switch op {
			case OpStat:
				stat(c, path, req.WithXattrs)
			case OpReadFile:
				readFile(c, path)
			case OpWriteFile:
				writeFile(c, path, req.Mode, req.Xattrs, owner)
			case OpMakeDir:
				makeDir(c, path, req.Mode, owner)
			case OpRemove:
				remove(c, path, req.Recursive)
			}
		})
	default:
		sendError(c, CodeUnsupported, fmt.Sprintf("op %s not supported by agent %s", op, Version))
	}
}

func decode(c net.Conn, body []byte, v any) bool {
	if err := json.Unmarshal(body, v); err != nil {
		sendError(c, CodeProtocol, "bad request: "+err.Error())
		return false
	}
	return true
}

func sendError(w io.Writer, code ErrorCode, msg string) error {
	return writeJSONFrame(w, FrameError, wireError{Code: code, Msg: msg})
}

func sendOSError(w io.Writer, err error, path string) error {
	return writeJSONFrame(w, FrameError, wireErr(err, path))
}

func (s *Server) ping(c net.Conn, release bool) {
	if release {
		s.releaseMemory()
	}
	rep := hello()
	rep.RSS = selfRSS()
	writeJSONFrame(c, FrameReply, rep)
}

// hello is what the agent says of itself: a ping's answer, and a claim's.
func hello() wirePingReply {
	return wirePingReply{Version: Version, Protocol: ProtocolVersion, Pid: os.Getpid(), Users: true, Xattrs: true, WatchUsers: true, Owners: true, WatchSync: true}
}

// selfRSS reads VmRSS from /proc/self/status; -1 if unavailable.
func selfRSS() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return -1
	}
	_, rest, ok := bytes.Cut(b, []byte("\nVmRSS:"))
	if !ok {
		return -1
	}
	line, _, _ := bytes.Cut(rest, []byte("\n"))
	kb, err := strconv.ParseInt(string(bytes.TrimSpace(bytes.TrimSuffix(bytes.TrimSpace(line), []byte("kB")))), 10, 64)
	if err != nil {
		return -1
	}
	return kb << 10
}

// signal delivers a signal to a running command's process group.
func (s *Server) signal(c net.Conn, req *wireSignalRequest) {
	if req.Signal <= 0 || req.Signal > 64 {
		sendError(c, CodeInvalid, "bad signal number "+strconv.Itoa(req.Signal))
		return
	}
	s.mu.Lock()
	cmd := s.cmds[req.ID]
	s.mu.Unlock()
	if cmd == nil || !s.reaper.signalGroup(cmd, syscall.Signal(req.Signal), false) {
		sendError(c, CodeNotExist, "no running command with this ID")
		return
	}
	writeFrame(c, FrameReply, emptyReply)
}
