package vminit

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

// The agent channel is one byte stream (the VM's virtio-serial port) that
// outlives the host's connections to it: a node that restarts connects
// again while the guest's end goes on, and the guest is not always told
// (QEMU 7.2 reports the new connection before the guest has read the end
// of the old one). Bytes of an old session may still be in flight either
// way. So each host connection begins a new yamux session with a
// handshake:
//
//   - the host sends a sync record: syncMagic and a fresh random nonce;
//   - the guest, which reads the port frame by frame (it parses yamux's
//     headers, so a sync record between two frames is seen, and no bytes
//     are lost inside a yamux session it ends), ends the session it had,
//     refuses the old session's further writes, answers ackMagic and the
//     nonce, and serves a new session;
//   - the host discards what it reads until that answer (output of the old
//     session, which the workload may shape: it cannot forge the nonce) and
//     starts its session after it.
//
// Frames that arrive before any sync record are an old host's, and are
// dropped; a header that cannot be yamux's (a host that died in the middle
// of a frame) makes the guest scan for the next sync record.
var (
	syncMagic = [8]byte{'S', 'H', 'O', 'A', 'L', 'S', 'Y', 'N'}
	ackMagic  = [8]byte{'S', 'H', 'O', 'A', 'L', 'A', 'C', 'K'}
)

const (
	nonceLen  = 16
	recordLen = len(syncMagic) + nonceLen
	syncEvery = 200 * time.Millisecond

	// yamux's frame header: version, type, flags (2), stream (4), length
	// (4); only data frames carry length bytes after it.
	yamuxHeader  = 12
	yamuxVersion = 0
	yamuxData    = 0
	yamuxTypes   = 4
)

// maxFrame bounds a data frame: yamux never sends more than a stream's
// window at once.
func maxFrame() uint32 { return MuxConfig().MaxStreamWindowSize }

// Channel is the host's end of the agent channel.
type Channel interface {
	io.ReadWriteCloser
	SetDeadline(t time.Time) error
}

// DialLink runs the host's side of the handshake on the agent channel and
// returns what yamux's client runs on. It waits for the guest's answer
// until ctx ends.
func DialLink(ctx context.Context, c Channel) (Channel, error) {
	var nonce [nonceLen]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
	defer stop()
	// The record goes again every syncEvery until the answer: one the
	// guest took for the rest of a frame cut short by a host that died
	// is followed by another (the guest answers a nonce once).
	rec := append(syncMagic[:], nonce[:]...)
	if _, err := c.Write(rec); err != nil {
		return nil, fmt.Errorf("agent channel: send sync: %w", ctxErr(ctx, err))
	}
	answered := make(chan struct{})
	var repeats sync.WaitGroup
	repeats.Add(1)
	go func() {
		defer repeats.Done()
		t := time.NewTicker(syncEvery)
		defer t.Stop()
		for {
			select {
			case <-answered:
				return
			case <-t.C:
				if _, err := c.Write(rec); err != nil {
					return
				}
			}
		}
	}()
	defer repeats.Wait() // no record after the session's first frame
	defer close(answered)
	want := append(ackMagic[:], nonce[:]...)
	br := bufio.NewReaderSize(c, 64<<10)
	win := make([]byte, 0, 2*recordLen)
	for {
		b, err := br.ReadByte()
		if err != nil {
			return nil, fmt.Errorf("agent channel: wait for the guest's answer: %w", ctxErr(ctx, err))
		}
		win = append(win, b)
		if bytes.HasSuffix(win, want) {
			break
		}
		if len(win) == cap(win) {
			win = append(win[:0], win[len(win)-recordLen+1:]...)
		}
	}
	if !stop() {
		return nil, ctx.Err()
	}
	c.SetDeadline(time.Time{})
	return &bufferedConn{Channel: c, r: br}, nil
}

func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// bufferedConn reads what the handshake's reader had buffered first.
type bufferedConn struct {
	Channel
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// portListener serves the guest's end: it reads the port, starts a yamux
// session at each sync record and hands the streams of the current one to
// Accept.
type portListener struct {
	path   string
	conns  chan net.Conn
	done   chan struct{}
	closed sync.Once

	wmu   sync.Mutex // serializes writes to the port; guards epoch
	port  *os.File
	epoch uint64
	cur   *linkSession // the current session; only serve touches it
	nonce []byte       // the sync record cur answered

	// onSession runs before a new session is answered (syncClock in a
	// VM; nil in tests, which run on the host).
	onSession func()
}

type linkSession struct {
	sess *yamux.Session
	in   *io.PipeWriter // frames read from the port, to the session
}

func listenPort(first *os.File) (net.Listener, error) {
	p, err := findPort()
	if err != nil {
		return nil, err
	}
	l := &portListener{path: p, conns: make(chan net.Conn), done: make(chan struct{}), onSession: syncClock}
	go l.run(first)
	return l, nil
}

// run serves the port's sessions; first, if not nil, is the port already
// open (what it holds unread is the first session's).
func (l *portListener) run(first *os.File) {
	for {
		f, err := first, error(nil)
		first = nil
		if f == nil {
			f, err = os.OpenFile(l.path, os.O_RDWR, 0)
		}
		if err != nil {
			select {
			case <-l.done:
				return
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		l.wmu.Lock()
		l.port = f
		l.wmu.Unlock()
		err = l.serve(&eofWait{r: f, done: l.done})
		l.end()
		f.Close()
		if errors.Is(err, net.ErrClosed) {
			return
		}
	}
}

// eofWait reads the port; while the host is not connected reads return
// EOF at once, so it waits and reads again (the next host's connection
// starts with a sync record).
type eofWait struct {
	r    io.Reader
	done chan struct{}
}

func (e *eofWait) Read(p []byte) (int, error) {
	for {
		n, err := e.r.Read(p)
		if n > 0 || (err != nil && err != io.EOF) {
			return n, err
		}
		select {
		case <-e.done:
			return 0, net.ErrClosed
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// serve reads records and frames from the port until it fails.
func (l *portListener) serve(port io.Reader) error {
	r := bufio.NewReaderSize(port, 64<<10)
	limit := maxFrame()
	hdr := make([]byte, yamuxHeader)
	for {
		first, err := r.Peek(1)
		if err != nil {
			return err
		}
		if first[0] == syncMagic[0] {
			nonce, err := readSync(r)
			if err != nil {
				return err
			}
			if nonce != nil && (l.cur == nil || !bytes.Equal(nonce, l.nonce)) {
				l.start(nonce)
			}
			continue
		}
		if _, err := io.ReadFull(r, hdr); err != nil {
			return err
		}
		n := uint32(0)
		if hdr[1] == yamuxData {
			n = binary.BigEndian.Uint32(hdr[8:])
		}
		if hdr[0] != yamuxVersion || hdr[1] >= yamuxTypes || n > limit {
			// Not a frame: a host died in the middle of one. What
			// follows is garbage until the next sync record.
			l.end()
			if err := scanSync(r); err != nil {
				return err
			}
			continue
		}
		frame := make([]byte, yamuxHeader+int(n))
		copy(frame, hdr)
		if _, err := io.ReadFull(r, frame[yamuxHeader:]); err != nil {
			return err
		}
		if l.cur == nil {
			continue // an old host's: no session to give it to
		}
		if _, err := l.cur.in.Write(frame); err != nil {
			l.end() // the session ended (a protocol error)
		}
	}
}

// readSync reads a sync record at the reader's position and returns its
// nonce, or nil (having consumed one byte) when it is not one.
func readSync(r *bufio.Reader) ([]byte, error) {
	rec, err := r.Peek(recordLen)
	if err != nil {
		return nil, err
	}
	if !bytes.Equal(rec[:len(syncMagic)], syncMagic[:]) {
		r.Discard(1)
		return nil, nil
	}
	nonce := append([]byte(nil), rec[len(syncMagic):]...)
	r.Discard(recordLen)
	return nonce, nil
}

// scanSync discards bytes up to the next sync record.
func scanSync(r *bufio.Reader) error {
	for {
		if _, err := r.ReadSlice(syncMagic[0]); err != nil && !errors.Is(err, bufio.ErrBufferFull) {
			return err
		} else if err == nil {
			r.UnreadByte()
			rec, err := r.Peek(len(syncMagic))
			if err != nil {
				return err
			}
			if bytes.Equal(rec, syncMagic[:]) {
				return nil
			}
			r.Discard(1)
		}
	}
}

// start ends the current session and starts the one the host's sync
// record asks for, answering it before anything of the new session.
func (l *portListener) start(nonce []byte) {
	l.end()
	if l.onSession != nil {
		l.onSession()
	}
	pr, pw := io.Pipe()
	l.wmu.Lock()
	l.epoch++
	c := &linkConn{l: l, epoch: l.epoch, in: pr}
	_, err := l.port.Write(append(ackMagic[:], nonce...))
	l.wmu.Unlock()
	if err != nil {
		pr.Close()
		return
	}
	sess, err := yamux.Server(c, MuxConfig())
	if err != nil {
		pr.Close()
		return
	}
	l.cur = &linkSession{sess: sess, in: pw}
	l.nonce = nonce
	go func() {
		for {
			st, err := sess.AcceptStream()
			if err != nil {
				return
			}
			select {
			case l.conns <- halfStream{st}:
			case <-l.done:
				st.Close()
				return
			}
		}
	}()
}

// halfStream is a stream of the channel as the agent's server takes a
// connection: CloseWrite ends the guest's direction only (the stream's
// FIN: the host reads to its end and may go on writing, so port
// forwarding passes a TCP half-close on), and Close also ends a read
// still waiting, as closing a socket does.
type halfStream struct{ *yamux.Stream }

func (s halfStream) CloseWrite() error { return s.Stream.Close() }

func (s halfStream) Close() error {
	s.Stream.SetReadDeadline(time.Now())
	return s.Stream.Close()
}

// end closes the current session, if any: its streams end and its writes
// are refused from now on.
func (l *portListener) end() {
	l.wmu.Lock()
	l.epoch++
	l.wmu.Unlock()
	if l.cur != nil {
		l.cur.in.CloseWithError(net.ErrClosed)
		l.cur.sess.Close()
		l.cur = nil
	}
}

// linkConn is one session's view of the port: it reads the frames serve
// passes it and writes to the port while its session is the current one.
type linkConn struct {
	l     *portListener
	epoch uint64
	in    *io.PipeReader
}

func (c *linkConn) Read(p []byte) (int, error) { return c.in.Read(p) }

func (c *linkConn) Write(p []byte) (int, error) {
	c.l.wmu.Lock()
	defer c.l.wmu.Unlock()
	if c.l.epoch != c.epoch {
		return 0, net.ErrClosed
	}
	return c.l.port.Write(p)
}

func (c *linkConn) Close() error {
	c.in.CloseWithError(net.ErrClosed)
	return nil
}

func (c *linkConn) LocalAddr() net.Addr                { return portAddr(c.l.path) }
func (c *linkConn) RemoteAddr() net.Addr               { return portAddr("host") }
func (c *linkConn) SetDeadline(t time.Time) error      { return nil }
func (c *linkConn) SetReadDeadline(t time.Time) error  { return nil }
func (c *linkConn) SetWriteDeadline(t time.Time) error { return nil }

func (l *portListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *portListener) Close() error {
	l.closed.Do(func() { close(l.done) })
	return nil
}

func (l *portListener) Addr() net.Addr { return portAddr(l.path) }

type portAddr string

func (a portAddr) Network() string { return "virtio-serial" }
func (a portAddr) String() string  { return string(a) }
