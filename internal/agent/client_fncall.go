package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"net"
	"time"

	"golang.org/x/sys/unix"
)

// FnFile is a file of a call, written into its box by FnPrepare.
type FnFile struct {
	Path string      // relative to the box
	Mode fs.FileMode // permission bits; 0 means 0644
	Data []byte
}

// FnPrepareRequest resets a sandbox for a call: see fncall.go.
type FnPrepareRequest struct {
	Box   string   // working directory of the call (absolute)
	Wipe  []string // shared writable directories to empty (/tmp, ...)
	UID   int      // the call's uid (> 0); the box is handed to it
	GID   int
	Files []FnFile // written into the box, owned by UID
	// Quick: the sandbox was reset since it last ran anything of UID, so
	// no process is killed, Wipe is not emptied and IPC is not checked;
	// the box is still emptied.
	Quick bool
}

// FnPrepareResult says what the reset found.
type FnPrepareResult struct {
	Killed  int      // processes of the uid that were still running
	Removed int      // entries removed
	Dirty   []string // what could not be cleaned: the sandbox must not be reused
}

// FnPrepare kills every process of req.UID, empties the box and the wipe
// directories, hands the box to the uid and writes the files.
func (c *Client) FnPrepare(ctx context.Context, req FnPrepareRequest) (FnPrepareResult, error) {
	w := wireFnPrepare{Box: req.Box, Wipe: req.Wipe, UID: req.UID, GID: req.GID, Quick: req.Quick}
	for _, f := range req.Files {
		w.Files = append(w.Files, wireFnFile{Path: f.Path, Mode: uint32(f.Mode.Perm())})
	}
	cc, err := c.open(ctx, OpFnPrepare, req.Box, w)
	if err != nil {
		return FnPrepareResult{}, err
	}
	defer cc.close()
	buf := make([]byte, headerSize+MaxDataChunk)
	for _, f := range req.Files {
		for b := f.Data; len(b) > 0; {
			n := copy(buf[headerSize:], b)
			b = b[n:]
			if err := writeDataFrame(cc, FrameData, buf, n); err != nil {
				return FnPrepareResult{}, cc.failedWrite(err)
			}
		}
		if err := writeFrame(cc, FrameEOF, nil); err != nil {
			return FnPrepareResult{}, cc.failedWrite(err)
		}
	}
	var rep wireFnPrepared
	if err := cc.readReply(&rep); err != nil {
		return FnPrepareResult{}, err
	}
	return FnPrepareResult(rep), nil
}

// FnRunRequest is one process of a call.
type FnRunRequest struct {
	Args []string
	Env  []string // the whole environment
	Cwd  string
	UID  int // > 0
	GID  int
	// Stdin is written to the process's stdin, which is then closed; nil
	// means /dev/null.
	Stdin       []byte
	Timeout     time.Duration // wall clock; 0 = none
	OutputLimit int64         // bytes kept of each of stdout and stderr; 0 = all
	StackBytes  int64         // RLIMIT_STACK of the process; 0 = the agent's
	// CgroupFDs are open "tasks" files of cgroup v1 hierarchies: the
	// process is born in those cgroups. The caller keeps and closes them.
	CgroupFDs []int
	// PidsMaxFD, if > 0, is the run's open pids.max file: the agent
	// writes Pids to it right after the fork (the forking thread counts
	// in the pids cgroup until then: leave room for it before).
	PidsMaxFD int
	Pids      int
}

// FnRunResult is how a run ended.
type FnRunResult struct {
	Stdout, Stderr []byte
	Code           int    // exit code, or 128+signal
	Signal         string // "SIGKILL", or "" for a normal exit
	TimedOut       bool   // killed by Timeout
	StdoutOver     bool   // stdout passed OutputLimit: the run was killed
	StderrOver     bool   // stderr passed OutputLimit: the rest was dropped
	Wall           time.Duration
	Leftover       int // processes still running when the command exited (killed)
}

// FnProcess is a started run.
type FnProcess struct {
	cc   *clientConn
	pid  int
	done chan struct{}
	res  FnRunResult
	err  error
}

// FnStart starts a run and returns once its process exists.
func (c *Client) FnStart(ctx context.Context, req FnRunRequest) (*FnProcess, error) {
	name := ""
	if len(req.Args) > 0 {
		name = req.Args[0]
	}
	w := wireFnRun{
		Args: req.Args, Env: req.Env, Cwd: req.Cwd, UID: req.UID, GID: req.GID,
		Stdin: req.Stdin != nil, TimeoutNs: int64(req.Timeout), OutLimit: req.OutputLimit,
		Stack: req.StackBytes, NFDs: len(req.CgroupFDs),
	}
	fds := req.CgroupFDs
	if req.PidsMaxFD > 0 && req.Pids > 0 {
		w.Pids = req.Pids
		fds = append(append([]int(nil), fds...), req.PidsMaxFD)
		w.NFDs = len(fds)
	}
	cc, err := c.open(ctx, OpFnRun, name, w)
	if err != nil {
		return nil, err
	}
	if len(fds) > 0 {
		uc, ok := cc.Conn.(*net.UnixConn)
		if !ok {
			cc.close()
			return nil, cc.protoErr("not a unix socket connection")
		}
		if _, _, err := uc.WriteMsgUnix([]byte{0}, unix.UnixRights(fds...), nil); err != nil {
			cc.close()
			return nil, cc.wrapErr(fmt.Errorf("send cgroup files: %w", err))
		}
	}
	var rep wireExecReply
	if err := cc.readReply(&rep); err != nil {
		cc.close()
		return nil, err
	}
	p := &FnProcess{cc: cc, pid: rep.Pid, done: make(chan struct{})}
	if req.Stdin != nil {
		go p.feed(req.Stdin)
	}
	go p.receive()
	return p, nil
}

// Pid is the process's pid in the sandbox.
func (p *FnProcess) Pid() int { return p.pid }

// feed writes stdin; a failure means the process stopped reading (or the
// run ended), which is the process's business.
func (p *FnProcess) feed(b []byte) {
	buf := make([]byte, headerSize+MaxDataChunk)
	for len(b) > 0 {
		n := copy(buf[headerSize:], b)
		b = b[n:]
		if writeDataFrame(p.cc, FrameData, buf, n) != nil {
			return
		}
	}
	writeFrame(p.cc, FrameEOF, nil)
}

func (p *FnProcess) receive() {
	defer close(p.done)
	defer p.cc.close()
	for {
		typ, payload, err := readFrame(p.cc)
		if err != nil {
			p.err = p.cc.wrapErr(fmt.Errorf("connection lost before the exit status: %w", unexpectedEOF(err)))
			return
		}
		switch typ {
		case FrameStdout:
			p.res.Stdout = append(p.res.Stdout, payload...)
		case FrameStderr:
			p.res.Stderr = append(p.res.Stderr, payload...)
		case FrameExit:
			var w wireFnExit
			if err := json.Unmarshal(payload, &w); err != nil {
				p.err = p.cc.protoErr("bad exit status: " + err.Error())
				return
			}
			p.res.Code, p.res.Signal, p.res.TimedOut = w.Code, w.Signal, w.TimedOut
			p.res.StdoutOver, p.res.StderrOver = w.OutOver, w.ErrOver
			p.res.Wall, p.res.Leftover = time.Duration(w.WallNs), w.Leftover
			return
		case FrameError:
			p.err = p.cc.agentErr(payload)
			return
		default:
			p.err = p.cc.protoErr(fmt.Sprintf("unexpected frame %q", typ))
			return
		}
	}
}

// Done is closed when the run is over (or the connection lost).
func (p *FnProcess) Done() <-chan struct{} { return p.done }

// Wait waits for the run to end and returns its result.
func (p *FnProcess) Wait() (FnRunResult, error) {
	<-p.done
	return p.res, p.err
}

// Kill closes the connection: the agent kills the run (every process of
// its uid).
func (p *FnProcess) Kill() { p.cc.close() }
