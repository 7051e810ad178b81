package microvm

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
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
