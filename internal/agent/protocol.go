// Package agent is Shoal's guest agent: the server that runs as PID 1 of a
// container (or init of a VM) and serves exec and file operations to the
// host node over a unix socket, and the host-side Client that talks to it.
//
// # Wire protocol
//
// The host dials one stream connection per call. Everything on it is framed:
//
//	frame = type (1 byte) | length (4 bytes, big-endian) | payload (length bytes)
//
// The first frame from the client is a request: type FrameRequest, payload =
// op (1 byte, see Op) followed by the op's arguments as JSON. The agent answers
// with FrameReply (JSON) or FrameError (JSON {"code","msg"}). Bulk bytes travel
// raw in FrameData (at most MaxDataChunk per frame) and a stream ends with
// FrameEOF:
//
//	ping, stat, mkdir, remove, signal: Q → R | X
//	list:  Q → (D json-array-of-entries)* F | X
//	read:  Q → R(fileinfo) D* F | X (an X may also end the D stream)
//	write: Q → R(ready) | X;  then D* F → R({"size"}) | X
//	exec:  Q → R({"id","pid"}) | X;  then agent→client O/E (stdout/stderr
//	       chunks) … then exactly one Z (exit status JSON) and close;
//	       client→agent D (stdin) … F (close stdin); closing the
//	       connection before Z kills the command's process group.
//	portforward: Q({"port"}) → R | X;  then raw bytes both ways, unframed,
//	       until each side has closed its writing half (see portforward.go)
//	watch: Q({"path","recursive"}) → R | X;  then D(json-array-of-events)*
//	       until the client closes, or F when the watched path is gone;
//	       client→agent A(8-byte n) is answered, after the events of every
//	       change made before it, with R({"sync":n}) (see watch.go); list
//	       with "depth" > 1 walks subdirectories
//	exportupper: Q({"max_depth"}) → R | X;  then D* (a tar) F | X
//	       (a VM's writable layer for a commit; see commit.go)
//
// Control messages are small JSON objects; data is never JSON-encoded. Frame
// types are printable ASCII so that a hex dump of a capture reads easily.
package agent

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// ProtocolVersion is bumped on any incompatible change of the wire format.
const ProtocolVersion = 1

// Version is the agent's build version (set with -ldflags -X).
var Version = "0.1.0-dev"

// Frame types.
const (
	// Client → agent.
	FrameRequest byte = 'Q' // first frame: op byte + JSON arguments
	// Both directions.
	FrameData byte = 'D' // raw bytes: file content, stdin; JSON batches for list
	FrameEOF  byte = 'F' // end of a data stream (file end, stdin closed)
	// Agent → client.
	FrameReply  byte = 'R' // JSON reply
	FrameError  byte = 'X' // JSON wireError
	FrameStdout byte = 'O' // raw stdout chunk of a command
	FrameStderr byte = 'E' // raw stderr chunk of a command
	FrameExit   byte = 'Z' // JSON wireExit; the last frame of an exec stream
	// Durable commands (see durable.go).
	FrameAck       byte = 'A' // client → agent: 8-byte big-endian log offset recorded
	FrameTruncated byte = 'T' // agent → client: output past the log cap is dropped from here
)

// Op is the operation named by a request frame. Values are stable on the
// wire; new ops are appended, retired ones are never reused.
type Op uint8

const (
	OpPing      Op = 1
	OpExec      Op = 2
	OpSignal    Op = 3 // signal a running command by ID (its own connection)
	OpStat      Op = 4
	OpReadFile  Op = 5
	OpWriteFile Op = 6
	OpListDir   Op = 7
	OpMakeDir   Op = 8
	OpRemove    Op = 9
	// Reserved for what comes next, so the numbering stays stable:
	OpAttach      Op = 10 // re-attach to a durable command's output from a log offset
	OpPortForward Op = 11 // splice the connection to a TCP port inside the sandbox
	OpClaim       Op = 12 // reserved: hand a pre-started sandbox its root
	OpStdin       Op = 13 // write to (or close) a durable command's stdin
	OpCommands    Op = 14 // list the durable commands the agent holds
	OpResize      Op = 15 // set the window size of a durable command's pty
	OpWatch       Op = 16 // stream inotify events under a path (see watch.go)
	OpUser        Op = 17 // resolve a user of the sandbox (see users.go)
	OpExportUpper Op = 18 // stream the writable layer for a commit (VMs; see commit.go)
	OpFnPrepare   Op = 20 // fncall: reset a call's box and write its files (see fncall.go)
	OpFnRun       Op = 21 // fncall: run one process of a call in given cgroups (see fncall.go)
)

var opNames = [...]string{
	OpPing: "ping", OpExec: "exec", OpSignal: "signal", OpStat: "stat",
	OpReadFile: "read", OpWriteFile: "write", OpListDir: "list",
	OpMakeDir: "mkdir", OpRemove: "remove", OpAttach: "attach",
	OpPortForward: "portforward", OpClaim: "claim", OpStdin: "stdin",
	OpCommands: "commands", OpResize: "resize", OpWatch: "watch",
	OpFnPrepare: "fnprepare", OpFnRun: "fnrun", OpUser: "user",
	OpExportUpper: "exportupper",
}

func (o Op) String() string {
	if int(o) < len(opNames) && opNames[o] != "" {
		return opNames[o]
	}
	return fmt.Sprintf("op%d", uint8(o))
}

const (
	headerSize = 5
	// MaxDataChunk is the largest payload either side puts in a FrameData,
	// FrameStdout or FrameStderr frame.
	MaxDataChunk = 64 << 10
	// maxFrame bounds any frame a peer will accept (JSON requests carry
	// argv and env, which the kernel bounds to a few MiB anyway).
	maxFrame = 8 << 20
)

var errFrameTooLarge = errors.New("frame too large")

// writeFrame writes one frame with a single write call.
func writeFrame(w io.Writer, typ byte, payload []byte) error {
	buf := make([]byte, headerSize+len(payload))
	buf[0] = typ
	binary.BigEndian.PutUint32(buf[1:headerSize], uint32(len(payload)))
	copy(buf[headerSize:], payload)
	_, err := w.Write(buf)
	return err
}

// writeJSONFrame marshals v into one frame.
func writeJSONFrame(w io.Writer, typ byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return writeFrame(w, typ, b)
}

// writeDataFrame sends buf[headerSize:headerSize+n] as a frame of type typ;
// buf[:headerSize] is scratch space for the header, so data read straight
// into buf[headerSize:] goes out without a copy.
func writeDataFrame(w io.Writer, typ byte, buf []byte, n int) error {
	buf[0] = typ
	binary.BigEndian.PutUint32(buf[1:headerSize], uint32(n))
	_, err := w.Write(buf[:headerSize+n])
	return err
}

// readHeader reads a frame header and returns its type and payload length.
func readHeader(r io.Reader, hdr *[headerSize]byte) (byte, int, error) {
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, 0, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > maxFrame {
		return 0, 0, fmt.Errorf("%w: %d bytes", errFrameTooLarge, n)
	}
	return hdr[0], int(n), nil
}

// readFrame reads a whole frame into a new buffer.
func readFrame(r io.Reader) (byte, []byte, error) {
	var hdr [headerSize]byte
	typ, n, err := readHeader(r, &hdr)
	if err != nil {
		return 0, nil, err
	}
	payload := make([]byte, n)
	if _, err := io.ReadFull(r, payload); err != nil {
		return 0, nil, unexpectedEOF(err)
	}
	return typ, payload, nil
}

func unexpectedEOF(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// Wire messages. Field names are short and stable; the API types in
// client.go are built from them so that the API can change independently.

type wireError struct {
	Code ErrorCode `json:"code"`
	Msg  string    `json:"msg"`
}

type wirePingRequest struct {
	// Release: return free memory to the OS first (as after IdleRelease),
	// so that RSS is the agent's memory at rest.
	Release bool `json:"release,omitempty"`
}

type wirePingReply struct {
	Version  string `json:"version"`
	Protocol int    `json:"proto"`
	Pid      int    `json:"pid"`
	RSS      int64  `json:"rss"`
	// Users: the agent runs commands and file operations as a named
	// user (wireExecRequest.User, wirePathRequest.User, OpUser); an older
	// agent would ignore the field and act as root, so clients check this.
	Users bool `json:"users,omitempty"`
	// Xattrs: the agent sets and reads user.* extended attributes
	// (wirePathRequest.Xattrs, WithXattrs).
	Xattrs bool `json:"xattrs,omitempty"`
	// WatchUsers: a watch is armed as its request's user
	// (wireWatchRequest.User); an older agent would arm it as root.
	WatchUsers bool `json:"watch_users,omitempty"`
	// Owners: write and mkdir take an owner (wirePathRequest.Owner) to
	// give what they create to.
	Owners bool `json:"owners,omitempty"`
	// WatchSync: a watch answers a client's sync frame (see watch.go).
	WatchSync bool `json:"watch_sync,omitempty"`
}

type wireExecRequest struct {
	Args      []string `json:"args"`
	Env       []string `json:"env,omitempty"`
	Cwd       string   `json:"cwd,omitempty"`
	Stdin     bool     `json:"stdin,omitempty"`
	TimeoutNs int64    `json:"timeout_ns,omitempty"`
	// Durable: the command outlives this connection (see durable.go).
	Durable bool         `json:"durable,omitempty"`
	LogCap  int64        `json:"log_cap,omitempty"` // durable: output log bytes kept; 0 = no cap
	PTY     *wireWinsize `json:"pty,omitempty"`     // durable: run under a pseudo-terminal
	// User: run as this user of the sandbox (users.go); "" = the agent's
	// own identity (root). Agents that know it say so in their ping reply.
	User string `json:"user,omitempty"`
}

type wireWinsize struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

type wireAttachRequest struct {
	ID   string `json:"id"`
	From int64  `json:"from"`
}

type wireStdinRequest struct {
	ID    string `json:"id"`
	Close bool   `json:"close,omitempty"`
}

type wireResizeRequest struct {
	ID   string      `json:"id"`
	Size wireWinsize `json:"size"`
}

type wireCommandInfo struct {
	ID     string `json:"id"`
	Pid    int    `json:"pid"`
	Base   int64  `json:"base"` // log offset of the oldest unacknowledged byte
	End    int64  `json:"end"`  // log offset just past the last record
	Exited bool   `json:"exited,omitempty"`
}

type wireExecReply struct {
	ID  string `json:"id"` // command ID: the handle of the future durable command object
	Pid int    `json:"pid"`
}

type wireExit struct {
	Code     int    `json:"code"`
	Signal   string `json:"signal,omitempty"`
	TimedOut bool   `json:"timed_out,omitempty"`
	Dropped  int64  `json:"dropped,omitempty"` // durable: output bytes dropped past the log cap
}

type wireSignalRequest struct {
	ID     string `json:"id"`
	Signal int    `json:"signal"`
}

type wirePathRequest struct {
	Path      string `json:"path"`
	Mode      uint32 `json:"mode,omitempty"` // fs.FileMode bits (write, mkdir)
	Recursive bool   `json:"recursive,omitempty"`
	User      string `json:"user,omitempty"` // act as this user (users.go)
	// Owner (write, mkdir; not with User): act as the agent (root), then
	// give the file and each directory created for it to this user of
	// the sandbox, its uid and primary gid (as E2B's envd does).
	Owner string `json:"owner,omitempty"`
	// Xattrs: write sets these user.* extended attributes (names without
	// "user.") on the file; WithXattrs: stat reads them (xattrs.go).
	Xattrs     map[string]string `json:"xattrs,omitempty"`
	WithXattrs bool              `json:"with_xattrs,omitempty"`
}

type wireFileInfo struct {
	Name    string  `json:"name"`
	Size    int64   `json:"size"`
	Mode    uint32  `json:"mode"` // fs.FileMode bits, not unix st_mode
	MTimeNs int64   `json:"mtime_ns"`
	Link    string  `json:"link,omitempty"`
	UID     *uint32 `json:"uid,omitempty"` // owner (absent from older agents)
	GID     *uint32 `json:"gid,omitempty"`
	Owner   string  `json:"owner,omitempty"` // the uid's name in the sandbox's /etc/passwd, else the number
	Group   string  `json:"group,omitempty"` // the gid's name in its /etc/group, else the number
	// Xattrs: its user.* extended attributes, names without "user." (only
	// when asked: WithXattrs).
	Xattrs map[string]string `json:"xattrs,omitempty"`
	// Of a symlink: its target resolved (every link on the way followed,
	// as realpath does; the link's own path when that fails) and the mode
	// of what it points to (absent when it points nowhere).
	Target     string  `json:"target,omitempty"`
	TargetMode *uint32 `json:"target_mode,omitempty"`
}

type wireWriteReply struct {
	Size int64 `json:"size"`
}
