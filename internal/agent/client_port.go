package agent

import (
	"context"
	"net"
	"strconv"
)

// DialPort connects to TCP port on the sandbox's loopback (127.0.0.1, or
// ::1 when nothing listens on 127.0.0.1), from inside the sandbox's own
// network namespace, through the agent. The returned connection carries the
// raw bytes of that TCP connection; it is a *net.UnixConn, so CloseWrite
// shuts down one direction only, which the agent passes on as a TCP
// half-close. If nothing listens on the port, the error is an *Error with
// Code CodeRefused.
//
// Unlike the other calls, ctx bounds only the dial, as with net.Dialer: the
// connection lives until it is closed.
func (c *Client) DialPort(ctx context.Context, port int) (net.Conn, error) {
	cc, err := c.open(ctx, OpPortForward, strconv.Itoa(port), wirePortRequest{Port: port})
	if err != nil {
		return nil, err
	}
	if err := cc.readReply(nil); err != nil {
		cc.close()
		return nil, err
	}
	if !cc.stop() {
		// ctx was done and has closed the connection.
		cc.Conn.Close()
		return nil, cc.wrapErr(ctx.Err())
	}
	return cc.Conn, nil
}
