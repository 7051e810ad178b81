package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
)

// Allocator hands out point-to-point /31 links from a node's egress subnet:
// slot i is the pair (subnet + 2i: the host's end, subnet + 2i + 1: the
// sandbox's). It is safe for concurrent use.
type Allocator struct {
	subnet netip.Prefix
	slots  int

	mu   sync.Mutex
	used map[int]string // guarded by mu: slot → sandbox ID
	next int            // guarded by mu: where the next search starts
}

// ErrExhausted: every slot of the subnet is in use.
var ErrExhausted = errors.New("egress subnet exhausted")

// NewAllocator returns an allocator over subnet, an IPv4 prefix of /8 to
// /30 (a /16 gives 32,768 sandboxes).
func NewAllocator(subnet netip.Prefix) (*Allocator, error) {
	if !subnet.Addr().Is4() || subnet.Bits() < 8 || subnet.Bits() > 30 {
		return nil, fmt.Errorf("egress subnet %s: want an IPv4 prefix of /8 to /30", subnet)
	}
	return &Allocator{subnet: subnet.Masked(), slots: 1 << (31 - subnet.Bits()), used: map[int]string{}}, nil
}

// Subnet returns the allocator's subnet.
func (a *Allocator) Subnet() netip.Prefix { return a.subnet }

// Alloc reserves a free slot for id.
func (a *Allocator) Alloc(id string) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := range a.slots {
		s := (a.next + i) % a.slots
		if _, ok := a.used[s]; !ok {
			a.used[s] = id
			a.next = (s + 1) % a.slots
			return s, nil
		}
	}
	return 0, fmt.Errorf("%w: all %d links of %s are in use", ErrExhausted, a.slots, a.subnet)
}

// Reserve marks slot as id's (after a restart, from the persisted handle).
// Reserving a slot held by another sandbox fails.
func (a *Allocator) Reserve(slot int, id string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if slot < 0 || slot >= a.slots {
		return fmt.Errorf("egress slot %d is outside %s", slot, a.subnet)
	}
	if other, ok := a.used[slot]; ok && other != id {
		return fmt.Errorf("egress slot %d is held by sandbox %s", slot, other)
	}
	a.used[slot] = id
	return nil
}

// Free releases slot if id holds it.
func (a *Allocator) Free(slot int, id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.used[slot] == id {
		delete(a.used, slot)
	}
}

// InUse returns the number of slots held.
func (a *Allocator) InUse() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.used)
}

// Addrs returns the host's and the sandbox's address of slot.
func (a *Allocator) Addrs(slot int) (host, sandbox netip.Addr) {
	base := rangeOf(a.subnet).Lo + uint32(2*slot)
	return addrOf(base), addrOf(base + 1)
}
