package control

// The operators' view of a cluster, served by a control replica: the
// dashboard (the same page and sessions as a node's, dash.go), a
// MonitorService.GetStatus that gathers every node's, and the dashboard's
// terminal passed on to the sandbox's node.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/cluster"
	"github.com/shoal-sandbox/shoal/internal/errdefs"
	"github.com/shoal-sandbox/shoal/internal/tenant"
)

// statusTimeout bounds one node's answer to GetStatus: a node slower than
// that is shown unreachable rather than holding the page.
const statusTimeout = 3 * time.Second

// getStatus asks every live node for its status at once and puts the
// answers together: each node named by its cluster name, with its state
// and last heartbeat, each sandbox with its node; the nodes that are down
// or do not answer are listed with their last report, and their sandboxes
// (from the catalog) as lost.
func (f *Forwarder) getStatus(ctx context.Context, req *connect.Request[pb.GetStatusRequest]) (*connect.Response[pb.Status], error) {
	const proc = "/shoal.v1.MonitorService/GetStatus"
	p := tenant.FromContext(ctx)
	live := f.dir.Live()
	results, errs := onEveryNode(live, func(n cluster.NodeInfo) (*pb.Status, error) {
		nctx, cancel := context.WithTimeout(ctx, statusTimeout)
		defer cancel()
		res, err := clientFor[pb.GetStatusRequest, pb.Status](f, n, proc).CallUnary(nctx, outgoing(req.Msg, req.Header()))
		if err != nil {
			return nil, err
		}
		return res.Msg, nil
	})
	out := &pb.Status{Time: timestamppb.Now()}
	lost := func(es []cluster.CatalogEntry, node string) {
		for _, e := range es {
			if p.Sees(e.Tenant) {
				out.Sandboxes = append(out.Sandboxes, &pb.SandboxUsage{
					Id: e.ID, State: "lost", Tenant: e.Tenant, CreatedAt: timestamppb.New(e.Created), Node: node,
					MemoryBytes: -1, CpuUsec: -1,
				})
			}
		}
	}
	for i, n := range live {
		if errs[i] != nil {
			if c := connect.CodeOf(errs[i]); c != connect.CodeUnavailable && c != connect.CodeDeadlineExceeded && c != connect.CodeUnknown {
				return nil, relay(fmt.Errorf("node %s: %w", n.Name, errs[i]))
			}
			f.log.Debug("cluster: node status", "node", n.Name, "err", errs[i])
			if p.IsAdmin() {
				out.Nodes = append(out.Nodes, reportedStatus(n, "unreachable", n.Updated))
			}
			es, err := f.dir.CatalogOf(ctx, n.Tag)
			if err != nil {
				return nil, connect.NewError(connect.CodeUnavailable, err)
			}
			lost(es, n.Name)
			continue
		}
		r := results[i]
		for _, ns := range r.Nodes {
			ns.Name, ns.State, ns.Url = n.Name, "up", n.URL
			ns.HeartbeatAt = timestamppb.New(n.Updated)
			out.Nodes = append(out.Nodes, ns)
		}
		for _, s := range r.Sandboxes {
			s.Node = n.Name
			out.Sandboxes = append(out.Sandboxes, s)
		}
	}
	for _, d := range f.dir.Down() {
		if p.IsAdmin() {
			out.Nodes = append(out.Nodes, reportedStatus(d.Info, "down", d.Since))
		}
		es, err := f.dir.CatalogOf(ctx, d.Info.Tag)
		if err != nil {
			return nil, connect.NewError(connect.CodeUnavailable, err)
		}
		lost(es, d.Info.Name)
	}
	sortUsage(out.Sandboxes)
	return connect.NewResponse(out), nil
}

// reportedStatus is a node that did not answer, as its last capacity
// report (in etcd) describes it.
func reportedStatus(n cluster.NodeInfo, state string, heartbeat time.Time) *pb.NodeStatus {
	ns := &pb.NodeStatus{
		Name: n.Name, State: state, Url: n.URL,
		Sandboxes: int64(n.Load.Sandboxes), SandboxMemoryBytes: n.Load.UsedMemory, SandboxMillicpu: n.Load.UsedMilliCPU,
		MemoryLimitBytes: n.Load.Memory, MillicpuLimit: n.Load.MilliCPU,
	}
	if !heartbeat.IsZero() {
		ns.HeartbeatAt = timestamppb.New(heartbeat)
	}
	if !n.Started.IsZero() {
		ns.StartedAt = timestamppb.New(n.Started)
	}
	return ns
}

// sortUsage orders sandboxes as a node does: oldest first, then by ID.
func sortUsage(sbs []*pb.SandboxUsage) {
	slices.SortStableFunc(sbs, func(a, b *pb.SandboxUsage) int {
		if c := a.GetCreatedAt().AsTime().Compare(b.GetCreatedAt().AsTime()); c != 0 {
			return c
		}
		return strings.Compare(a.Id, b.Id)
	})
}

// proxyTerminal serves the dashboard's terminal for a sandbox of any
// node: it gets a ticket of the sandbox's node for the same key and passes
// the WebSocket on to the node's /dash/terminal, as the page's own origin
// there (the node checks both again).
func (f *Forwarder) proxyTerminal(w http.ResponseWriter, r *http.Request, _ *tenant.Principal, key string) {
	q := r.URL.Query()
	n, err := f.dir.ForSandbox(q.Get("sandbox"))
	if err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	target, err := url.Parse(strings.TrimSuffix(n.URL, "/"))
	if err != nil || target.Host == "" {
		writeConnectError(w, errdefs.New(errdefs.ErrUnavailable, "node %s has a bad URL %q", n.Name, n.URL))
		return
	}
	ticket, err := f.nodeTicket(r.Context(), n, key)
	if err != nil {
		writeConnectError(w, toConnect(err))
		return
	}
	q.Set("ticket", ticket)
	p := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.URL.RawQuery = q.Encode()
			pr.Out.Host = target.Host
			pr.Out.Header.Set("Origin", target.Scheme+"://"+target.Host)
			pr.Out.Header.Del("Cookie")
		},
		Transport:     f.client.Transport,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			writeConnectError(w, errdefs.New(errdefs.ErrUnavailable, "node %s: %v", n.Name, err))
		},
	}
	p.ServeHTTP(w, r)
}

// nodeTicket asks node n for a terminal ticket for key.
func (f *Forwarder) nodeTicket(ctx context.Context, n cluster.NodeInfo, key string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(n.URL, "/")+"/dash/ticket", nil)
	if err != nil {
		return "", err
	}
	req.Header.Set("Authorization", "Bearer "+key)
	res, err := f.client.Do(req)
	if err != nil {
		return "", errdefs.New(errdefs.ErrUnavailable, "node %s: %v", n.Name, err)
	}
	defer res.Body.Close()
	var body struct {
		Ticket  string `json:"ticket"`
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	if err := json.NewDecoder(io.LimitReader(res.Body, 64<<10)).Decode(&body); err != nil || (res.StatusCode == http.StatusOK && body.Ticket == "") {
		return "", errdefs.New(errdefs.ErrUnavailable, "node %s: a bad ticket answer (HTTP %d)", n.Name, res.StatusCode)
	}
	if res.StatusCode != http.StatusOK {
		var code connect.Code
		if code.UnmarshalText([]byte(body.Code)) != nil {
			code = connect.CodeUnavailable
		}
		return "", connect.NewError(code, errors.New("node "+n.Name+": "+body.Message))
	}
	return body.Ticket, nil
}
