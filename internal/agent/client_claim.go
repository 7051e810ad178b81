package agent

import (
	"context"
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// ClaimRequest is what a pooled sandbox learns when it is claimed.
type ClaimRequest struct {
	Hostname   string
	Env        []string // the complete environment of every command
	BestEffort bool     // a best-effort sandbox: its commands run under SCHED_IDLE
}

// Claim hands a pooled agent its root: rootFD is a detached mount (from
// fsmount or open_tree), sent with SCM_RIGHTS; the caller keeps its own
// descriptor and closes it. See claim.go for what the agent does. An error
// after the request was sent means the agent has exited (or will): the
// sandbox is unusable and must be destroyed. The agent answers with what a
// ping would (Info, without its RSS; an older agent's has no Protocol),
// which Learn gives to the sandbox's client.
func (c *Client) Claim(ctx context.Context, rootFD int, req ClaimRequest) (Info, error) {
	cc, err := c.open(ctx, OpClaim, "", wireClaimRequest(req))
	if err != nil {
		return Info{}, err
	}
	defer cc.close()
	uc, ok := cc.Conn.(*net.UnixConn)
	if !ok {
		return Info{}, cc.protoErr("not a unix socket connection")
	}
	if _, _, err := uc.WriteMsgUnix([]byte{0}, unix.UnixRights(rootFD), nil); err != nil {
		// The agent may have refused the request before reading this.
		return Info{}, cc.failedWrite(fmt.Errorf("send root mount: %w", err))
	}
	var rep wirePingReply
	if err := cc.readReply(&rep); err != nil {
		return Info{}, err
	}
	return rep.info(), nil
}
