package shoal

import (
	"context"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
	"github.com/shoal-sandbox/shoal/api/shoal/v1/shoalv1connect"
)

// Status samples the node's load and its sandboxes' memory, CPU time and
// idle time (MonitorService): what `shoal top` and the dashboard show. A
// tenant's key gets its own sandboxes and no node figures. CPU figures are
// cumulative: a rate is the difference of two samples.
func (c *Client) Status(ctx context.Context) (*pb.Status, error) {
	m := shoalv1connect.NewMonitorServiceClient(c.hc, c.url, connect.WithAcceptCompression("gzip", nil, nil))
	res, err := m.GetStatus(ctx, connect.NewRequest(&pb.GetStatusRequest{}))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}
