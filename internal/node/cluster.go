package node

// What the cluster tier needs of a node: IDs that name it, and the load its
// admission counts, reported to the control tier's placement.

import (
	"fmt"
	"runtime"
)

// MaxIDPrefix bounds Config.IDPrefix: the rest of an ID stays random
// enough (16 base32 characters, 80 bits).
const MaxIDPrefix = 4

// validIDPrefix checks an ID prefix: up to MaxIDPrefix characters of the
// IDs' own alphabet, so that a prefixed ID is still an ID (validID).
func validIDPrefix(p string) error {
	if len(p) > MaxIDPrefix {
		return fmt.Errorf("node config: ID prefix %q is longer than %d characters", p, MaxIDPrefix)
	}
	for _, c := range p {
		if !(c >= 'a' && c <= 'z' || c >= '2' && c <= '7') {
			return fmt.Errorf("node config: ID prefix %q: want characters a-z and 2-7", p)
		}
	}
	return nil
}

// newSandboxID returns a fresh sandbox ID that starts with the node's ID
// prefix.
func (m *Manager) newSandboxID() string {
	id := newID()
	return m.cfg.IDPrefix + id[len(m.cfg.IDPrefix):]
}

// Load is what a node reports to placement: what its admission admits in
// all and what its sandboxes take now, counted as admission counts them
// (the limits of sandboxes that are not paused, and of creates being
// admitted).
type Load struct {
	// Memory and MilliCPU admitted in all: the overcommit ratio times the
	// host's; 0: not bounded.
	Memory, MilliCPU int64
	// UsedMemory and UsedMilliCPU: the limits counted now.
	UsedMemory, UsedMilliCPU int64
	Sandboxes                int // with those being created
	Backends                 []string
}

// Load returns the node's load now.
func (m *Manager) Load() Load {
	var l Load
	c := m.cfg.Capacity
	host := c.Host
	if host == nil {
		host = HostCapacity
	}
	if total, _, cpus, err := host(); err == nil {
		if c.MemoryOvercommit > 0 {
			l.Memory = int64(c.MemoryOvercommit * float64(total))
		}
		if c.CPUOvercommit > 0 {
			l.MilliCPU = int64(c.CPUOvercommit * float64(cpus) * 1000)
		}
	} else if c.CPUOvercommit > 0 {
		l.MilliCPU = int64(c.CPUOvercommit * float64(runtime.NumCPU()) * 1000)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, e := range m.sandboxes {
		l.Sandboxes++
		if e.rec.State != StatePaused {
			l.UsedMemory = satAdd(l.UsedMemory, e.rec.Resources.MemoryBytes)
			l.UsedMilliCPU = satAdd(l.UsedMilliCPU, e.rec.Resources.MilliCPU)
		}
	}
	for _, a := range m.admitting { // disjoint from m.sandboxes
		l.Sandboxes++
		l.UsedMemory = satAdd(l.UsedMemory, a.res.MemoryBytes)
		l.UsedMilliCPU = satAdd(l.UsedMilliCPU, a.res.MilliCPU)
	}
	for name := range m.backends {
		l.Backends = append(l.Backends, name)
	}
	return l
}
