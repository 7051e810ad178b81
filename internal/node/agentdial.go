package node

import (
	"github.com/shoal-sandbox/shoal/internal/agent"
	"github.com/shoal-sandbox/shoal/internal/sandbox"
)

// agentClient returns the client of the agent of the sandbox h of backend
// be: through the backend's dialer when it has one (a VM's channel), else
// the handle's unix socket. It knows what the backend learned of the agent
// (h.Agent).
func (m *Manager) agentClient(be sandbox.Backend, h sandbox.Handle) *agent.Client {
	var c *agent.Client
	if d, ok := be.(sandbox.AgentDialer); ok {
		c = agent.NewClientDialer("sandbox "+h.ID, d.AgentDial(h))
	} else {
		c = agent.NewClient(h.AgentSocket)
	}
	if h.Agent != nil {
		c.Learn(*h.Agent)
	}
	return c
}
