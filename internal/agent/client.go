package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Client talks to one agent over its unix socket. Every call dials a new
// connection (they are cheap) so calls never wait on each other; a Client is
// safe for concurrent use and holds no connection between calls.
//
// ctx bounds the whole operation, including the life of the stream a call
// returns (a Process, a ReadFile reader): when ctx is done the connection is
// closed, which for a running Process kills its process group, like
// exec.CommandContext.
//
// The first call other than Ping or Claim checks the agent's protocol
// version (a sandbox outlives upgrades of the node, and keeps its agent): an
// agent that speaks another protocol fails that call and every later one
// with a CodeVersion error saying so, instead of being misunderstood.
type Client struct {
	*clientState
	// user: the sandbox user this client's commands and file operations
	// act as ("" = the agent's own identity, root); see AsUser.
	user string
	// xattrs: Stat, ListDir and ListTree read user.* extended attributes
	// (see WithXattrs).
	xattrs bool
	// owner: this client acts as root and gives what its writes and
	// mkdirs create to this sandbox user (see Owning).
	owner string
}

// clientState is what every user's view of one agent shares.
type clientState struct {
	path     string
	dialer   net.Dialer
	dial     DialFunc     // when set, used instead of dialing path (client_dial.go)
	checked  atomic.Bool  // the agent's protocol matched
	wrong    atomic.Value // string: why the agent is refused, once known
	users    atomic.Bool  // the agent acts as named users (wirePingReply.Users)
	watchAs  atomic.Bool  // the agent arms watches as named users (wirePingReply.WatchUsers)
	xattrsOK atomic.Bool  // the agent sets and reads xattrs (wirePingReply.Xattrs)
	ownersOK atomic.Bool  // the agent gives what it creates to an owner (wirePingReply.Owners)
	syncOK   atomic.Bool  // the agent's watches answer sync frames (wirePingReply.WatchSync)
}

// NewClient returns a client for the agent listening at socketPath.
func NewClient(socketPath string) *Client {
	return &Client{clientState: &clientState{path: socketPath}}
}

// AsUser returns a client of the same agent whose commands and file
// operations act as user, a user of the sandbox (its /etc/passwd): commands
// run with its uid, gid, groups, HOME, USER and LOGNAME, in its home unless
// given a cwd; file operations are checked against its permissions and
// what they create belongs to it. "" is the agent's own identity (root).
// An ExecRequest's own User overrides it.
func (c *Client) AsUser(user string) *Client {
	return &Client{clientState: c.clientState, user: user, xattrs: c.xattrs}
}

// Owning returns a client of the same agent that acts as the agent itself
// (root: its file operations and watches reach what root reaches, its
// commands run as root) and gives what its WriteFile and MakeDir create,
// the file and every directory made for it, to user (its uid and primary
// gid): what E2B's envd does for every user. "" is a client without an
// owner. Through an agent that predates owners it acts as user instead
// (AsUser): the user's reach, the same owner.
func (c *Client) Owning(user string) *Client {
	return &Client{clientState: c.clientState, xattrs: c.xattrs, owner: user}
}

// WithXattrs returns a client of the same agent (and user) whose Stat,
// ListDir and ListTree entries carry the files' user.* extended attributes
// (FileInfo.Xattrs).
func (c *Client) WithXattrs() *Client {
	return &Client{clientState: c.clientState, user: c.user, xattrs: true, owner: c.owner}
}

// User is the user c acts as ("" = root, the agent's identity).
func (c *Client) User() string { return c.user }

// UserInfo describes a user of the sandbox.
type UserInfo struct {
	Name   string
	UID    uint32
	GID    uint32
	Home   string
	Shell  string
	Groups []uint32 // supplementary groups, the primary one included
}

// LookupUser resolves a user name (or a numeric uid) in the sandbox's own
// /etc/passwd and /etc/group. An unknown user is an *Error wrapping
// fs.ErrNotExist.
func (c *Client) LookupUser(ctx context.Context, name string) (UserInfo, error) {
	var w userInfo
	if err := c.unary(ctx, OpUser, name, wireUserRequest{User: name}, &w); err != nil {
		return UserInfo{}, err
	}
	return UserInfo{Name: w.Name, UID: w.UID, GID: w.GID, Home: w.Home, Shell: w.Shell, Groups: w.Groups}, nil
}

// Info describes the agent process.
type Info struct {
	Version  string
	Protocol int   // ProtocolVersion of the agent's build
	Pid      int   // the agent's pid in its own pid namespace (1 in a sandbox)
	RSSBytes int64 // the agent's resident set size (VmRSS)
	Users    bool  // the agent acts as named users (Client.AsUser)
	Xattrs   bool  // the agent sets and reads user.* xattrs (Client.WithXattrs)
	// WatchUsers: the agent arms watches as the client's user.
	WatchUsers bool
	Owners     bool // writes and mkdirs give what they create to an owner (Client.Owning)
	WatchSync  bool // watches answer Watcher.Sync
}

// FileInfo describes a file as seen by lstat inside the sandbox.
type FileInfo struct {
	Name    string
	Size    int64
	Mode    fs.FileMode
	ModTime time.Time
	IsDir   bool
	Symlink string            // link target if it is a symlink
	UID     int64             // owner's uid in the sandbox; -1 if the agent did not say
	GID     int64             // group's gid; -1 if the agent did not say
	Owner   string            // the uid's name in the sandbox's /etc/passwd, else the number
	Group   string            // the gid's name in its /etc/group, else the number
	Xattrs  map[string]string // user.* extended attributes, without "user." (Client.WithXattrs)
	// Of a symlink, from agents that resolve it (Target is "" from older
	// ones): Target is the path it resolves to, every link on the way
	// followed (the link's own path when that fails), TargetMode the mode
	// of what it points to, and TargetOK whether it points to anything.
	Target     string
	TargetMode fs.FileMode
	TargetOK   bool
}

func fromWire(w wireFileInfo) FileInfo {
	m := fs.FileMode(w.Mode)
	fi := FileInfo{Name: w.Name, Size: w.Size, Mode: m, ModTime: time.Unix(0, w.MTimeNs), IsDir: m.IsDir(), Symlink: w.Link,
		UID: -1, GID: -1, Owner: w.Owner, Group: w.Group, Xattrs: w.Xattrs}
	if w.TargetMode != nil {
		fi.TargetMode, fi.TargetOK = fs.FileMode(*w.TargetMode), true
	}
	fi.Target = w.Target
	if w.UID != nil {
		fi.UID = int64(*w.UID)
	}
	if w.GID != nil {
		fi.GID = int64(*w.GID)
	}
	return fi
}

// Ping checks that the agent answers and reports its version and memory.
func (c *Client) Ping(ctx context.Context) (Info, error) {
	return c.ping(ctx, false)
}

// PingAtRest is Ping after the agent has returned its free memory to the
// OS (a garbage collection, as when it has been idle for
// Config.IdleRelease), so that RSSBytes is its memory at rest: what it
// holds, not what its garbage collector has yet to free. Older agents
// answer as Ping.
func (c *Client) PingAtRest(ctx context.Context) (Info, error) {
	return c.ping(ctx, true)
}

func (c *Client) ping(ctx context.Context, release bool) (Info, error) {
	var rep wirePingReply
	if err := c.unary(ctx, OpPing, "", wirePingRequest{Release: release}, &rep); err != nil {
		return Info{}, err
	}
	return rep.info(), nil
}

func (rep *wirePingReply) info() Info {
	return Info{Version: rep.Version, Protocol: rep.Protocol, Pid: rep.Pid, RSSBytes: rep.RSS, Users: rep.Users, Xattrs: rep.Xattrs, WatchUsers: rep.WatchUsers,
		Owners: rep.Owners, WatchSync: rep.WatchSync}
}

// checkProtocol pings the agent once per Client and compares its protocol
// version with ours, unless Learn told it already.
func (c *Client) checkProtocol(ctx context.Context) error {
	if c.checked.Load() {
		return nil
	}
	if why, ok := c.wrong.Load().(string); ok {
		return &Error{Op: "connect", Code: CodeVersion, Msg: why}
	}
	info, err := c.Ping(ctx)
	if err != nil {
		return err
	}
	return c.learn(info)
}

// Learn gives the client what the agent said of itself elsewhere (a
// claim's answer, Client.Claim), so that its first call does not ask
// again. An Info without a protocol (an older agent's claim) teaches
// nothing: the first call pings.
func (c *Client) Learn(info Info) {
	if info.Protocol != 0 {
		c.learn(info)
	}
}

// learn checks the agent's protocol and records its features.
func (c *Client) learn(info Info) error {
	if info.Protocol != ProtocolVersion {
		why := fmt.Sprintf("the sandbox's agent (version %s) speaks protocol %d, this node speaks %d: "+
			"the sandbox was created by an incompatible Shoal; delete it and create a new one", info.Version, info.Protocol, ProtocolVersion)
		c.wrong.Store(why)
		return &Error{Op: "connect", Code: CodeVersion, Msg: why}
	}
	c.users.Store(info.Users)
	c.watchAs.Store(info.WatchUsers)
	c.xattrsOK.Store(info.Xattrs)
	c.ownersOK.Store(info.Owners)
	c.syncOK.Store(info.WatchSync)
	c.checked.Store(true)
	return nil
}

// checkUser refuses to act as a user through an agent that predates users
// (it would ignore the user and act as root).
func (c *Client) checkUser(op Op, path, user string) error {
	if user == "" || c.users.Load() && (op != OpWatch || c.watchAs.Load()) {
		return nil
	}
	return &Error{Op: op.String(), Path: path, Code: CodeUnsupported,
		Msg: "the sandbox's agent predates users and cannot act as " + strconv.Quote(user) + ": create a new sandbox"}
}

// checkXattrs refuses to set extended attributes through an agent that
// would ignore them.
func (c *Client) checkXattrs(op Op, path string, req any) error {
	if r, ok := req.(wirePathRequest); !ok || len(r.Xattrs) == 0 || c.xattrsOK.Load() {
		return nil
	}
	return &Error{Op: op.String(), Path: path, Code: CodeUnsupported,
		Msg: "the sandbox's agent predates extended attributes: create a new sandbox"}
}

// Stat returns information about path without following a final symlink.
func (c *Client) Stat(ctx context.Context, path string) (FileInfo, error) {
	var w wireFileInfo
	if err := c.unary(ctx, OpStat, path, wirePathRequest{Path: path, User: c.user, WithXattrs: c.xattrs}, &w); err != nil {
		return FileInfo{}, err
	}
	return fromWire(w), nil
}

// MakeDir creates path and any missing parents, like mkdir -p (mode 0 means
// 0755; the sandbox's umask applies). It fails with an error wrapping
// fs.ErrExist if path exists and is not a directory.
func (c *Client) MakeDir(ctx context.Context, path string, mode fs.FileMode) error {
	return c.unary(ctx, OpMakeDir, path, wirePathRequest{Path: path, Mode: uint32(mode), User: c.user}, nil)
}

// Remove removes a file, a symlink or an empty directory; with recursive, a
// whole tree. A missing path is an error wrapping fs.ErrNotExist (callers
// that want rm -f semantics check for it).
func (c *Client) Remove(ctx context.Context, path string, recursive bool) error {
	return c.unary(ctx, OpRemove, path, wirePathRequest{Path: path, Recursive: recursive, User: c.user}, nil)
}

// ListDir returns the entries of a directory sorted by name (lstat info).
func (c *Client) ListDir(ctx context.Context, path string) ([]FileInfo, error) {
	cc, err := c.open(ctx, OpListDir, path, wireListRequest{Path: path, User: c.user, WithXattrs: c.xattrs})
	if err != nil {
		return nil, err
	}
	defer cc.close()
	var out []FileInfo
	for {
		typ, payload, err := readFrame(cc)
		if err != nil {
			return nil, cc.wrapErr(unexpectedEOF(err))
		}
		switch typ {
		case FrameData:
			var batch []wireFileInfo
			if err := json.Unmarshal(payload, &batch); err != nil {
				return nil, cc.protoErr("bad list batch: " + err.Error())
			}
			// The agent is inside the sandbox: what it sends is bounded
			// here, on the host, not by its good will.
			if len(out)+len(batch) > MaxListEntries {
				return nil, cc.tooMany()
			}
			for _, w := range batch {
				out = append(out, fromWire(w))
			}
		case FrameEOF:
			slices.SortFunc(out, func(a, b FileInfo) int { return strings.Compare(a.Name, b.Name) })
			return out, nil
		case FrameError:
			return nil, cc.agentErr(payload)
		default:
			return nil, cc.protoErr(fmt.Sprintf("unexpected frame %q", typ))
		}
	}
}

// ReadFile opens path (following symlinks) and streams its content in
// chunks of at most 64 KiB straight from the connection into the caller's
// buffers. Only regular files can be read. The caller must Close the reader;
// an error from the agent in mid-stream is returned by Read.
func (c *Client) ReadFile(ctx context.Context, path string) (io.ReadCloser, FileInfo, error) {
	cc, err := c.open(ctx, OpReadFile, path, wirePathRequest{Path: path, User: c.user})
	if err != nil {
		return nil, FileInfo{}, err
	}
	var w wireFileInfo
	if err := cc.readReply(&w); err != nil {
		cc.close()
		return nil, FileInfo{}, err
	}
	return &fileReader{cc: cc}, fromWire(w), nil
}

type fileReader struct {
	cc        *clientConn
	closed    atomic.Bool
	remaining int   // bytes left in the current data frame
	err       error // sticky; io.EOF after the end frame
	hdr       [headerSize]byte
}

var errReaderClosed = errors.New("read after close")

func (r *fileReader) Read(p []byte) (int, error) {
	if r.closed.Load() {
		return 0, errReaderClosed
	}
	if r.err != nil {
		return 0, r.err
	}
	for r.remaining == 0 {
		typ, n, err := readHeader(r.cc, &r.hdr)
		if err != nil {
			r.err = r.cc.wrapErr(unexpectedEOF(err))
			return 0, r.err
		}
		switch typ {
		case FrameData:
			r.remaining = n
		case FrameEOF:
			r.err = io.EOF
			r.cc.close()
			return 0, io.EOF
		case FrameError:
			payload := make([]byte, n)
			if _, err := io.ReadFull(r.cc, payload); err != nil {
				r.err = r.cc.wrapErr(unexpectedEOF(err))
			} else {
				r.err = r.cc.agentErr(payload)
			}
			return 0, r.err
		default:
			r.err = r.cc.protoErr(fmt.Sprintf("unexpected frame %q", typ))
			return 0, r.err
		}
	}
	if len(p) > r.remaining {
		p = p[:r.remaining]
	}
	n, err := r.cc.Read(p)
	r.remaining -= n
	if err != nil {
		r.err = r.cc.wrapErr(unexpectedEOF(err))
		return n, r.err
	}
	return n, nil
}

// Close closes the connection; it may be called concurrently with Read to
// abort it.
func (r *fileReader) Close() error {
	r.closed.Store(true)
	r.cc.close()
	return nil
}

// WriteFile streams r into path atomically: the agent writes a temp file in
// the same directory, fsyncs it and renames it over path, creating missing
// parent directories (0755). mode 0 means 0644; it is applied exactly. If
// reading r fails or the connection breaks, the temp file is removed and
// path is untouched. It returns the number of bytes written.
func (c *Client) WriteFile(ctx context.Context, path string, mode fs.FileMode, r io.Reader) (int64, error) {
	return c.WriteFileXattrs(ctx, path, mode, r, nil)
}

// WriteFileXattrs is WriteFile that also sets user.NAME=VALUE extended
// attributes (names without "user.") on the file: at most 64, names of at
// most 250 bytes, values of at most 4096, 64 KiB in all.
func (c *Client) WriteFileXattrs(ctx context.Context, path string, mode fs.FileMode, r io.Reader, xattrs map[string]string) (int64, error) {
	cc, err := c.open(ctx, OpWriteFile, path, wirePathRequest{Path: path, Mode: uint32(mode), User: c.user, Xattrs: xattrs})
	if err != nil {
		return 0, err
	}
	defer cc.close() // without an F frame this aborts the write
	if err := cc.readReply(nil); err != nil {
		return 0, err
	}
	buf := make([]byte, headerSize+MaxDataChunk)
	for {
		n, rerr := r.Read(buf[headerSize:])
		if n > 0 {
			if err := writeDataFrame(cc, FrameData, buf, n); err != nil {
				return 0, cc.failedWrite(err)
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			if ctx.Err() != nil {
				return 0, cc.wrapErr(ctx.Err())
			}
			return 0, fmt.Errorf("agent write %s: read source: %w", path, rerr)
		}
	}
	if err := writeFrame(cc, FrameEOF, nil); err != nil {
		return 0, cc.failedWrite(err)
	}
	var rep wireWriteReply
	if err := cc.readReply(&rep); err != nil {
		return 0, err
	}
	return rep.Size, nil
}

// clientConn is one connection carrying one request.
type clientConn struct {
	net.Conn
	ctx       context.Context
	op        Op
	path      string
	stop      func() bool // stops the ctx watcher
	closeOnce sync.Once
}

// open dials the agent and sends the request frame. Dialing retries for a
// while when the agent's accept queue is full (EAGAIN), as it can be when
// many callers wake the same sandbox at once.
func (c *Client) open(ctx context.Context, op Op, path string, req any) (*clientConn, error) {
	if op != OpPing && op != OpClaim {
		if err := c.checkProtocol(ctx); err != nil {
			return nil, err
		}
	}
	cc := &clientConn{ctx: ctx, op: op, path: path}
	req = c.withOwner(op, req)
	if u := requestUser(req); u != "" {
		if err := c.checkUser(op, path, u); err != nil {
			return nil, err
		}
	}
	if err := c.checkXattrs(op, path, req); err != nil {
		return nil, err
	}
	body, err := json.Marshal(req)
	if err != nil {
		return nil, cc.wrapErr(err)
	}
	var conn net.Conn
	for delay := time.Millisecond; ; delay *= 2 {
		if c.dial != nil {
			conn, err = c.dial(ctx)
		} else {
			conn, err = c.dialer.DialContext(ctx, "unix", c.path)
		}
		if err == nil || !errors.Is(err, syscall.EAGAIN) || delay > time.Second {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(delay):
		}
	}
	if err != nil {
		return nil, cc.wrapErr(err)
	}
	cc.Conn = conn
	cc.stop = context.AfterFunc(ctx, func() { conn.Close() })
	payload := make([]byte, 1+len(body))
	payload[0] = byte(op)
	copy(payload[1:], body)
	if err := writeFrame(conn, FrameRequest, payload); err != nil {
		cc.close()
		return nil, cc.wrapErr(err)
	}
	return cc, nil
}

// withOwner puts c's owner in a request: as its Owner where it creates
// something, or, through an agent that predates owners, as the user that
// every request of c acts as.
func (c *Client) withOwner(op Op, req any) any {
	if c.owner == "" {
		return req
	}
	owners := c.ownersOK.Load()
	switch r := req.(type) {
	case wirePathRequest:
		if owners && r.User == "" && (op == OpWriteFile || op == OpMakeDir) {
			r.Owner = c.owner
		} else if !owners && r.User == "" {
			r.User = c.owner
		}
		return r
	case wireListRequest:
		if !owners && r.User == "" {
			r.User = c.owner
		}
		return r
	case wireWatchRequest:
		if !owners && r.User == "" {
			r.User = c.owner
		}
		return r
	case wireExecRequest:
		if !owners && r.User == "" {
			r.User = c.owner
		}
		return r
	}
	return req
}

// requestUser is the user a request acts as.
func requestUser(req any) string {
	switch r := req.(type) {
	case wirePathRequest:
		return r.User
	case wireExecRequest:
		return r.User
	case wireListRequest:
		return r.User
	case wireWatchRequest:
		return r.User
	}
	return ""
}

func (cc *clientConn) close() {
	cc.closeOnce.Do(func() {
		cc.stop()
		cc.Conn.Close()
	})
}

func (cc *clientConn) prefix() string {
	if cc.path == "" {
		return "agent " + cc.op.String()
	}
	return "agent " + cc.op.String() + " " + cc.path
}

// wrapErr wraps a transport error; if ctx is done, its error is what the
// caller gets (the closed connection is only the consequence).
func (cc *clientConn) wrapErr(err error) error {
	if cerr := cc.ctx.Err(); cerr != nil {
		return fmt.Errorf("%s: %w", cc.prefix(), cerr)
	}
	return fmt.Errorf("%s: %w", cc.prefix(), err)
}

func (cc *clientConn) agentErr(payload []byte) error {
	var w wireError
	if err := json.Unmarshal(payload, &w); err != nil {
		return cc.protoErr("bad error message: " + err.Error())
	}
	return &Error{Op: cc.op.String(), Path: cc.path, Code: w.Code, Msg: w.Msg}
}

// tooMany is the error of a listing longer than MaxListEntries.
func (cc *clientConn) tooMany() error {
	return &Error{Op: cc.op.String(), Path: cc.path, Code: CodeTooMany,
		Msg: fmt.Sprintf("more than %d entries: list a narrower directory (or a smaller depth)", MaxListEntries)}
}

func (cc *clientConn) protoErr(msg string) error {
	return &Error{Op: cc.op.String(), Path: cc.path, Code: CodeProtocol, Msg: msg}
}

// readReply reads one frame: a reply (decoded into v unless v is nil) or an
// agent error.
func (cc *clientConn) readReply(v any) error {
	typ, payload, err := readFrame(cc)
	if err != nil {
		return cc.wrapErr(unexpectedEOF(err))
	}
	switch typ {
	case FrameReply:
		if v != nil {
			if err := json.Unmarshal(payload, v); err != nil {
				return cc.protoErr("bad reply: " + err.Error())
			}
		}
		return nil
	case FrameError:
		return cc.agentErr(payload)
	}
	return cc.protoErr(fmt.Sprintf("unexpected frame %q", typ))
}

// failedWrite explains a write that failed: the agent may have reported why
// (no space, say) just before closing the connection.
func (cc *clientConn) failedWrite(err error) error {
	if cc.ctx.Err() == nil {
		cc.SetReadDeadline(time.Now().Add(time.Second))
		if typ, payload, rerr := readFrame(cc.Conn); rerr == nil && typ == FrameError {
			return cc.agentErr(payload)
		}
	}
	return cc.wrapErr(err)
}

func (c *Client) unary(ctx context.Context, op Op, path string, req, reply any) error {
	cc, err := c.open(ctx, op, path, req)
	if err != nil {
		return err
	}
	defer cc.close()
	return cc.readReply(reply)
}
