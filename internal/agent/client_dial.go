package agent

import (
	"context"
	"net"
)

// DialFunc opens a new connection to an agent: one stream per call, each
// carrying one request, as a unix socket connection does. A VM backend
// returns streams multiplexed over the VM's one agent channel.
type DialFunc func(ctx context.Context) (net.Conn, error)

// NewClientDialer returns a client that reaches its agent through dial
// instead of a unix socket path; name stands for the agent in errors. The
// same protocol runs over each stream, and the protocol version is checked
// on the first call, as for NewClient.
func NewClientDialer(name string, dial DialFunc) *Client {
	return &Client{clientState: &clientState{path: name, dial: dial}}
}
