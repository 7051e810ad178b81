package agent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"io/fs"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"
)

// tcpServer listens on addr and runs handle for each connection.
func tcpServer(t *testing.T, addr string, handle func(net.Conn)) int {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("listen %s: %v", addr, err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c)
			}()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

// freePort returns a loopback port nothing listens on.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	return port
}

// The server reads until the client's half-close, then answers with what it
// got reversed and a summary, and closes: both half-closes must pass through
// the agent.
func TestPortForwardHalfClose(t *testing.T) {
	c := startAgent(t)
	port := tcpServer(t, "127.0.0.1:0", func(c net.Conn) {
		b, err := io.ReadAll(c)
		if err != nil {
			return
		}
		out := []byte(strconv.Itoa(len(b)) + ":")
		for i := len(b) - 1; i >= 0; i-- {
			out = append(out, b[i])
		}
		c.Write(out)
	})
	conn, err := c.DialPort(context.Background(), port)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if err := conn.(halfCloser).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "5:olleh" {
		t.Fatalf("got %q, want %q", got, "5:olleh")
	}
}

// 16 MiB each way at once, through splice on both sides of the agent.
func TestPortForwardBulkBothWays(t *testing.T) {
	c := startAgent(t)
	const size = 16 << 20
	serverGot := make(chan []byte, 1)
	port := tcpServer(t, "127.0.0.1:0", func(c net.Conn) {
		sent := make(chan struct{})
		go func() {
			defer close(sent)
			r := rand.New(rand.NewPCG(2, 2))
			buf := make([]byte, 64<<10)
			for n := 0; n < size; n += len(buf) {
				fill(r, buf)
				if _, err := c.Write(buf); err != nil {
					return
				}
			}
			c.(*net.TCPConn).CloseWrite()
		}()
		h := sha256.New()
		if n, _ := io.Copy(h, c); n != size {
			serverGot <- nil
		} else {
			serverGot <- h.Sum(nil)
		}
		<-sent
	})
	conn, err := c.DialPort(context.Background(), port)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	werr := make(chan error, 1)
	go func() {
		r := rand.New(rand.NewPCG(1, 1))
		buf := make([]byte, 64<<10)
		for sent := 0; sent < size; sent += len(buf) {
			fill(r, buf)
			if _, err := conn.Write(buf); err != nil {
				werr <- err
				return
			}
		}
		werr <- conn.(halfCloser).CloseWrite()
	}()
	h := sha256.New()
	n, err := io.Copy(h, conn)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-werr; err != nil {
		t.Fatal(err)
	}
	if n != size || !bytes.Equal(h.Sum(nil), streamSum(2, size)) {
		t.Fatalf("host received %d bytes (want %d) or wrong content", n, size)
	}
	if got := <-serverGot; !bytes.Equal(got, streamSum(1, size)) {
		t.Fatal("sandbox side received a short or wrong stream")
	}
}

func streamSum(seed uint64, size int) []byte {
	h := sha256.New()
	r := rand.New(rand.NewPCG(seed, seed))
	buf := make([]byte, 64<<10)
	for n := 0; n < size; n += len(buf) {
		fill(r, buf)
		h.Write(buf)
	}
	return h.Sum(nil)
}

func fill(r *rand.Rand, b []byte) {
	for i := 0; i+8 <= len(b); i += 8 {
		v := r.Uint64()
		for j := 0; j < 8; j++ {
			b[i+j] = byte(v >> (8 * j))
		}
	}
}

func TestPortForwardRefused(t *testing.T) {
	c := startAgent(t)
	port := freePort(t)
	_, err := c.DialPort(context.Background(), port)
	var ae *Error
	if !errors.As(err, &ae) || ae.Code != CodeRefused {
		t.Fatalf("got %v, want a %s error", err, CodeRefused)
	}
	if !strings.Contains(err.Error(), "nothing is listening on port "+strconv.Itoa(port)) {
		t.Fatalf("message does not say which port: %v", err)
	}
}

func TestPortForwardBadPort(t *testing.T) {
	c := startAgent(t)
	for _, port := range []int{0, -1, 65536} {
		if _, err := c.DialPort(context.Background(), port); !errors.Is(err, fs.ErrInvalid) {
			t.Errorf("port %d: got %v, want invalid", port, err)
		}
	}
}

// A server bound to ::1 only is reached too.
func TestPortForwardIPv6Loopback(t *testing.T) {
	c := startAgent(t)
	port := tcpServer(t, "[::1]:0", func(c net.Conn) { c.Write([]byte("six")) })
	if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port)); err == nil {
		l.Close() // 127.0.0.1:port is free: the agent must fall back to ::1
	} else {
		t.Skipf("127.0.0.1:%d is taken", port)
	}
	conn, err := c.DialPort(context.Background(), port)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, _ := io.ReadAll(conn)
	if string(got) != "six" {
		t.Fatalf("got %q", got)
	}
}

// Closing the host's connection ends the TCP connection in the sandbox and
// the agent's side of it, and a cancelled ctx after the dial does not cut
// the connection (ctx bounds the dial only).
func TestPortForwardCloseEndsBoth(t *testing.T) {
	c := startAgent(t)
	closed := make(chan struct{})
	port := tcpServer(t, "127.0.0.1:0", func(c net.Conn) {
		io.Copy(c, c) // echo until EOF
		close(closed)
	})
	ctx, cancel := context.WithCancel(context.Background())
	conn, err := c.DialPort(ctx, port)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := conn.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo after cancel: %q %v", buf, err)
	}
	conn.Close()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the sandbox side did not see the close")
	}
}

// The agent binary reaches a port too (no resolver involved), and stays small
// after forwarding.
func TestPortForwardBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	_, c := startBinary(t, nil)
	port := tcpServer(t, "127.0.0.1:0", func(c net.Conn) { c.Write([]byte("from-binary")) })
	conn, err := c.DialPort(context.Background(), port)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, _ := io.ReadAll(conn)
	if string(got) != "from-binary" {
		t.Fatalf("got %q", got)
	}
	if _, err := c.DialPort(context.Background(), freePort(t)); err == nil {
		t.Fatal("dial to a free port succeeded")
	}
}
