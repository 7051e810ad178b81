package microvm

import (
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/agent/vminit"
)

// Closing a stream ends a read waiting on it, as closing a socket does:
// the agent client ends a call whose context is done that way, and a
// yamux stream's own Close would leave the reader waiting for the guest.
func TestClosingStreamEndsRead(t *testing.T) {
	a, b := net.Pipe()
	cs, err := yamux.Client(a, vminit.MuxConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	ss, err := yamux.Server(b, vminit.MuxConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	go func() {
		st, err := ss.Accept()
		if err == nil {
			io.Copy(io.Discard, st) // a guest that never answers
		}
	}()
	m := &chanMux{sess: cs}
	c, err := m.open(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("request"))
	done := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 1))
		done <- err
	}()
	time.Sleep(10 * time.Millisecond) // the read waits (if not, Close comes first: the same)
	c.Close()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("read after close returned data")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a read on a closed stream still waits")
	}
}

// CloseWrite ends the host's direction only: the guest reads to the end
// and still answers (a TCP half-close passed on by port forwarding).
func TestClosingStreamCloseWrite(t *testing.T) {
	a, b := net.Pipe()
	cs, err := yamux.Client(a, vminit.MuxConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	ss, err := yamux.Server(b, vminit.MuxConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	go func() {
		st, err := ss.Accept()
		if err == nil {
			n, _ := io.Copy(io.Discard, st) // to the host's end
			fmt.Fprintf(st, "%d bytes\n", n)
			st.Close()
		}
	}()
	m := &chanMux{sess: cs}
	c, err := m.open(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	c.Write([]byte("request"))
	hc, ok := c.(interface{ CloseWrite() error })
	if !ok {
		t.Fatal("a stream of the agent channel has no CloseWrite")
	}
	if err := hc.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "7 bytes\n" {
		t.Fatalf("answer after the host's half-close: %q, %v", got, err)
	}
}

// checkHalfClose: port forwarding into a VM passes the host's half-close
// on to the guest's TCP server (which answers only once it has read to the
// end), and the guest's end back.
func checkHalfClose(t *testing.T, ctx context.Context, c *agent.Client) {
	t.Helper()
	p, err := c.Exec(ctx, agent.ExecRequest{Args: []string{"busybox", "nc", "-l", "-p", "9000", "-e", "busybox", "wc", "-c"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var conn net.Conn
	deadline := time.Now().Add(30 * time.Second) // a hang detector: nc listens at once
	for {
		conn, err = c.DialPort(ctx, 9000)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dial port 9000 in the guest: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(60 * time.Second))
	io.WriteString(conn, "hello")
	hc, ok := conn.(interface{ CloseWrite() error })
	if !ok {
		t.Fatalf("a forwarded port's connection (%T) has no CloseWrite", conn)
	}
	if err := hc.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(conn)
	if err != nil || strings.TrimSpace(string(got)) != "5" {
		t.Fatalf("wc -c behind the forwarded port, after the host's half-close: %q, %v", got, err)
	}
}
