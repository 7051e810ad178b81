package agent

import (
	"context"
	"io"
)

// ExportUpper asks the agent for the sandbox's writable layer as a commit
// stream (see commit.go): only an agent that holds its overlay's upper
// directory (a VM's) can; others answer CodeUnsupported. The agent stops
// the guest's other processes until the stream ends or the reader is
// closed. maxDepth bounds how deep the agent walks (0: its default). The
// stream comes from inside the sandbox: read it as untrusted input.
func (c *Client) ExportUpper(ctx context.Context, maxDepth int) (io.ReadCloser, error) {
	cc, err := c.open(ctx, OpExportUpper, "", wireExportRequest{MaxDepth: maxDepth})
	if err != nil {
		return nil, err
	}
	if err := cc.readReply(nil); err != nil {
		cc.close()
		return nil, err
	}
	return &fileReader{cc: cc}, nil
}
