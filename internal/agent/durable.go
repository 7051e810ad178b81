package agent

import (
	"encoding/binary"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Durable commands.
//
// A command started with wireExecRequest.Durable outlives the connection that
// started it. Its output is a log of records, each one frame as on the wire
// (type 'O' stdout, 'E' stderr or 'T' truncated, 4-byte length, data), and a
// byte offset in that log names a position exactly: the node stores the
// records it receives in a file in the same format, so agent offsets and log
// file offsets are the same numbers.
//
// The agent keeps every record until the node acknowledges it (FrameAck
// with the offset up to which it has stored the log). While more than
// maxUnacked bytes are unacknowledged (no node attached, say, while `shoal
// serve` restarts) the agent stops reading the command's pipes: the command
// blocks on its next write instead of losing output. When the node attaches
// again (OpAttach from the offset its log ends at) the agent resends from
// there, then the exit status (FrameExit); the node answers FrameEOF once it
// has recorded the exit, and the agent forgets the command: its record, its
// unacknowledged output and every map entry go at once, and the agent closes
// the connection, which tells the node it has (Attachment.Done waits for
// that). A command whose end the node never acknowledges (the node is gone
// for good, or lost the connection at the wrong moment and never came back)
// is kept only while fewer than Config.MaxExited such commands, holding less
// than Config.MaxExitedBytes of output, have exited after it: past that the
// oldest is forgotten, with a warning, and an attach to it fails with
// CodeNotExist.
//
// Output beyond the command's log cap is dropped, counted, and reported:
// one 'T' record (payload: 8-byte count of the first dropped chunk) marks
// where, and the exit status carries the total.

// maxUnacked bounds the unacknowledged output the agent holds per command.
const maxUnacked = 1 << 20

// durableChunk is the largest record a durable command's output is read in.
const durableChunk = 256 << 10

// durableFirstRead is the size of a durable command's first read of each
// output stream; reads that fill it double it, up to durableChunk.
const durableFirstRead = 4 << 10

type outRec struct {
	typ  byte
	data []byte
}

func (r outRec) size() int64 { return int64(headerSize + len(r.data)) }

// durable is the agent's state of one durable command.
type durable struct {
	cmd    *command
	stdin  *os.File // nil when the command has no stdin pipe
	pty    *os.File // the pty master when it runs under a pty, else nil
	logCap int64

	stdinMu sync.Mutex // serializes stdin writers

	mu        sync.Mutex
	changed   chan struct{} // closed and replaced on every change
	recs      []outRec      // unacknowledged records, oldest first
	waiting   int           // readers waiting in add for the node to acknowledge
	base      int64         // log offset of recs[0]
	end       int64         // log offset just past the last record
	unacked   int           // data bytes in recs
	dropped   int64         // output bytes dropped past logCap
	truncated bool          // the 'T' record has been added
	exit      *wireExit     // set once the command exited and its output is in recs
	attachGen int           // the newest attach; older attach loops stop
	forgotten bool          // dropped from the server: attach loops stop

	// Guarded by Server.mu: the server's list of exited commands.
	prev, next *durable
	listed     bool
	exitedAt   time.Time
}

// exitedList is a list of exited durable commands, oldest first.
type exitedList struct {
	head, tail *durable
	n          int
}

func (l *exitedList) push(d *durable) {
	d.prev, d.next, d.listed = l.tail, nil, true
	if l.tail != nil {
		l.tail.next = d
	} else {
		l.head = d
	}
	l.tail = d
	l.n++
}

func (l *exitedList) remove(d *durable) {
	if !d.listed {
		return
	}
	if d.prev != nil {
		d.prev.next = d.next
	} else {
		l.head = d.next
	}
	if d.next != nil {
		d.next.prev = d.prev
	} else {
		l.tail = d.prev
	}
	d.prev, d.next, d.listed = nil, nil, false
	l.n--
}

func (d *durable) notifyLocked() {
	close(d.changed)
	d.changed = make(chan struct{})
}

// add appends a record of output, waiting while too much is unacknowledged.
func (d *durable) add(typ byte, data []byte) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.logCap > 0 && d.end+int64(headerSize+len(data)) > d.logCap {
		d.dropped += int64(len(data))
		if !d.truncated {
			d.truncated = true
			var b [8]byte
			binary.BigEndian.PutUint64(b[:], uint64(len(data)))
			d.appendLocked(outRec{typ: FrameTruncated, data: b[:]})
		}
		return
	}
	for d.unacked >= maxUnacked {
		ch := d.changed
		d.waiting++
		d.mu.Unlock()
		<-ch
		d.mu.Lock()
		d.waiting--
	}
	d.appendLocked(outRec{typ: typ, data: append([]byte(nil), data...)})
}

func (d *durable) appendLocked(r outRec) {
	d.recs = append(d.recs, r)
	d.end += r.size()
	d.unacked += len(r.data)
	d.notifyLocked()
}

// ack drops the records the node has stored (those ending at or before off).
func (d *durable) ack(off int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	i := 0
	for i < len(d.recs) && d.base+d.recs[i].size() <= off {
		d.base += d.recs[i].size()
		d.unacked -= len(d.recs[i].data)
		i++
	}
	if i > 0 {
		d.recs = append(d.recs[:0:0], d.recs[i:]...)
		d.notifyLocked()
	}
}

func (d *durable) info() wireCommandInfo {
	d.mu.Lock()
	defer d.mu.Unlock()
	return wireCommandInfo{ID: d.cmd.id, Pid: d.cmd.pid, Base: d.base, End: d.end, Exited: d.exit != nil}
}

// execDurable starts a durable command and attaches c to it from offset 0.
func (s *Server) execDurable(c net.Conn, req *wireExecRequest) {
	cmd := &command{done: make(chan struct{})}
	files, werr := s.startCommand(cmd, req)
	if werr != nil {
		writeJSONFrame(c, FrameError, werr)
		return
	}
	d := &durable{cmd: cmd, stdin: files[0], logCap: req.LogCap, changed: make(chan struct{})}
	if req.PTY != nil {
		d.pty = files[1]
	}
	s.mu.Lock()
	s.cmds[cmd.id] = cmd
	s.durables[cmd.id] = d
	s.mu.Unlock()
	if req.TimeoutNs > 0 {
		t := time.AfterFunc(time.Duration(req.TimeoutNs), func() {
			s.reaper.signalGroup(cmd, syscall.SIGKILL, true)
		})
		go func() { <-cmd.done; t.Stop() }()
	}
	go s.collect(d, files)
	if err := writeJSONFrame(c, FrameReply, wireExecReply{ID: cmd.id, Pid: cmd.pid}); err != nil {
		return // the node will attach again
	}
	s.attachLoop(c, d, 0)
}

// collect pumps the command's output into its records and, once it has
// exited and its output is drained, records its exit status.
func (s *Server) collect(d *durable, files [3]*os.File) {
	outs := []struct {
		f   *os.File
		typ byte
	}{{files[1], FrameStdout}}
	if files[2] != nil {
		outs = append(outs, struct {
			f   *os.File
			typ byte
		}{files[2], FrameStderr})
	}
	var wg sync.WaitGroup
	for _, o := range outs {
		wg.Add(1)
		go func(f *os.File, typ byte) {
			defer wg.Done()
			// Bigger pipes and reads than the non-durable exec: fewer,
			// larger records when a command floods its output.
			if rc, err := f.SyscallConn(); err == nil {
				rc.Control(func(fd uintptr) { unix.FcntlInt(fd, unix.F_SETPIPE_SZ, durableChunk) })
			}
			// The buffer starts small and doubles while reads fill it:
			// most commands print little, and a fresh 256 KiB per stream
			// was most of what an exec allocated (its pages faulted in
			// and zeroed on the way to a resumed sandbox's first exec).
			buf := make([]byte, durableFirstRead)
			for {
				n, err := f.Read(buf)
				if n > 0 {
					d.add(typ, buf[:n])
				}
				if n == len(buf) && len(buf) < durableChunk {
					buf = make([]byte, min(2*len(buf), durableChunk))
				}
				if err != nil {
					return
				}
			}
		}(o.f, o.typ)
	}
	pumped := make(chan struct{})
	go func() { wg.Wait(); close(pumped) }()
	<-d.cmd.done
	// Time spent waiting for the node to acknowledge (it is slow, or
	// restarting, or its disk is full) does not count against the grace.
	fs := make([]*os.File, len(outs))
	for i, o := range outs {
		fs[i] = o.f
	}
	awaitOutput(pumped, s.cfg.OutputGrace, fs, func(pending bool) bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		return pending || d.waiting > 0
	})
	for _, o := range outs {
		o.f.Close()
	}
	if d.stdin != nil && d.stdin != d.pty {
		d.stdinMu.Lock()
		d.stdin.Close()
		d.stdinMu.Unlock()
	}
	s.reaper.mu.Lock()
	ws, timedOut := d.cmd.status, d.cmd.timedOut
	s.reaper.mu.Unlock()
	ex := exitOf(ws, timedOut)
	// The exit is set and the command listed as exited in one step (under
	// s.mu), so that whoever sees the exit also sees the command listed.
	s.mu.Lock()
	d.mu.Lock()
	ex.Dropped = d.dropped
	d.exit = &ex
	d.notifyLocked()
	d.mu.Unlock()
	delete(s.cmds, d.cmd.id) // no more signals: the pid may be reused
	if s.durables[d.cmd.id] == d {
		d.exitedAt = time.Now()
		s.exited.push(d)
	}
	over := s.overflowLocked()
	s.mu.Unlock()
	for _, o := range over {
		n := o.drop()
		s.log.Warn("forgetting an exited command whose end the node never acknowledged: its exit status and unacknowledged output are dropped",
			"cmd", o.cmd.id, "exited_ago", time.Since(o.exitedAt).Round(time.Millisecond).String(), "unacked_bytes", n,
			"max_exited", s.cfg.MaxExited, "max_exited_bytes", s.cfg.MaxExitedBytes)
	}
}

// overflowLocked unlinks the oldest exited commands while more than
// MaxExited of them, or more than MaxExitedBytes of their output, are held,
// and returns them (to drop and log outside s.mu).
func (s *Server) overflowLocked() []*durable {
	var out []*durable
	pop := func() *durable {
		d := s.exited.head
		s.exited.remove(d)
		delete(s.durables, d.cmd.id)
		out = append(out, d)
		return d
	}
	for s.exited.n > s.cfg.MaxExited {
		pop()
	}
	var held int64
	for d := s.exited.head; d != nil; d = d.next {
		held += d.held()
	}
	for held > s.cfg.MaxExitedBytes && s.exited.head != nil {
		held -= pop().held()
	}
	return out
}

// held is the unacknowledged output d holds.
func (d *durable) held() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return int64(d.unacked)
}

// forget drops d once the node has recorded its end.
func (s *Server) forget(d *durable) {
	s.mu.Lock()
	if s.durables[d.cmd.id] == d {
		delete(s.durables, d.cmd.id)
	}
	s.exited.remove(d)
	s.mu.Unlock()
	d.drop()
}

// drop releases what d holds and stops its attach loops; it returns the
// unacknowledged output bytes that were dropped.
func (d *durable) drop() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := d.unacked
	d.recs, d.unacked, d.forgotten = nil, 0, true
	d.notifyLocked()
	return n
}

// exitOf turns a wait status into the wire exit status.
func exitOf(ws syscall.WaitStatus, timedOut bool) wireExit {
	var ex wireExit
	if ws.Signaled() {
		ex.Code = 128 + int(ws.Signal())
		ex.Signal = unix.SignalName(ws.Signal())
		if ex.Signal == "" {
			ex.Signal = "SIG" + strconv.Itoa(int(ws.Signal()))
		}
		ex.TimedOut = timedOut
	} else {
		ex.Code = ws.ExitStatus()
	}
	return ex
}

// durable returns the durable command id, or sends an error on c and
// returns nil.
func (s *Server) durable(c net.Conn, id string) *durable {
	s.mu.Lock()
	d := s.durables[id]
	s.mu.Unlock()
	if d == nil {
		sendError(c, CodeNotExist, "no command "+strconv.Quote(id)+" (it ended and was recorded, or the agent restarted, or it ended unacknowledged and was forgotten)")
	}
	return d
}

// attach serves OpAttach: stream a durable command's records from an offset.
func (s *Server) attach(c net.Conn, req *wireAttachRequest) {
	d := s.durable(c, req.ID)
	if d == nil {
		return
	}
	d.mu.Lock()
	base, end := d.base, d.end
	d.mu.Unlock()
	if req.From < base || req.From > end {
		sendError(c, CodeInvalid, "offset "+strconv.FormatInt(req.From, 10)+" is outside the unacknowledged range ["+
			strconv.FormatInt(base, 10)+", "+strconv.FormatInt(end, 10)+"]")
		return
	}
	if err := writeJSONFrame(c, FrameReply, wireExecReply{ID: d.cmd.id, Pid: d.cmd.pid}); err != nil {
		return
	}
	s.attachLoop(c, d, req.From)
}

// attachLoop sends d's records from pos, then its exit status, and reads
// the node's acknowledgements. A newer attach to the same command ends it.
func (s *Server) attachLoop(c net.Conn, d *durable, pos int64) {
	d.mu.Lock()
	d.attachGen++
	gen := d.attachGen
	d.mu.Unlock()

	gone := make(chan struct{})
	go func() {
		defer close(gone)
		for {
			typ, payload, err := readFrame(c)
			if err != nil {
				return
			}
			switch typ {
			case FrameAck:
				if len(payload) == 8 {
					d.ack(int64(binary.BigEndian.Uint64(payload)))
				}
			case FrameEOF: // the node recorded the exit: forget the command
				d.mu.Lock()
				done := d.exit != nil
				d.mu.Unlock()
				if done {
					s.forget(d)
				}
				return // attachLoop returns and the connection is closed
			}
		}
	}()

	var batch []outRec
	for {
		d.mu.Lock()
		for d.attachGen == gen && pos == d.end && d.exit == nil && !d.forgotten {
			ch := d.changed
			d.mu.Unlock()
			select {
			case <-ch:
			case <-gone:
				return
			}
			d.mu.Lock()
		}
		if d.forgotten {
			d.mu.Unlock()
			sendError(c, CodeNotExist, "command "+strconv.Quote(d.cmd.id)+" was forgotten: it exited and the node did not acknowledge its end before too many other commands exited")
			return
		}
		if d.attachGen != gen || pos < d.base {
			d.mu.Unlock()
			return
		}
		batch = batch[:0]
		off := d.base
		for _, r := range d.recs {
			if off >= pos {
				batch = append(batch, r)
			}
			off += r.size()
		}
		end, exit := d.end, d.exit
		d.mu.Unlock()
		for _, r := range batch {
			var hdr [headerSize]byte
			hdr[0] = r.typ
			binary.BigEndian.PutUint32(hdr[1:], uint32(len(r.data)))
			bufs := net.Buffers{hdr[:], r.data} // one writev, no copy
			if _, err := bufs.WriteTo(c); err != nil {
				return
			}
		}
		pos = end
		if exit != nil {
			if err := writeJSONFrame(c, FrameExit, exit); err != nil {
				return
			}
			<-gone // until the node's FrameEOF (or it goes away)
			return
		}
	}
}

// stdinOp serves OpStdin: Q{id, close} → R(ready); D* F → R{}.
func (s *Server) stdinOp(c net.Conn, req *wireStdinRequest) {
	d := s.durable(c, req.ID)
	if d == nil {
		return
	}
	if d.stdin == nil {
		sendError(c, CodeInvalid, "command "+req.ID+" was started without stdin")
		return
	}
	if err := writeFrame(c, FrameReply, []byte("{}")); err != nil {
		return
	}
	d.stdinMu.Lock()
	defer d.stdinMu.Unlock()
	broken := false
	for {
		typ, payload, err := readFrame(c)
		if err != nil {
			return
		}
		switch typ {
		case FrameData:
			if !broken {
				if err := writeStdin(d.stdin, payload, c); err != nil {
					if err == errPeerGone {
						return
					}
					broken = true // the command closed its stdin or exited
				}
			}
		case FrameEOF:
			if req.Close && d.pty == nil {
				d.stdin.Close()
			} else if req.Close && d.pty != nil {
				// A terminal has no end of input: send ^D, as a user would.
				writeStdin(d.stdin, []byte{4}, c)
			}
			writeFrame(c, FrameReply, []byte("{}"))
			return
		}
	}
}

// resize serves OpResize.
func (s *Server) resize(c net.Conn, req *wireResizeRequest) {
	d := s.durable(c, req.ID)
	if d == nil {
		return
	}
	if d.pty == nil {
		sendError(c, CodeInvalid, "command "+req.ID+" has no pty")
		return
	}
	if err := setWinsize(d.pty, req.Size); err != nil {
		sendOSError(c, err, "")
		return
	}
	writeFrame(c, FrameReply, []byte("{}"))
}

// commands serves OpCommands: the durable commands the agent holds.
func (s *Server) commands(c net.Conn) {
	s.mu.Lock()
	ds := make([]*durable, 0, len(s.durables))
	for _, d := range s.durables {
		ds = append(ds, d)
	}
	s.mu.Unlock()
	out := make([]wireCommandInfo, 0, len(ds))
	for _, d := range ds {
		out = append(out, d.info())
	}
	writeJSONFrame(c, FrameReply, out)
}

// openPTY returns a new pseudo-terminal pair (master non-blocking for the
// agent, slave for the command) with the given window size.
func openPTY(size wireWinsize) (master *os.File, slave int, err error) {
	m, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, -1, err
	}
	if err := unix.IoctlSetPointerInt(m, unix.TIOCSPTLCK, 0); err != nil {
		unix.Close(m)
		return nil, -1, err
	}
	n, err := unix.IoctlGetInt(m, unix.TIOCGPTN)
	if err != nil {
		unix.Close(m)
		return nil, -1, err
	}
	sl, err := unix.Open("/dev/pts/"+strconv.Itoa(n), unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(m)
		return nil, -1, err
	}
	unix.SetNonblock(m, true)
	master = os.NewFile(uintptr(m), "ptmx")
	if size.Rows > 0 && size.Cols > 0 {
		setWinsize(master, size)
	}
	return master, sl, nil
}

func setWinsize(f *os.File, size wireWinsize) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ierr error
	rc.Control(func(fd uintptr) {
		ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: size.Rows, Col: size.Cols})
	})
	return ierr
}

// pending is how many bytes wait in pipe f to be read (FIONREAD, which
// x/sys names TIOCINQ on Linux), 0 when it cannot tell.
func pending(f *os.File) int {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0
	}
	n := 0
	rc.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.TIOCINQ) })
	return n
}
