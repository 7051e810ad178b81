package control

// Creates through a control replica make exactly one sandbox per create,
// whatever breaks on the way:
//
//   - Every create reaches its node with a client key: the client's, or
//     one the replica makes for it. So when a node's answer is lost (the
//     connection broke after the request was sent), the replica asks that
//     node again with the same key (bounded, while the node is live): the
//     node answers with the sandbox it made for the key, or makes it now,
//     or refuses; the create moves to another node only on a refusal or
//     when the request never left (the dial failed). An answer never
//     recovered is an error that says so, not a second sandbox elsewhere.
//   - A create with the client's key is claimed in etcd
//     (cluster.Claims: tenant + key → node, then sandbox ID) before it is
//     sent to a node. A retry through any replica reads the claim and asks
//     the node it names, where the node's own client-key check returns
//     the sandbox (or waits for the one being made). A claim moves to
//     another node only by compare-and-swap, when its node refuses or is
//     down before the sandbox was recorded (a recorded sandbox on a node
//     that is down is lost: the retry says so); a replica whose sandbox
//     was made on a node the claim has moved away from deletes it and
//     follows the claim.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/placement"
)

// lostAnswerWait bounds how long a replica keeps asking a node whose
// answer to a create was lost; tests lower it.
var lostAnswerWait = 30 * time.Second

// keyRounds bounds how often a keyed create follows a claim another
// replica moved.
const keyRounds = 8

// errClaimMoved stops a placement whose claim another replica moved.
var errClaimMoved = errors.New("the client key's claim moved to another node")

// errNotReached marks a create whose request never left (the dial
// failed): this try made nothing there, though an earlier one may have.
var errNotReached = errors.New("not reached")

// attemptKey is the client key a replica gives a create that has none.
func attemptKey() string { return "shoal-replica-" + randomHex(16) }

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// notSent says whether a call's error is one that left the request unsent
// (its connection was never made).
func notSent(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// sendCreate sends create m (which carries a client key) to node n. A
// refusal (the node's unavailable: full) or a request that never left is
// errdefs.ErrUnavailable, which moves a placement to the next node; any
// other answer of the node is returned as it is. An answer lost on the
// way is asked for again, with the same key, until the node answers,
// leaves the directory or lostAnswerWait passes (then the error says the
// sandbox may exist there).
func (f *Forwarder) sendCreate(ctx context.Context, n cluster.NodeInfo, m *pb.CreateSandboxRequest, h http.Header) (*pb.Sandbox, error) {
	const proc = "/shoal.v1.SandboxService/CreateSandbox"
	var deadline time.Time
	backoff := 100 * time.Millisecond
	for try := 0; ; try++ {
		res, err := clientFor[pb.CreateSandboxRequest, pb.Sandbox](f, n, proc).CallUnary(ctx, outgoing(m, h))
		if err == nil {
			if try > 0 {
				f.log.Info("cluster: a create's lost answer recovered from its node", "node", n.Name, "sandbox_id", res.Msg.Id, "tries", try+1)
			}
			return res.Msg, nil
		}
		switch {
		case connect.IsWireError(err):
			if connect.CodeOf(err) == connect.CodeUnavailable {
				return nil, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("node %s: %w", n.Name, err)) // node full: the next candidate
			}
			return nil, err // the create's own fault: the client's answer
		case try == 0 && notSent(err):
			return nil, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("node %s %w: %v", n.Name, errNotReached, err))
		case ctx.Err() != nil:
			return nil, err
		}
		// The request may have reached the node: ask it again, never
		// another node.
		if deadline.IsZero() {
			deadline = time.Now().Add(lostAnswerWait)
			f.log.Warn("cluster: a create's answer was lost: asking its node again", "node", n.Name, "err", err)
		}
		if _, live := f.dir.Node(n.Name); !live || time.Now().After(deadline) {
			return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf(
				"node %s did not answer the create (%v): the sandbox may exist there; retry with the same client key to get it", n.Name, err))
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

// placeCreate places create m (with a client key the client did not
// give) on the best node that takes it.
func (f *Forwarder) placeCreate(ctx context.Context, pr placement.Request, m *pb.CreateSandboxRequest, h http.Header) (string, *pb.Sandbox, error) {
	var sb *pb.Sandbox
	node, err := f.place.Place(ctx, pr, func(ctx context.Context, name string) error {
		n, ok := f.dir.Node(name)
		if !ok {
			return errdefs.New(errdefs.ErrUnavailable, "node %s left the cluster", name)
		}
		out, err := f.sendCreate(ctx, n, m, h)
		if err != nil {
			return err
		}
		sb = out
		return nil
	})
	return node, sb, err
}

// createKeyed makes the one sandbox of the client's key ck (the claim key
// of tenant and client key): the claim's, if it has one, else a placement
// that claims each node before trying it.
func (f *Forwarder) createKeyed(ctx context.Context, pr placement.Request, m *pb.CreateSandboxRequest, h http.Header, ck string) (string, *pb.Sandbox, error) {
	for range keyRounds {
		cl, rev, err := f.claims.Get(ctx, ck)
		if err != nil {
			return "", nil, err
		}
		n, live := f.dir.Node(cl.Node)
		switch {
		case rev != 0 && !live && cl.ID != "":
			return "", nil, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("%w: sandbox %s, made for client key %q, is on node %s, which is down", cluster.ErrLost, cl.ID, m.ClientKey, cl.Node))
		case rev != 0 && !live:
			// Its node went down before the sandbox was recorded: placed
			// anew. (If that node made it, it is reported lost, and ends
			// with its timeout.)
			f.log.Warn("cluster: a keyed create's node is down before its sandbox was recorded: placing it anew", "node", cl.Node)
		case rev != 0:
			sb, err := f.sendCreate(ctx, n, m, h)
			if err == nil {
				if sb.Id != cl.ID {
					cl.ID, cl.Replica = sb.Id, f.replica
					f.claims.Put(ctx, ck, cl, rev) // best effort: the node's key is what counts
				}
				return cl.Node, sb, nil
			}
			if errors.Is(err, errNotReached) {
				// A try before this one may have made it there: not moved.
				return "", nil, errdefs.Mark(errdefs.ErrUnavailable, fmt.Errorf("the create with client key %q went to node %s: %w; retry", m.ClientKey, cl.Node, err))
			}
			if !errors.Is(err, errdefs.ErrUnavailable) {
				return "", nil, err
			}
			// Its node refused (full: it has no sandbox for the key, which
			// it checks first): placed anew, the claim moved from rev.
		}
		node, sb, err := f.placeKeyed(ctx, pr, m, h, ck, rev)
		if errors.Is(err, errClaimMoved) {
			continue // another replica moved it: follow
		}
		return node, sb, err
	}
	return "", nil, errdefs.New(errdefs.ErrUnavailable, "the create with client key %q kept moving between nodes: retry it", m.ClientKey)
}

// placeKeyed places a keyed create, claiming each node (from the claim's
// revision rev; 0: none yet) before it sends the create there.
func (f *Forwarder) placeKeyed(ctx context.Context, pr placement.Request, m *pb.CreateSandboxRequest, h http.Header, ck string, rev int64) (string, *pb.Sandbox, error) {
	var sb *pb.Sandbox
	node, err := f.place.Place(ctx, pr, func(ctx context.Context, name string) error {
		n, ok := f.dir.Node(name)
		if !ok {
			return errdefs.New(errdefs.ErrUnavailable, "node %s left the cluster", name)
		}
		mine := cluster.CreateClaim{Node: name, Tenant: pr.Tenant, Replica: f.replica}
		_, r, ok, err := f.claims.Put(ctx, ck, mine, rev)
		if err != nil {
			return err
		}
		if !ok {
			return errClaimMoved
		}
		rev = r
		out, err := f.sendCreate(ctx, n, m, h)
		if err != nil {
			return err
		}
		mine.ID = out.Id
		cur, r, ok, err := f.claims.Put(ctx, ck, mine, rev)
		switch {
		case err != nil:
			// The claim names the node already: a retry finds the
			// sandbox there.
			f.log.Warn("cluster: record a keyed create's sandbox", "sandbox_id", out.Id, "node", name, "err", err)
		case !ok && r != 0 && cur.Node != name:
			// Moved to another node while this one made it: this one
			// goes, the claim's stays.
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			_, derr := clientFor[pb.DeleteSandboxRequest, pb.DeleteSandboxResponse](f, n, "/shoal.v1.SandboxService/DeleteSandbox").
				CallUnary(dctx, outgoing(&pb.DeleteSandboxRequest{Id: out.Id}, h))
			cancel()
			if derr != nil {
				f.log.Warn("cluster: delete a keyed create's second sandbox", "sandbox_id", out.Id, "node", name, "err", derr)
			}
			return errClaimMoved
		}
		sb = out
		return nil
	})
	return node, sb, err
}

// SetClientKeyTTL sets how long a create's client key is remembered across
// the cluster after its last use (1m to 168h; default 1h). Call before
// serving.
func (f *Forwarder) SetClientKeyTTL(ttl time.Duration) error {
	c, err := cluster.NewClaims(f.dir.Client(), ttl)
	if err != nil {
		return err
	}
	f.claims = c
	return nil
}

// placeAndCreate places create m (the replica's own copy, its template
// expanded), with the client's key claimed in etcd or a key of the
// replica's.
func (f *Forwarder) placeAndCreate(ctx context.Context, pr placement.Request, m *pb.CreateSandboxRequest, h http.Header) (string, *pb.Sandbox, error) {
	if m.ClientKey == "" {
		m.ClientKey = attemptKey()
		return f.placeCreate(ctx, pr, m, h)
	}
	return f.createKeyed(ctx, pr, m, h, cluster.ClaimKey(pr.Tenant, m.ClientKey))
}

// keyedCreateMade reports whether a create with client key clientKey of
// tenant t already has its sandbox (its claim names one): a retry, which
// adds no sandbox to the tenant's quota. An error reading the claim says
// no (the quota is checked).
func (f *Forwarder) keyedCreateMade(ctx context.Context, t, clientKey string) bool {
	if clientKey == "" || f.claims == nil {
		return false
	}
	cl, rev, err := f.claims.Get(ctx, cluster.ClaimKey(t, clientKey))
	return err == nil && rev != 0 && cl.ID != ""
}
