package agent

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoal-sandbox/shoal/internal/errdefs"
)

// oldAgent serves pings as an agent of another protocol version would, and
// counts the other requests it gets (none may reach it).
func oldAgent(t *testing.T, proto int) (sock string, others *atomic.Int32) {
	sock, others, _ = countingAgent(t, proto)
	return sock, others
}

// countingAgent is oldAgent that also counts the pings.
func countingAgent(t *testing.T, proto int) (sock string, others, pings *atomic.Int32) {
	t.Helper()
	sock = shortSocket(t)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	others, pings = new(atomic.Int32), new(atomic.Int32)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, payload, err := readFrame(c)
				if err != nil || len(payload) == 0 {
					return
				}
				if Op(payload[0]) != OpPing {
					others.Add(1)
					sendError(c, CodeUnsupported, "not served")
					return
				}
				pings.Add(1)
				writeJSONFrame(c, FrameReply, wirePingReply{Version: "0.0.1-old", Protocol: proto, Pid: 1})
			}()
		}
	}()
	return sock, others, pings
}

// TestClientRefusesOtherProtocol: a sandbox created by an older Shoal keeps
// its agent across an upgrade of the node; the node must refuse to talk to
// it with a clear error rather than misread its answers.
func TestClientRefusesOtherProtocol(t *testing.T) {
	sock, others := oldAgent(t, ProtocolVersion+1)
	c := NewClient(sock)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := c.Ping(ctx)
	if err != nil || info.Protocol != ProtocolVersion+1 {
		t.Fatalf("ping: %+v %v", info, err)
	}
	for range 2 { // refused again from the cached verdict
		_, err = c.Exec(ctx, ExecRequest{Args: []string{"true"}})
		var ae *Error
		if !errors.As(err, &ae) || ae.Code != CodeVersion || !strings.Contains(err.Error(), "speaks protocol") {
			t.Fatalf("exec on an agent of another protocol: %v", err)
		}
		if !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("%v is not a failed precondition", err)
		}
	}
	if n := others.Load(); n != 0 {
		t.Errorf("%d requests other than ping reached the old agent", n)
	}
}

// TestClientAcceptsSameProtocol: the check costs one ping per client.
func TestClientAcceptsSameProtocol(t *testing.T) {
	sock, others := oldAgent(t, ProtocolVersion)
	c := NewClient(sock)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for range 2 {
		_, err := c.Stat(ctx, "/")
		var ae *Error
		if !errors.As(err, &ae) || ae.Code != CodeUnsupported {
			t.Fatalf("stat: %v, want the agent's own answer", err)
		}
	}
	if n := others.Load(); n != 2 {
		t.Errorf("%d requests reached the agent, want 2", n)
	}
}

// TestClientLearn: a client told what the agent said at its claim does not
// ping it; told of another protocol, it refuses without asking; told
// nothing (an older agent's claim answer), it pings on its first call.
func TestClientLearn(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stat := func(c *Client) error {
		_, err := c.Stat(ctx, "/")
		return err
	}
	sock, others, pings := countingAgent(t, ProtocolVersion)
	c := NewClient(sock)
	c.Learn(Info{Version: Version, Protocol: ProtocolVersion, Users: true})
	var ae *Error
	if err := stat(c); !errors.As(err, &ae) || ae.Code != CodeUnsupported {
		t.Fatalf("stat: %v, want the agent's own answer", err)
	}
	if n, p := others.Load(), pings.Load(); n != 1 || p != 0 {
		t.Errorf("after Learn: %d requests and %d pings reached the agent, want 1 and 0", n, p)
	}
	if !c.users.Load() {
		t.Error("Learn did not record the agent's features")
	}

	c = NewClient(sock)
	c.Learn(Info{Version: "9", Protocol: ProtocolVersion + 1})
	if err := stat(c); !errors.As(err, &ae) || ae.Code != CodeVersion {
		t.Fatalf("stat after learning another protocol: %v", err)
	}
	if n, p := others.Load(), pings.Load(); n != 1 || p != 0 {
		t.Errorf("after Learn of another protocol: %d requests and %d pings, want 1 and 0", n, p)
	}

	c = NewClient(sock)
	c.Learn(Info{})
	stat(c)
	if n, p := others.Load(), pings.Load(); n != 2 || p != 1 {
		t.Errorf("after Learn of nothing: %d requests and %d pings, want 2 and 1", n, p)
	}
}
