package microvm

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// Commit of a VM's writable layer: it is inside the guest (a tmpfs or the
// ext4 disk), so the guest's agent streams it (agent.Client.ExportUpper:
// the upper directory it opened at boot, with the guest's other processes
// stopped while it sends), and the node reads that stream as the untrusted
// input it is (internal/layer's commit stream). The VM keeps running: a
// QMP stop would stop the agent too.

// exportUpper returns the sandbox.WritableLayer.Export function of h.
func (b *Backend) exportUpper(h sandbox.Handle) func(ctx context.Context, maxDepth int) (io.ReadCloser, error) {
	return func(ctx context.Context, maxDepth int) (io.ReadCloser, error) {
		c := agent.NewClientDialer("sandbox "+h.ID, b.AgentDial(h))
		rc, err := c.ExportUpper(ctx, maxDepth)
		var ae *agent.Error
		if errors.As(err, &ae) && ae.Code == agent.CodeUnsupported {
			return nil, fmt.Errorf("the guest's agent cannot export its writable layer (a VM created before commits were supported?): %w: %w", err, sandbox.ErrUnsupported)
		}
		return rc, err
	}
}
