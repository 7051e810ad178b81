package sandbox

import (
	"context"
	"net"
)

// AgentDialer is implemented by backends whose guest agent is not reached
// through Handle.AgentSocket (a VM's agent listens on the VM's own channel,
// a virtio-serial port, which carries many streams over one connection).
// AgentDial returns a function that opens a new stream to the agent of h on
// each call, as dialing its unix socket would; ctx bounds the dial only.
// The node calls AgentDial once per handle (again after a Resume) and uses
// the function for every request to that sandbox; it is safe for
// concurrent use. A sandbox whose agent is gone fails the dial.
type AgentDialer interface {
	AgentDial(h Handle) func(ctx context.Context) (net.Conn, error)
}

// Committer is implemented by backends that own where a sandbox's
// writable layer lives. WritableLayer returns the host directory holding
// it (the overlay's upper), for the node to copy into a layer while the
// sandbox is frozen; ErrUnsupported when this backend's writable layer is
// not on the host's file system (inside a VM). A backend that does not
// implement Committer keeps it at Handle.Data["upper"], or else in
// "upper" under the sandbox's directory.
type Committer interface {
	WritableLayer(h Handle) (string, error)
}
