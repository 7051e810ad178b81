package sandbox

import (
	"context"
	"io"
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
// writable layer lives. WritableLayer says where it is, for the node to
// turn into a layer: a host directory (the overlay's upper), which the
// node copies while the sandbox is frozen (Freezer), or, when it is not on
// the host's file system (inside a VM), a function that streams it;
// ErrUnsupported when this backend cannot give it at all. A backend that
// does not implement Committer keeps it at Handle.Data["upper"], or else
// in "upper" under the sandbox's directory.
type Committer interface {
	WritableLayer(h Handle) (WritableLayer, error)
}

// WritableLayer is where a sandbox's writable layer is: exactly one of
// Dir and Export is set.
type WritableLayer struct {
	// Dir is the host directory holding the overlay's upper.
	Dir string
	// Export returns the upper as a commit stream (internal/layer's
	// format: a tar of the upper, its whiteouts and opaque directories
	// included), produced inside the sandbox and so read as untrusted
	// input. The backend keeps the sandbox's writers stopped while it
	// streams, until the stream ends or is closed; the caller closes it.
	// maxDepth bounds how deep the producer walks. ctx bounds the stream.
	Export func(ctx context.Context, maxDepth int) (io.ReadCloser, error)
}
