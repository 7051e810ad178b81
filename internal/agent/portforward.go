package agent

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"syscall"
)

// Port forwarding (OpPortForward): the agent connects to a TCP port on the
// sandbox's loopback, from inside the sandbox's own network namespace, and
// then carries raw bytes between that TCP connection and the agent
// connection, which stops being framed after the reply:
//
//	Q({"port"}) → R({}) | X(refused | invalid | io);  then raw bytes both ways
//
// Each direction ends on its own (half-close): when the host shuts down its
// writing half, the agent shuts down the writing half of the TCP
// connection, and the other way round. The agent closes both once both
// directions have ended, or at once if either breaks (reset, write error).
// Because it goes through the agent, it works the same for every backend,
// however the host reaches the agent (unix socket, vsock).

// CodeRefused: nothing accepts connections on the requested port.
const CodeRefused ErrorCode = "refused"

type wirePortRequest struct {
	Port int `json:"port"`
}

func (s *Server) portForward(c net.Conn, req *wirePortRequest) {
	if req.Port < 1 || req.Port > 65535 {
		sendError(c, CodeInvalid, "port "+strconv.Itoa(req.Port)+" out of range 1-65535")
		return
	}
	tc, err := dialLoopback(req.Port)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) {
			sendError(c, CodeRefused, fmt.Sprintf("nothing is listening on port %d in the sandbox (connection to 127.0.0.1:%d and [::1]:%d refused)", req.Port, req.Port, req.Port))
			return
		}
		sendError(c, codeOf(err), fmt.Sprintf("connect to port %d in the sandbox: %v", req.Port, err))
		return
	}
	defer tc.Close()
	if writeFrame(c, FrameReply, emptyReply) != nil {
		return
	}
	splice(c, tc)
}

// dialLoopback connects to 127.0.0.1:port, or to [::1]:port if that is
// refused (a server bound to ::1 only). net.DialTCP, not a net.Dialer: the
// latter links the DNS resolver into the agent (about 400 KiB more RSS).
func dialLoopback(port int) (*net.TCPConn, error) {
	var first error
	for _, ip := range []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback} {
		c, err := net.DialTCP("tcp", nil, &net.TCPAddr{IP: ip, Port: port})
		if err == nil {
			return c, nil
		}
		if first == nil {
			first = err
		}
		if !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.EADDRNOTAVAIL) &&
			!errors.Is(err, syscall.ENETUNREACH) && !errors.Is(err, syscall.EAFNOSUPPORT) {
			return nil, err
		}
	}
	return nil, first
}

// halfCloser is a connection whose writing half can be shut down alone
// (*net.TCPConn, *net.UnixConn, *tls.Conn).
type halfCloser interface {
	CloseWrite() error
}

// splice copies a→b and b→a until both directions have ended, passing each
// end of stream on as a shutdown of the other side's writing half. If a
// direction breaks (an error other than end of stream), both connections
// are closed, which also ends the other direction.
func splice(a, b net.Conn) {
	done := make(chan struct{})
	go func() {
		pipeHalf(b, a, a, b)
		close(done)
	}()
	pipeHalf(a, b, a, b)
	<-done
}

// pipeHalf copies src to dst, then shuts down dst's writing half; on an
// error it closes both x and y. A plain loop over a pooled buffer, not
// io.Copy: io.Copy's ReaderFrom/WriterTo paths (splice, sendfile,
// copy_file_range) would add about 180 KiB to the agent binary.
func pipeHalf(dst, src, x, y net.Conn) {
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				x.Close()
				y.Close()
				return
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			x.Close()
			y.Close()
			return
		}
	}
	if hc, ok := dst.(halfCloser); ok {
		if hc.CloseWrite() == nil {
			return
		}
	}
	// No half-close: closing is the only way to pass the end on.
	x.Close()
	y.Close()
}
