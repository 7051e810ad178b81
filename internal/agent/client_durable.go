package agent

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// Durable commands, host side. See durable.go for the protocol.

// Winsize is a terminal's size.
type Winsize struct{ Rows, Cols uint16 }

// StartRequest describes a durable command.
type StartRequest struct {
	ExecRequest
	// LogCap bounds the command's output log in bytes (0 = no cap); output
	// beyond it is dropped and counted.
	LogCap int64
	// PTY, when set, runs the command under a pseudo-terminal of that size.
	PTY *Winsize
}

// RecordKind is the type of one record of a command's output log.
type RecordKind byte

const (
	RecordStdout    RecordKind = RecordKind(FrameStdout)
	RecordStderr    RecordKind = RecordKind(FrameStderr)
	RecordTruncated RecordKind = RecordKind(FrameTruncated)
)

// LogRecordHeader is the size of a record's header in a command's output
// log: the record kind (1 byte) and the data length (4 bytes, big-endian).
// A record takes LogRecordHeader+len(data) bytes of log.
const LogRecordHeader = headerSize

// Record is one item received from an attachment: output, or (Exit != nil)
// the exit status, which comes last.
type Record struct {
	Kind RecordKind
	Data []byte
	Exit *ExitStatus
	// End is the log offset just past this record.
	End int64
}

// Attachment streams a durable command's records from an offset. Recv and
// Ack/Done may be called from different goroutines.
type Attachment struct {
	cc  *clientConn
	id  string
	pid int
	pos int64

	wmu sync.Mutex // serializes Ack and Done
}

// ID is the agent's ID of the command.
func (a *Attachment) ID() string { return a.id }

// Pid is the command's pid in the sandbox.
func (a *Attachment) Pid() int { return a.pid }

// Start starts a durable command and returns an attachment from offset 0.
// Unlike Exec, closing the attachment (or ctx ending) does not stop the
// command: attach again with Attach.
func (c *Client) Start(ctx context.Context, req StartRequest) (*Attachment, error) {
	name := ""
	if len(req.Args) > 0 {
		name = req.Args[0]
	}
	w := wireExecRequest{
		Args: req.Args, Env: req.Env, Cwd: req.Cwd, Stdin: req.Stdin, TimeoutNs: int64(req.Timeout),
		Durable: true, LogCap: req.LogCap, User: c.userOf(&req.ExecRequest),
	}
	if req.PTY != nil {
		w.PTY = &wireWinsize{Rows: req.PTY.Rows, Cols: req.PTY.Cols}
	}
	return c.attachOp(ctx, OpExec, name, w, 0)
}

// Attach streams a durable command's records from log offset from, which
// must not be below what was acknowledged.
func (c *Client) Attach(ctx context.Context, id string, from int64) (*Attachment, error) {
	return c.attachOp(ctx, OpAttach, id, wireAttachRequest{ID: id, From: from}, from)
}

func (c *Client) attachOp(ctx context.Context, op Op, name string, req any, from int64) (*Attachment, error) {
	cc, err := c.open(ctx, op, name, req)
	if err != nil {
		return nil, err
	}
	var rep wireExecReply
	if err := cc.readReply(&rep); err != nil {
		cc.close()
		return nil, err
	}
	return &Attachment{cc: cc, id: rep.ID, pid: rep.Pid, pos: from}, nil
}

// Recv returns the next record; the one with Exit set is the last.
func (a *Attachment) Recv() (Record, error) {
	typ, payload, err := readFrame(a.cc)
	if err != nil {
		return Record{}, a.cc.wrapErr(fmt.Errorf("attachment lost: %w", unexpectedEOF(err)))
	}
	switch typ {
	case FrameStdout, FrameStderr, FrameTruncated:
		a.pos += int64(headerSize + len(payload))
		return Record{Kind: RecordKind(typ), Data: payload, End: a.pos}, nil
	case FrameExit:
		var w wireExit
		if err := json.Unmarshal(payload, &w); err != nil {
			return Record{}, a.cc.protoErr("bad exit status: " + err.Error())
		}
		ex := ExitStatus(w)
		return Record{Exit: &ex, End: a.pos}, nil
	case FrameError:
		return Record{}, a.cc.agentErr(payload)
	}
	return Record{}, a.cc.protoErr(fmt.Sprintf("unexpected frame %q", typ))
}

// Ack tells the agent the log is stored up to off: it may drop those bytes.
func (a *Attachment) Ack(off int64) error {
	a.wmu.Lock()
	defer a.wmu.Unlock()
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(off))
	return writeFrame(a.cc, FrameAck, b[:])
}

// doneTimeout bounds how long Done waits for the agent's confirmation.
const doneTimeout = 5 * time.Second

// Done tells the agent that the exit status is recorded, so that it forgets
// the command (its record and whatever output it still holds), and waits
// until the agent confirms by closing the connection: when Done returns
// nil, the agent holds nothing more of the command. Call it after the exit
// record (not concurrently with Recv), then Close.
func (a *Attachment) Done() error {
	a.wmu.Lock()
	err := writeFrame(a.cc, FrameEOF, nil)
	a.wmu.Unlock()
	if err != nil {
		return a.cc.wrapErr(fmt.Errorf("acknowledge the end of command %s: %w", a.id, err))
	}
	a.cc.SetReadDeadline(time.Now().Add(doneTimeout))
	var buf [64]byte
	for {
		if _, err := a.cc.Read(buf[:]); err != nil {
			if err == io.EOF {
				return nil
			}
			return a.cc.wrapErr(fmt.Errorf("acknowledge the end of command %s: no confirmation from the agent: %w", a.id, err))
		}
	}
}

// Close closes the attachment; the command goes on.
func (a *Attachment) Close() error {
	a.cc.close()
	return nil
}

// SendStdin writes data to a durable command's stdin and, if close is set,
// closes it (under a pty: sends ^D).
func (c *Client) SendStdin(ctx context.Context, id string, data []byte, close bool) error {
	cc, err := c.open(ctx, OpStdin, id, wireStdinRequest{ID: id, Close: close})
	if err != nil {
		return err
	}
	defer cc.close()
	if err := cc.readReply(nil); err != nil {
		return err
	}
	var hdr [headerSize]byte
	hdr[0] = FrameData
	for len(data) > 0 {
		n := min(len(data), MaxDataChunk)
		binary.BigEndian.PutUint32(hdr[1:], uint32(n))
		bufs := net.Buffers{hdr[:], data[:n]}
		if _, err := bufs.WriteTo(cc.Conn); err != nil {
			return cc.failedWrite(err)
		}
		data = data[n:]
	}
	if err := writeFrame(cc, FrameEOF, nil); err != nil {
		return cc.failedWrite(err)
	}
	return cc.readReply(nil)
}

// Resize sets the window size of a durable command's pty.
func (c *Client) Resize(ctx context.Context, id string, size Winsize) error {
	return c.unary(ctx, OpResize, id, wireResizeRequest{ID: id, Size: wireWinsize{Rows: size.Rows, Cols: size.Cols}}, nil)
}

// SignalCommand sends sig to a command's process group by ID.
func (c *Client) SignalCommand(ctx context.Context, id string, sig int) error {
	return c.unary(ctx, OpSignal, id, wireSignalRequest{ID: id, Signal: sig}, nil)
}

// CommandInfo is the agent's view of a durable command.
type CommandInfo struct {
	ID     string
	Pid    int
	Base   int64 // oldest unacknowledged log offset
	End    int64 // log offset past the last record
	Exited bool
}

// Commands lists the durable commands the agent holds (running, or exited
// but not yet recorded by the node).
func (c *Client) Commands(ctx context.Context) ([]CommandInfo, error) {
	var ws []wireCommandInfo
	if err := c.unary(ctx, OpCommands, "", struct{}{}, &ws); err != nil {
		return nil, err
	}
	out := make([]CommandInfo, len(ws))
	for i, w := range ws {
		out[i] = CommandInfo(w)
	}
	return out, nil
}
