package control

import (
	"context"
	"os"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/internal/node"
	"github.com/shoal-sandbox/shoal/internal/reclaim"
	"github.com/shoal-sandbox/shoal/internal/tenant"
	"github.com/shoal-sandbox/shoal/internal/zram"
)

var _ monitorHandler = (*Server)(nil)

// monitorHandler is shoalv1connect.MonitorServiceHandler (named here so
// that the Server's embedded Unimplemented handlers do not hide a missing
// method).
type monitorHandler interface {
	GetStatus(context.Context, *connect.Request[pb.GetStatusRequest]) (*connect.Response[pb.Status], error)
}

// GetStatus is one sample of this node's load and its sandboxes' use, for
// `shoal top` and the dashboard. A tenant's key sees its own sandboxes and
// no node figures.
func (s *Server) GetStatus(ctx context.Context, req *connect.Request[pb.GetStatusRequest]) (*connect.Response[pb.Status], error) {
	p := tenant.FromContext(ctx)
	now := time.Now()
	out := &pb.Status{Time: timestamppb.New(now)}
	name := s.nodeName()
	for _, u := range s.node.Usage() {
		if !p.Sees(u.Tenant) {
			continue
		}
		out.Sandboxes = append(out.Sandboxes, &pb.SandboxUsage{
			Id: u.ID, State: string(u.State), Backend: u.Backend, Tenant: u.Tenant,
			CreatedAt:        timestamppb.New(u.Created),
			MemoryLimitBytes: u.Resources.MemoryBytes, Millicpu: u.Resources.MilliCPU,
			MemoryBytes: u.MemoryBytes, CpuUsec: u.CPUUsec,
			IdleMs: u.Idle.Milliseconds(), CommandsRunning: int32(u.Running),
			Node: name,
		})
	}
	if p.IsAdmin() {
		out.Nodes = []*pb.NodeStatus{s.nodeStatus(name)}
	}
	return connect.NewResponse(out), nil
}

// nodeName is the node's cluster name (SetNodeName), else the host name.
func (s *Server) nodeName() string {
	if s.name != "" {
		return s.name
	}
	name, _ := os.Hostname()
	return name
}

// SetNodeName names the node in its status (a cluster node's
// --node-name). Call it before serving.
func (s *Server) SetNodeName(name string) { s.name = name }

func (s *Server) nodeStatus(name string) *pb.NodeStatus {
	l := s.node.Load()
	ns := &pb.NodeStatus{
		Name: name, State: "up", Sandboxes: int64(l.Sandboxes),
		SandboxMemoryBytes: l.UsedMemory, SandboxMillicpu: l.UsedMilliCPU,
		MemoryLimitBytes: l.Memory, MillicpuLimit: l.MilliCPU,
		CreatesTotal: s.metrics.CreatesOK(),
		StartedAt:    timestamppb.New(s.started),
	}
	if total, avail, cpus, err := node.HostCapacity(); err == nil {
		ns.MemoryTotalBytes, ns.MemoryAvailableBytes, ns.Cpus = total, avail, int32(cpus)
	}
	if total, free, err := reclaim.HostSwap(); err == nil {
		ns.SwapTotalBytes, ns.SwapFreeBytes = total, free
	}
	if act, err := zram.Active(); err == nil && len(act) > 0 {
		ns.SwapZram = true
	}
	load, cpu := node.HostLoad()
	ns.Load1, ns.Load5, ns.Load15, ns.CpuUsec = load[0], load[1], load[2], cpu
	return ns
}
